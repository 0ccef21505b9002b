"""The run's layout, resolved once by the launcher and read by every worker: plain data (Chimera Table 1: W, D, B,
N, B̂; §3.3 for the placement of stages on workers).

:func:`pipeline_recipes.strategies.schedules.derivation.derive_layout` derives and validates a pipeline's layout (the
launcher calls it through :func:`pipeline_recipes.recipe.check.settings.resolve_layout` before any process starts, the
planner for each layout it compares); the job file carries it to the workers (:meth:`Layout.as_dict`,
:meth:`Layout.from_dict`), whose strategy, engine (``build_engine(model, layout, device)``), topology and tables read
it instead of deriving it again. The engine's config and the planner's candidates hold a layout rather than copies
of W, D, B and N (the schedules' rules still take their raw settings). What a worker can observe itself (its world
size, the batch it is given) it checks against the layout (:meth:`Layout.check_world_size`) rather than deriving the
layout from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["BASELINES", "Layout", "LayoutMismatch"]

BASELINES = ("ddp", "single")  # the strategies that are not pipelines (D = 1, N = 1; conf/strategy/<name>.yaml)


class LayoutMismatch(ValueError):
    """What a worker observes disagrees with the layout the launcher resolved."""


@dataclass(frozen=True)
class Layout:
    """W data-parallel replicas × D workers of a pipeline, B samples per micro-batch, N micro-batches per step and
    replica (B̂ = W·B·N, the global batch), and the settings the runtime runs with."""

    strategy: str  # the schedule's name in the registry, or a baseline's (ddp, single)
    world_size: int
    W: int
    D: int
    B: int
    N: int
    global_batch_size: int
    pipelines: int
    variant: str = ""  # settings beyond the schedule's defaults, e.g. "forward_doubling+eager_opt"
    concat: str = "direct"  # Chimera's N > D method that runs (strategy.concat=auto resolved)
    concat_auto: bool = False  # strategy.concat=auto chose it
    S: int | None = None  # stages the model is split into when a worker holds several (v·D); None: D
    cuda_graphs: bool = False  # strategy.cuda_graphs: repeated blocks replayed as CUDA graphs per micro-batch slot
    chunks: int | None = None  # strategy.chunks as set: stages per worker (v); None: the schedule's own
    grad_sync: str | None = None  # strategy.grad_sync (Chimera §3.2); None: a baseline, which has none
    recompute: str | None = None  # strategy.recompute (GPipe §2.3); None: a baseline, which has none
    placement: tuple[tuple[int, ...], ...] = ()  # [pipeline][stage] → worker of the validated schedule; (): baseline
    precision: str | None = None  # trainer.precision as the launcher resolved it
    shard_optimizer: bool = False  # strategy.shard_optimizer: optimizer state sharded across a stage's copies

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """The layout :meth:`as_dict` wrote (lists read back as tuples); a key it does not know is refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"the job file's layout has keys {', '.join(unknown)} that this version does not know: "
                             "launch the job with the same version of the recipe as its workers")
        values = dict(data)
        values["placement"] = tuple(tuple(row) for row in values.get("placement", ()))
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (lists for tuples), as a job file or a logger's config holds it."""
        out = asdict(self)
        out["placement"] = [list(row) for row in self.placement]
        return out

    @property
    def stages(self) -> int:
        """S: the stages the model is split into (D when each worker holds one)."""
        return self.S if self.S is not None else self.D

    @property
    def label(self) -> str:
        """The strategy as compared: its name plus any non-default variant, e.g. ``chimera+4pipes``."""
        return f"{self.strategy}+{self.variant}" if self.variant else self.strategy

    @property
    def run_name(self) -> str:
        """The run's name in W&B and in comparisons, e.g. ``chimera-W2-D4-B1``."""
        return f"{self.label}-W{self.W}-D{self.D}-B{self.B}"

    def result_fields(self) -> dict[str, Any]:
        """The layout's keys of ``results.json`` (``strategy`` is the :attr:`label`)."""
        return {"strategy": self.label, "W": self.W, "D": self.D, "B": self.B, "N": self.N,
                "global_batch_size": self.global_batch_size, "world_size": self.world_size}

    def check_world_size(self, world_size: int) -> None:
        """The processes that joined are the layout's W·D."""
        if world_size != self.world_size:
            raise LayoutMismatch(
                f"the layout resolved before launch is W·D = {self.W}·{self.D} = {self.world_size} processes but "
                f"{world_size} joined: trainer.devices × trainer.num_nodes must be the same for the launcher and "
                "every worker (start the job with train.py, or give torchrun/SLURM that many processes)")

    def describe(self) -> str:
        return (
            f"layout: {self.label}  W={self.W} replicas × D={self.D} "
            + (f"workers ({self.S} stages) " if self.S not in (None, self.D) else "stages ")
            + f"= {self.world_size} processes; "
            f"B={self.B} × N={self.N} micro-batches × W={self.W} = global batch {self.global_batch_size}"
            + (f"; {self.pipelines} pipelines" if self.pipelines > 1 else "")
            + (f"; concat=auto → {self.concat}" if self.concat_auto else "")
            + ("; CUDA graphs per micro-batch slot (strategy.cuda_graphs=true)" if self.cuda_graphs else "")
            + ("; optimizer state sharded across each stage's copies (strategy.shard_optimizer=true)"
               if self.shard_optimizer else "")
        )
