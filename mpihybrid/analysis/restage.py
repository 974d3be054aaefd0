"""A trace's per-stage costs carried to another split of the model into stages (whatif's change
of placement or split: a V from a loop trace, interleaving from 1F1B, partition=2,2), by the
blocks' estimated FLOPs.

    layout = BlockLayout.of(trace.config, num_stages)      # None: the job is not readable
    costs = layout.restage(step_costs, new_num_stages, stage_ranks, speeds)

Inside each of the trace's stages, its measured F, B, W and optimizer tail are shared among its
blocks in proportion to their estimated training FLOPs (nn.model.block_costs) and parameters
(search_costs.calibrated, the rule the schedule search calibrates timed blocks by); the new
stages sum their blocks' shares. The new split is the one asked, or the one the job's own
model.partition makes for that many chunks ("cost" where the trace's list of counts does not
fit). Elementwise work (norms, softmax) is not in the estimate, so a block heavy in it is
carried a little light.

speeds (the trace's `core_probe_s`, train.probe): each pipeline rank's core speed over the run,
as (the ranks the trace's stages ran on, seconds of the probe by pipeline rank). A stage's
costs are first brought to an average core (divided by its rank's probe over the mean) and
the new stages' costs to their own rank's: a trace measures a stage's work on its core, and a
placement change moves blocks between cores that may differ by tens of percent (a V's layers
on both ranks cost 20 % more on one core in one run, docs/analysis.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mpihybrid.pipeline.search_costs import CostsError, SearchCosts, calibrated


@dataclass(frozen=True)
class BlockLayout:
    blocks: SearchCosts  # per block: estimated F = B = W (FLOPs), tail (parameters)
    ranges: list  # the trace's blocks per stage
    model: object  # the job's ModelConfig
    all_blocks: list  # nn.model blocks
    partition: tuple[int, ...] | None = None  # the new split's layers per stage, if asked

    @classmethod
    def of(cls, config_text: str, num_stages: int, partition=None) -> BlockLayout | None:
        from mpihybrid.config import ConfigError, build_job, tomllib
        from mpihybrid.nn.data import task_dims
        from mpihybrid.nn.model import block_costs, block_num_params, build_blocks, chunk_ranges

        try:
            job = build_job(tomllib.loads(config_text or ""))
            blocks = build_blocks(job.model, *task_dims(job.data))
            ranges = chunk_ranges(job.model, blocks, num_stages)
        except (ConfigError, tomllib.TOMLDecodeError, ValueError, TypeError, KeyError):
            return None
        flops = [float(x) for x in block_costs(blocks)]
        floor = 1e-9 * max(max(flops), 1.0)  # a block of no FLOPs (a lookup) still costs a bit
        est = tuple(max(x, floor) for x in flops)
        params = tuple(float(block_num_params(b)) for b in blocks)
        costs = SearchCosts(est, est, est, tail=params, source="the blocks' FLOPs")
        return cls(costs, ranges, job.model, blocks, partition)

    def new_ranges(self, num_stages: int) -> list:
        """The blocks of each new stage: the asked split, else the job's own partition for that
        many chunks; ValueError for a split that does not fit."""
        from mpihybrid.nn.model import chunk_ranges

        if self.partition:
            if len(self.partition) != num_stages:
                raise ValueError(
                    f"partition={','.join(map(str, self.partition))}: {len(self.partition)} "
                    f"counts for {num_stages} stages"
                )
            model = dataclasses.replace(self.model, partition=list(self.partition))
            return chunk_ranges(model, self.all_blocks, num_stages)
        try:
            return chunk_ranges(self.model, self.all_blocks, num_stages)
        except ValueError:  # a list of counts for the trace's stages: the cost split instead
            model = dataclasses.replace(self.model, partition="cost")
            return chunk_ranges(model, self.all_blocks, num_stages)

    def restage(self, costs: SearchCosts, num_stages: int, stage_ranks, speeds=None):
        """`costs` (one step's, per trace stage, W already split where it ran whole) on
        `num_stages` new stages placed by `stage_ranks`; speeds: (the trace's stage ranks,
        probe seconds by pipeline rank), or None to carry costs as measured."""
        factor = None
        if speeds is not None:
            ran_ranks, probe = speeds
            mean = sum(probe) / len(probe)
            factor = [x / mean for x in probe]
            costs = _at_speed(costs, [1 / factor[r] for r in ran_ranks])
        run = dataclasses.replace(costs, can_split=True, whole=())
        if not run.tail:
            run = dataclasses.replace(run, tail=(0.0,) * run.units)
        try:
            per_block = calibrated(self.blocks, self.ranges, run)
        except CostsError as exc:
            raise ValueError(str(exc)) from None
        new = self.new_ranges(num_stages)

        def per(values: tuple) -> tuple:
            return tuple(float(sum(values[i] for i in r)) for r in new)

        out = SearchCosts(
            per(per_block.forward),
            per(per_block.backward),
            per(per_block.weight),
            send=costs.send,
            gap=costs.gap,
            tail=per(per_block.tail),
            fixed=True,
            can_split=True,
            source=f"{costs.source}, restaged",
            stage_ranks=tuple(stage_ranks),
        )
        return out if factor is None else _at_speed(out, [factor[r] for r in stage_ranks])


def _at_speed(costs: SearchCosts, factor: list[float]) -> SearchCosts:
    """`costs` with each stage's F, B, W and tail multiplied by its factor."""

    def times(values):
        if not isinstance(values, tuple | list) or not values:
            return values  # a tail of 0.0: none measured
        return tuple(float(v) * f for v, f in zip(values, factor, strict=True))

    return dataclasses.replace(
        costs,
        forward=times(costs.forward),
        backward=times(costs.backward),
        weight=times(costs.weight),
        tail=times(costs.tail),
    )
