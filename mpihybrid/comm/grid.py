"""ProcessGrid: world = pp x dp ranks, a communicator per axis; where a rank sits is its Layout
(comm/layout.py: pipeline-inner or data-inner)."""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from mpihybrid.comm.layout import Layout


@dataclass
class ProcessGrid:
    world: MPI.Comm
    layout: Layout
    pp_comm: MPI.Comm  # my pipeline: the pp stages that hold my replica index
    dp_comm: MPI.Comm  # my stage's replicas
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int

    @classmethod
    def build(cls, world: MPI.Comm, layout: Layout) -> ProcessGrid:
        if layout.world != world.Get_size():
            raise ValueError(
                f"pp({layout.pp}) * dp({layout.dp}) = {layout.world} != world size "
                f"{world.Get_size()}"
            )
        pp_rank, dp_rank = layout.coords(world.Get_rank())
        # ranked by position: pp_comm's rank is the stage position, dp_comm's the replica index
        pp_comm = world.Split(color=dp_rank, key=pp_rank)
        dp_comm = world.Split(color=pp_rank, key=dp_rank)
        assert pp_comm.Get_rank() == pp_rank and dp_comm.Get_rank() == dp_rank
        return cls(world, layout, pp_comm, dp_comm, pp_rank, layout.pp, dp_rank, layout.dp)

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def prev_rank(self) -> int | None:
        """Previous stage's rank in pp_comm (None on the first stage)."""
        return self.pp_rank - 1 if self.pp_rank > 0 else None

    @property
    def next_rank(self) -> int | None:
        return self.pp_rank + 1 if self.pp_rank < self.pp_size - 1 else None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def replica_neighbour(self, step: int) -> int:
        """World rank of my stage's replica `step` places along the ring (+1 next, -1 previous)."""
        return self.layout.rank(self.pp_rank, (self.dp_rank + step) % self.dp_size)

    def tag(self) -> str:
        """Log prefix: [r3 pp1 dp1]."""
        return f"[r{self.rank} pp{self.pp_rank} dp{self.dp_rank}]"

    def free(self) -> None:
        self.pp_comm.Free()
        self.dp_comm.Free()
