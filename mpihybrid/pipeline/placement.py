"""Where each global stage lives: the one rule every part of mpihybrid asks.

    placement = Placement.loop(pp=4, chunks=2)   # stage s on rank s % 4 (Megatron, interleaved)
    placement = Placement.v(pp=4)                # rank r holds stages r and 7 - r (ZB-V, DualPipeV)
    placement.rank_of(5), placement.stages_of(1), placement.num_stages, placement.chunks

A schedule's spec names its style (schedules.placement_of); a CSV schedule's rows give it
(Placement.of_actions). The runtime, simulator, as-run grid, memory estimate, predict, timeline
and checkpoints receive the object and never compute a stage's rank themselves. Traces carry it as
the attribute `stage_ranks` (Placement.from_attrs reads it back).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    pp: int
    stage_ranks: tuple[int, ...]  # pp rank of global stage s, s = 0 .. num_stages - 1
    style: str = "loop"  # loop | v | rows (read from a CSV schedule)

    def __post_init__(self) -> None:
        held = [self.stage_ranks.count(r) for r in range(self.pp)]
        if any(not 0 <= r < self.pp for r in self.stage_ranks) or len(set(held)) != 1:
            raise ValueError(
                f"placement {list(self.stage_ranks)} over pp={self.pp}: every rank must hold "
                "the same number of stages"
            )

    @classmethod
    def loop(cls, pp: int, chunks: int = 1) -> Placement:
        """Chunk c of rank r is stage c * pp + r: the pipeline loops back to rank 0."""
        return cls(pp, tuple(s % pp for s in range(pp * chunks)), "loop")

    @classmethod
    def v(cls, pp: int, chunks: int = 2) -> Placement:
        """Down the ranks, then back up: rank r holds stages r and 2p-1-r (a zigzag for more
        chunks). The turns (stage p-1 -> p) stay on one rank: no message."""
        ranks = [s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(pp * chunks)]
        return cls(pp, tuple(ranks), "v")

    @classmethod
    def of_actions(cls, actions: dict[int, list]) -> Placement:
        """The placement a set of per-rank action lists implies (each stage on the rank whose
        list holds it); ValueError when a stage sits on two ranks or a stage is missing."""
        owner: dict[int, int] = {}
        for rank, acts in sorted(actions.items()):
            for a in acts:
                if owner.setdefault(a.stage, rank) != rank:
                    raise ValueError(
                        f"stage {a.stage} is on rank {owner[a.stage]} and on rank {rank} ({a})"
                    )
        missing = sorted(set(range(max(owner, default=-1) + 1)) - set(owner))
        if missing:
            raise ValueError(f"stage {missing[0]} has no action on any rank")
        return cls.named(len(actions), tuple(owner[s] for s in range(len(owner))))

    @classmethod
    def from_attrs(cls, attrs) -> Placement:
        """A trace's (or checkpoint's) placement: its `stage_ranks`, or for files written before
        that attribute existed, the loop placement of its pp and virtual_stages."""
        pp = int(attrs.get("pp", 1))
        if "stage_ranks" not in attrs:
            return cls.loop(pp, int(attrs.get("virtual_stages", 1)))
        return cls.named(pp, tuple(int(r) for r in attrs["stage_ranks"]))

    @classmethod
    def named(cls, pp: int, stage_ranks: tuple[int, ...]) -> Placement:
        """The placement of these ranks, styled loop or v when it is one of those, else rows."""
        chunks = max(len(stage_ranks) // max(pp, 1), 1)
        for known in (cls.loop(pp, chunks), cls.v(pp, chunks)):
            if known.stage_ranks == stage_ranks:
                return known
        return cls(pp, stage_ranks, "rows")

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def chunks(self) -> int:
        """Model chunks (stages) per rank."""
        return self.num_stages // self.pp

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` holds, in stage order (its chunk 0, chunk 1, ...)."""
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's chunks `stage` is (0 = the rank's first)."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    def crosses(self, stage: int, other: int) -> bool:
        """Does a tensor from `stage` to `other` leave the rank? (False past either end.)"""
        if not (0 <= stage < self.num_stages and 0 <= other < self.num_stages):
            return False
        return self.stage_ranks[stage] != self.stage_ranks[other]
