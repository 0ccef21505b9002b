"""Schedule data: the actions a worker executes and the schedule that orders them.

A schedule is plain data (Chimera §3, Figures 2–3): for one pipeline group of ``P`` workers
holding ``S`` stages per pipeline (``S = v·P`` for ``v`` chunks per worker, as in interleaved 1F1B,
Narayanan et al. 2021, §2.2), each worker's ordered list of actions. The same data is validated,
simulated, drawn and executed.

Action kinds: ``F`` forward, ``B`` full backward, and a backward split in two as in Zero Bubble
Pipeline Parallelism (Qi et al. 2024, §2): ``I`` the gradient of the stage's input (what the
previous stage waits for) and ``W`` the gradient of its weights (which nobody waits for, so it can
fill a bubble). ``B`` ≡ ``I`` + ``W``.

Text form of an action (compact, parses back with :func:`parse_action`)::

    2F0      stage 2, forward of micro-batch 0, pipeline 0
    2B0p1    stage 2, backward of micro-batch 0, pipeline 1
    1F4+5    forward of the doubled micro-batches 4 and 5 (Chimera §3.5, forward doubling)
    1B4h1p1  backward of the second half of micro-batch 4 (Chimera §3.5, backward halving)
    3I2 3W2  input gradient, then weight gradient, of micro-batch 2 on stage 3 (zero bubble)
    &5B1     a backward overlapped with the action before it (DualPipeV's forward/backward pairs)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Kind = Literal["F", "B", "I", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")
INPUT_GRADIENT_KINDS = frozenset("BI")  # actions that send a gradient to the previous stage

_ACTION_RE = re.compile(r"^(&)?(\d+)([FBIW])(\d+(?:\+\d+)?)(?:h([01]))?(?:p(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One forward or backward pass of one stage on one (or two) micro-batches.

    ``mbs`` holds one micro-batch index, or two for a doubled forward. ``half`` is ``None``
    unless this is one half of a halved backward (0 or 1). ``overlap`` marks the second action of
    a pair run together with the action before it (DualPipeV); it is not part of the action's
    identity.
    """

    kind: Kind
    pipe: int
    stage: int
    mbs: tuple[int, ...]
    half: int | None = None
    overlap: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 1 <= len(self.mbs) <= 2:
            raise ValueError(f"an action covers one or two micro-batches, got {self.mbs}")
        if len(self.mbs) == 2 and self.kind != "F":
            raise ValueError("only forwards can be doubled (Chimera §3.5)")
        if self.half is not None and (self.kind == "F" or self.half not in (0, 1)):
            raise ValueError("only backwards can be halved, with half 0 or 1")

    @property
    def mb(self) -> int:
        """The first (usually the only) micro-batch of this action."""
        return self.mbs[0]

    @property
    def is_forward(self) -> bool:
        return self.kind == "F"

    @property
    def sends_input_gradient(self) -> bool:
        """A full backward or an input-gradient pass: what the previous stage waits for."""
        return self.kind in INPUT_GRADIENT_KINDS

    @property
    def completes_weight_gradient(self) -> bool:
        """A full backward or a weight-gradient pass: after it the stage's gradients for this micro-batch are in."""
        return self.kind in ("B", "W")

    @property
    def activation_units(self) -> float:
        """Micro-batches of activations this action stores (F) or frees (B, W; I frees none)."""
        if self.kind == "F":
            return float(len(self.mbs))
        if self.kind == "I":  # what W needs stays until W (Zero Bubble §2; counted as the whole graph)
            return 0.0
        return 0.5 if self.half is not None else 1.0

    @property
    def activation_delta(self) -> float:
        """Change in micro-batches of activations held after this action: + for F, − for B and W."""
        return self.activation_units if self.kind == "F" else -self.activation_units

    def __str__(self) -> str:
        text = f"{'&' if self.overlap else ''}{self.stage}{self.kind}{'+'.join(map(str, self.mbs))}"
        if self.half is not None:
            text += f"h{self.half}"
        if self.pipe:
            text += f"p{self.pipe}"
        return text

    def to_json(self) -> dict[str, Any]:
        mb: int | list[int] = self.mbs[0] if len(self.mbs) == 1 else list(self.mbs)
        out: dict[str, Any] = {"kind": self.kind, "pipe": self.pipe, "stage": self.stage, "mb": mb}
        if self.half is not None:
            out["half"] = self.half
        if self.overlap:
            out["overlap"] = True
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Action:
        mb = data["mb"]
        mbs = tuple(mb) if isinstance(mb, list) else (int(mb),)
        return cls(data["kind"], int(data["pipe"]), int(data["stage"]), mbs, data.get("half"),
                   bool(data.get("overlap", False)))


def F(stage: int, mb: int | tuple[int, ...], pipe: int = 0) -> Action:
    """Shorthand for a forward action."""
    return Action("F", pipe, stage, mb if isinstance(mb, tuple) else (mb,))


def B(stage: int, mb: int, pipe: int = 0, half: int | None = None) -> Action:
    """Shorthand for a (full) backward action."""
    return Action("B", pipe, stage, (mb,), half)


def I(stage: int, mb: int, pipe: int = 0, half: int | None = None) -> Action:  # noqa: E743
    """Shorthand for an input-gradient action (zero bubble)."""
    return Action("I", pipe, stage, (mb,), half)


def W(stage: int, mb: int, pipe: int = 0, half: int | None = None) -> Action:
    """Shorthand for a weight-gradient action (zero bubble)."""
    return Action("W", pipe, stage, (mb,), half)


def overlapped(action: Action) -> Action:
    """``action`` marked as run together with the action before it on its worker."""
    return replace(action, overlap=True)


def parse_action(text: str) -> Action:
    """Parse the compact text form written by ``str(action)``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected [&]STAGE KIND MB[+MB][hHALF][pPIPE] with KIND one of "
            f"F, B, I, W, e.g. '2F0', '1B4h1p1' or '3W2'"
        )
    overlap, stage, kind, mbs, half, pipe = match.groups()
    return Action(
        kind,  # type: ignore[arg-type]
        int(pipe or 0),
        int(stage),
        tuple(int(m) for m in mbs.split("+")),
        None if half is None else int(half),
        overlap is not None,
    )


@dataclass(frozen=True)
class Schedule:
    """Every worker's ordered actions for one pipeline group: ``len(workers)`` workers (P) and
    ``stages`` stages per pipeline (S).

    ``placement[pipe][stage]`` is the worker that runs that stage of that pipeline: one stage per
    worker (S = P: GPipe, DAPPLE, Chimera's pipelines), or ``v`` chunks per worker (S = v·P) in a
    loop (interleaved 1F1B: stage s on worker s mod P) or a V (ZBV, DualPipeV: worker w holds
    stages w and 2P − 1 − w). Each worker holds each stage index at most once, so a worker's stage
    copies are keyed by stage index. Two consecutive stages on one worker pass their activations
    and gradients locally, without a message.
    """

    name: str
    stages: int
    micro_batches: int
    placement: tuple[tuple[int, ...], ...]
    workers: tuple[tuple[Action, ...], ...]
    concat: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def pipelines(self) -> int:
        return len(self.placement)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def stages_per_worker(self) -> int:
        """Stage copies each worker holds, over all pipelines (1 for GPipe; 2 for Chimera or v = 2)."""
        return len(self.stages_of(0)) if self.workers else 0

    def worker_of(self, pipe: int, stage: int) -> int:
        return self.placement[pipe][stage]

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """The stage indices worker ``worker`` holds, in pipeline order."""
        return tuple(s for row in self.placement for s, w in enumerate(row) if w == worker)

    def pipe_of_stage(self, worker: int, stage: int) -> int:
        """The pipeline whose copy of ``stage`` lives on ``worker``."""
        for pipe, row in enumerate(self.placement):
            if row[stage] == worker:
                return pipe
        raise KeyError(f"worker {worker} holds no copy of stage {stage}")

    def to_json(self) -> dict[str, Any]:
        """The viewer's ``--json`` form: name, sizes (``stages`` is S; ``workers`` holds P lists) and
        each worker's actions in execution order."""
        return {
            "schedule": self.name,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "pipelines": self.pipelines,
            "placement": [list(row) for row in self.placement],
            "workers": [[a.to_json() for a in actions] for actions in self.workers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Schedule:
        """Rebuild a schedule from :meth:`to_json`; without ``"placement"`` it is read off the actions."""
        workers = tuple(tuple(Action.from_json(a) for a in acts) for acts in data["workers"])
        pipes, stages = int(data["pipelines"]), int(data["stages"])
        if "placement" in data:
            return cls(data["schedule"], stages, int(data["micro_batches"]),
                       tuple(tuple(int(w) for w in row) for row in data["placement"]), workers, data.get("concat"))
        rows = [[-1] * stages for _ in range(pipes)]
        for w, acts in enumerate(workers):
            for a in acts:
                rows[a.pipe][a.stage] = w
        if any(-1 in row for row in rows):
            raise ValueError("schedule JSON leaves a (pipe, stage) without any action")
        return cls(
            data["schedule"], stages, int(data["micro_batches"]), tuple(map(tuple, rows)), workers,
            data.get("concat"),
        )

    def format(self) -> str:
        """One line per worker in compact action text."""
        return "\n".join(f"P{w}: " + " ".join(map(str, acts)) for w, acts in enumerate(self.workers))

    def describe_size(self) -> str:
        """``D = 4`` (one stage per worker) or ``P = 4 workers, S = 8 stages``, ``N = …``, for messages."""
        size = (f"D = {self.stages}" if self.stages == self.num_workers
                else f"P = {self.num_workers} workers, S = {self.stages} stages")
        return f"{size}, N = {self.micro_batches}"
