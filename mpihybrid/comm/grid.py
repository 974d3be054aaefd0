"""ProcessGrid: world = pp x dp ranks as a 2-D Cartesian grid, with a communicator per axis.

pipeline-inner (default): rank = dp_rank * pp + pp_rank  -- a pipeline's stages are neighbours
data-inner:               rank = pp_rank * dp + dp_rank  -- a stage's replicas are consecutive ranks
                          (what a cluster with fast intra-node links wants for the all-reduce)
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass
class ProcessGrid:
    world: MPI.Comm
    pp_comm: MPI.Comm  # my pipeline: the pp stages that hold my replica index
    dp_comm: MPI.Comm  # my stage's replicas
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int

    @classmethod
    def build(cls, world: MPI.Comm, pp: int, dp: int, order: str = "pipeline-inner") -> ProcessGrid:
        if pp * dp != world.Get_size():
            raise ValueError(f"pp({pp}) * dp({dp}) = {pp * dp} != world size {world.Get_size()}")
        # Row-major Cartesian ranks: the last dimension varies fastest.
        dims = [dp, pp] if order == "pipeline-inner" else [pp, dp]
        cart = world.Create_cart(dims, periods=[False, False], reorder=False)
        coords = cart.Get_coords(cart.Get_rank())
        if order == "pipeline-inner":
            dp_rank, pp_rank = coords
            pp_comm, dp_comm = cart.Sub([False, True]), cart.Sub([True, False])
        else:
            pp_rank, dp_rank = coords
            pp_comm, dp_comm = cart.Sub([True, False]), cart.Sub([False, True])
        cart.Free()
        assert pp_comm.Get_rank() == pp_rank and dp_comm.Get_rank() == dp_rank
        return cls(world, pp_comm, dp_comm, pp_rank, pp, dp_rank, dp)

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

    def world_rank_of(self, pp_rank: int, dp_rank: int, order: str = "pipeline-inner") -> int:
        if order == "pipeline-inner":
            return dp_rank * self.pp_size + pp_rank
        return pp_rank * self.dp_size + dp_rank

    def tag(self) -> str:
        """Log prefix: [r3 pp1 dp1]."""
        return f"[r{self.rank} pp{self.pp_rank} dp{self.dp_rank}]"

    def free(self) -> None:
        self.pp_comm.Free()
        self.dp_comm.Free()
