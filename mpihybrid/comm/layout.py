"""Where a rank sits: world = pp x dp ranks, a rank <-> its (pp_rank, dp_rank). Pure, no MPI.

pipeline-inner (default): rank = dp_rank * pp + pp_rank  -- a pipeline's stages are neighbours
data-inner:               rank = pp_rank * dp + dp_rank  -- a stage's replicas are consecutive ranks
                          (what a cluster with fast intra-node links wants for the all-reduce)

The one place that says it: the process grid holds a Layout, and predict, the memory check and
calibration ask it where a rank sits.
"""

from __future__ import annotations

from dataclasses import dataclass

ORDERS = ("pipeline-inner", "data-inner")


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    order: str = "pipeline-inner"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"grid order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"pp ({self.pp}) and dp ({self.dp}) must be at least 1")

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def rank(self, pp_rank: int, dp_rank: int) -> int:
        """The world rank of stage position `pp_rank` in replica `dp_rank`."""
        if not (0 <= pp_rank < self.pp and 0 <= dp_rank < self.dp):
            raise ValueError(f"pp_rank {pp_rank}, dp_rank {dp_rank}: outside {self.pp} x {self.dp}")
        if self.order == "pipeline-inner":
            return dp_rank * self.pp + pp_rank
        return pp_rank * self.dp + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of world rank `rank`."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")
        if self.order == "pipeline-inner":
            return rank % self.pp, rank // self.pp
        return rank // self.dp, rank % self.dp

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        """World ranks of replica `dp_rank`'s pipeline, stage position 0 first."""
        return [self.rank(p, dp_rank) for p in range(self.pp)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        """World ranks of stage position `pp_rank`'s replicas, in ring order (dp_rank 0 first)."""
        return [self.rank(pp_rank, d) for d in range(self.dp)]
