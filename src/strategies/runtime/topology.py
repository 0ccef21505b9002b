"""Who is who in W data-parallel replicas of a pipeline group of P workers (Chimera §3.3, Figure 5).

Rank ``r`` is worker ``r % P`` of replica ``r // P``. The topology is the layout's (:meth:`Topology.from_layout`:
the placement of the schedule the launcher validated), never derived from a schedule built again. A worker holds
the stages the placement gives it (one for GPipe/DAPPLE, one per pipeline for Chimera, ``v`` chunks for
interleaved and V-shaped schedules; all distinct). Every copy of a stage (W for GPipe/DAPPLE,
2f·W for Chimera) joins one gradient all-reduce group; tied parameters (first and last stage) get
a group of every rank holding either stage. Pure data: process groups are created from it, in
this order, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_recipes.core.layout import Layout


@dataclass(frozen=True)
class Topology:
    replicas: int  # W
    workers: int  # P: ranks per replica (D, the pipeline's depth in devices)
    stages: int  # S: stages per pipeline (v·P)
    placement: tuple[tuple[int, ...], ...]  # [pipe][stage] -> worker

    @classmethod
    def from_layout(cls, layout: Layout) -> Topology:
        """The topology of the layout the launcher resolved: its W, D, S and the placement of its validated
        schedule (no schedule built again)."""
        if not layout.placement:
            raise ValueError(f"strategy={layout.strategy} is a baseline: it has no pipeline stages to place")
        return cls(layout.W, layout.D, layout.stages, layout.placement)

    @property
    def world_size(self) -> int:
        return self.replicas * self.workers

    def replica_of(self, rank: int) -> int:
        return rank // self.workers

    def worker_of(self, rank: int) -> int:
        return rank % self.workers

    def rank_of(self, replica: int, worker: int) -> int:
        return replica * self.workers + worker

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stage indices held by ``rank``, sorted."""
        worker = self.worker_of(rank)
        return tuple(sorted(s for row in self.placement for s, w in enumerate(row) if w == worker))

    def pipe_of(self, rank: int, stage: int) -> int:
        worker = self.worker_of(rank)
        return next(p for p, row in enumerate(self.placement) if row[stage] == worker)

    def peer(self, rank: int, pipe: int, stage: int) -> int:
        """The rank of ``rank``'s replica that runs ``stage`` of ``pipe``."""
        return self.rank_of(self.replica_of(rank), self.placement[pipe][stage])

    def stage_group(self, stage: int) -> tuple[int, ...]:
        """Every rank holding a copy of ``stage``: the stage's gradient all-reduce group."""
        return tuple(
            sorted(self.rank_of(r, row[stage]) for r in range(self.replicas) for row in self.placement)
        )

    def tied_group(self) -> tuple[int, ...]:
        """Every rank holding the first or the last stage (tied embeddings)."""
        return tuple(sorted(set(self.stage_group(0)) | set(self.stage_group(self.stages - 1))))

    def replica_group(self, replica: int) -> tuple[int, ...]:
        return tuple(self.rank_of(replica, w) for w in range(self.workers))

    def describe(self, rank: int) -> str:
        return (
            f"rank {rank}: replica {self.replica_of(rank)}/{self.replicas}, worker {self.worker_of(rank)}, "
            f"stages {list(self.stages_of(rank))}"
        )
