"""What a schedule search runs on: seconds of F, B and W per block (the split into chunks is then
searched) or per stage (a trace's split, fixed), the message hop, a rank's gap between actions.

    costs = unit_costs(pp)                 # 2p equal blocks, F = B = W = 1, free messages
    costs = job_costs(job)                 # the job's blocks timed on this machine (F, B, W each)
    costs = trace_costs(trace)             # a run's measured per-stage costs, as analyze uses them
    sim_costs = costs.split(ranges)        # simulate.Costs of the stages these block ranges make
    costs = calibrated(costs, ranges, run) # blocks rescaled to what a run of that split measured

Every way in is checked here (check_values): a NaN, infinite, zero or negative F or B, a negative
W, hop or gap is one line naming the block or stage. check_job says whether a trace's costs are
of the job in front of it (model, data, micro-batch size, pp).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mpihybrid.pipeline.actions import ScheduleError
from mpihybrid.pipeline.simulate import Costs


class CostsError(ScheduleError):
    """Costs a search cannot run on (bad values, another model's trace)."""


@dataclass(frozen=True)
class SearchCosts:
    """Seconds per micro-batch of each unit (a block, or a stage where `fixed`)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]  # input gradient alone
    weight: tuple[float, ...]  # weight gradient alone (0: never measured apart, see can_split)
    send: float = 0.0  # one message hop
    gap: float = 0.0  # a rank's own time between two compute actions
    tail: tuple[float, ...] = ()  # per unit: its last W's extra, the optimizer's update (Costs)
    whole: tuple[float, ...] = ()  # per stage (fixed only): a whole backward's measured seconds
    fixed: bool = False  # units are stages whose split is given: the split is not searched
    can_split: bool = True  # B and W measured apart (a trace of whole backwards: False)
    source: str = "unit"
    stage_ranks: tuple[int, ...] = ()  # a trace's placement (fixed only)
    partition: tuple[int, ...] = ()  # a trace's layer counts per chunk (fixed only)
    # model.vocab_parallel: a share's E, S, T, G seconds (a trace's: per share, and its last G's
    # tail, simulate.Costs.vocab)
    vocab: tuple = ()
    # per unit: what each micro-batch beyond the first adds to a merged W (simulate.Costs's
    # weight_more; empty: W itself, so merging buys nothing and the search does not merge)
    weight_more: tuple[float, ...] = ()

    @property
    def units(self) -> int:
        return len(self.forward)

    def total(self, i: int) -> float:
        """F + B + W of unit i: its own work per micro-batch."""
        return self.forward[i] + self.backward[i] + self.weight[i]

    def split(self, ranges: Sequence[range]) -> Costs:
        """simulate.Costs of the stages made of these unit ranges (fixed: one unit each)."""

        def per(values: tuple[float, ...]) -> list[float]:
            return [float(sum(values[i] for i in r)) for r in ranges]

        whole = list(self.whole) if self.fixed and self.whole else None
        tail = per(self.tail) if self.tail else 0.0
        return Costs(
            forward=per(self.forward),
            backward=per(self.backward),
            weight=per(self.weight),
            send=self.send,
            whole=whole,
            tail=tail,
            gap=self.gap,
            weight_more=per(self.weight_more) if self.weight_more else None,
            vocab=dict(zip(("E", "S", "T", "G", "tail"), self.vocab, strict=False))
            if self.vocab
            else None,
        )

    def as_dict(self) -> dict:
        """Plain lists and numbers (a trace attribute, JSON)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: dict) -> SearchCosts:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names}
        )


def calibrated(blocks: SearchCosts, ranges: Sequence[range], run: SearchCosts) -> SearchCosts:
    """The blocks' costs rescaled stage by stage so that each stage of `ranges` sums to what
    `run` (a run of that split: trace_costs) measured: its F, its B and its W apart (the whole
    backward where the run's were whole), its tail; the run's message hop and gap. Blocks timed
    alone are not what a run pays (the ranks share the machine's caches and memory, a stage's
    passes interleave with another's), and the factor of a stage carries that to every split."""
    if run.units != len(ranges) or sum(len(r) for r in ranges) != blocks.units:
        raise CostsError(
            f"costs from {run.source}: {run.units} stages, the split has {len(ranges)} of "
            f"{blocks.units} blocks"
        )
    out = {k: list(getattr(blocks, k)) for k in ("forward", "backward", "weight", "tail")}
    more = list(blocks.weight_more)  # rescaled as W is: a merged W keeps its ratio to W

    def scale(names: tuple[str, ...], want: float, r: range) -> None:
        have = sum(out[k][i] for k in names for i in r)
        if have <= 0:  # nothing timed there (a block with no parameters has no update)
            out[names[0]][r[-1]] = want
            return
        for k in names:
            for i in r:
                out[k][i] *= want / have

    for s, r in enumerate(ranges):
        scale(("forward",), run.forward[s], r)
        timed_w = [out["weight"][i] for i in r]
        if run.can_split:
            scale(("backward",), run.backward[s], r)
            scale(("weight",), run.weight[s], r)
        else:  # the run's backwards ran whole: B and W keep their timed shares of it
            scale(("backward", "weight"), run.backward[s], r)
        for i, w in zip(r, timed_w, strict=True):
            if more and w > 0:
                more[i] *= out["weight"][i] / w
        if blocks.tail and run.tail:
            scale(("tail",), run.tail[s], r)
    return check_values(
        dataclasses.replace(
            blocks,
            **{k: tuple(v) for k, v in out.items()},
            weight_more=tuple(more),
            send=run.send,
            gap=run.gap,
            source=f"{blocks.source}, calibrated on {run.source}",
        )
    )


def check_values(costs: SearchCosts) -> SearchCosts:
    """The costs themselves, or CostsError naming the first bad value."""
    unit = "stage" if costs.fixed else "block"
    if not costs.units:
        raise CostsError(f"costs from {costs.source}: no {unit}s")
    n = costs.units
    lengths = (len(costs.tail), len(costs.weight_more))
    if len(costs.backward) != n or len(costs.weight) != n or any(x not in (0, n) for x in lengths):
        raise CostsError(
            f"costs from {costs.source}: F, B, W, tail and merged W have different lengths"
        )
    for i, x in enumerate(costs.forward):
        if not math.isfinite(x) or x <= 0:
            raise CostsError(
                f"costs from {costs.source}: {unit} {i} has F = {x!r} s; every F must be a "
                "finite number > 0"
            )
    for name, values in (
        ("B", costs.backward),
        ("W", costs.weight),
        ("tail", costs.tail),
        ("whole", costs.whole),
        ("merged W", costs.weight_more),
    ):
        for i, x in enumerate(values):
            if not math.isfinite(x) or x < 0:
                raise CostsError(f"costs from {costs.source}: {unit} {i} has {name} = {x!r} s")
    for i in range(n):
        if costs.backward[i] + costs.weight[i] <= 0:
            raise CostsError(f"costs from {costs.source}: {unit} {i} has a backward of 0 s")
    for name, x in (("message hop", costs.send), ("gap", costs.gap)):
        if not math.isfinite(x) or x < 0:
            raise CostsError(f"costs from {costs.source}: {name} = {x!r} s")
    return costs


def unit_costs(pp: int, blocks: int | None = None) -> SearchCosts:
    """Equal blocks (2p by default: a V's chunk each, or two per loop stage), F = B = W = 1."""
    n = blocks or 2 * pp
    return SearchCosts((1.0,) * n, (1.0,) * n, (1.0,) * n, source="unit")


def job_costs(job, repeats: int = 3, link: tuple[float, float] = (0.0, 0.0)) -> SearchCosts:
    """The job's blocks timed on this machine, F, B and W apart (nn.profile: the whole model as
    one stage on the job's own micro-batches; the loss rides with the head's F and B), each
    block's optimizer update (the tail its stage's last W carries), what a merged W adds per
    micro-batch (its M micro-batches' W as one: block_merge_ratios), model.vocab_parallel's share
    passes (nn.profile.share_pass_costs), and link = (send, gap) as
    cli.link_probe measured them (0: not measured, one process)."""
    from mpihybrid.nn.profile import (
        block_merge_ratios,
        block_pass_costs,
        block_update_costs,
        share_pass_costs,
    )

    forward, backward, weight = block_pass_costs(job.workload, repeats)
    ratios = block_merge_ratios(job.workload, repeats)  # []: M = 1, nothing to merge
    vocab = share_pass_costs(job, repeats) if job.model.vocab_parallel else ()
    send, gap = link
    return check_values(
        SearchCosts(
            tuple(forward),
            tuple(backward),
            tuple(weight),
            send=float(send),
            gap=float(gap),
            tail=tuple(block_update_costs(job.workload, job.train, repeats)),
            weight_more=tuple(w * r for w, r in zip(weight, ratios, strict=True)) if ratios else (),
            vocab=tuple(vocab),
            source="the job's timed blocks",
        )
    )
