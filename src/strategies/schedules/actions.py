"""Schedule data: the actions a worker executes and the schedule that orders them.

A schedule is plain data (Chimera §3, Figures 2–3): for one pipeline group of ``D`` workers,
each worker's ordered list of actions. The same data is validated, simulated, drawn and executed.

Text form of an action (compact, parses back with :func:`parse_action`)::

    2F0      stage 2, forward of micro-batch 0, pipeline 0
    2B0p1    stage 2, backward of micro-batch 0, pipeline 1
    1F4+5    forward of the doubled micro-batches 4 and 5 (Chimera §3.5, forward doubling)
    1B4h1p1  backward of the second half of micro-batch 4 (Chimera §3.5, backward halving)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["F", "B"]

_ACTION_RE = re.compile(r"^(\d+)([FB])(\d+(?:\+\d+)?)(?:h([01]))?(?:p(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One forward or backward pass of one stage on one (or two) micro-batches.

    ``mbs`` holds one micro-batch index, or two for a doubled forward. ``half`` is ``None``
    unless this is one half of a halved backward (0 or 1).
    """

    kind: Kind
    pipe: int
    stage: int
    mbs: tuple[int, ...]
    half: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"action kind must be 'F' or 'B', got {self.kind!r}")
        if not 1 <= len(self.mbs) <= 2:
            raise ValueError(f"an action covers one or two micro-batches, got {self.mbs}")
        if len(self.mbs) == 2 and self.kind == "B":
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
    def activation_units(self) -> float:
        """Micro-batches of activations this action stores (F) or frees (B)."""
        if self.kind == "F":
            return float(len(self.mbs))
        return 0.5 if self.half is not None else 1.0

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}{'+'.join(map(str, self.mbs))}"
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
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Action:
        mb = data["mb"]
        mbs = tuple(mb) if isinstance(mb, list) else (int(mb),)
        return cls(data["kind"], int(data["pipe"]), int(data["stage"]), mbs, data.get("half"))


def F(stage: int, mb: int | tuple[int, ...], pipe: int = 0) -> Action:
    """Shorthand for a forward action."""
    return Action("F", pipe, stage, mb if isinstance(mb, tuple) else (mb,))


def B(stage: int, mb: int, pipe: int = 0, half: int | None = None) -> Action:
    """Shorthand for a backward action."""
    return Action("B", pipe, stage, (mb,), half)


def parse_action(text: str) -> Action:
    """Parse the compact text form written by ``str(action)``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected STAGE KIND MB[+MB][hHALF][pPIPE], e.g. '2F0' or '1B4h1p1'"
        )
    stage, kind, mbs, half, pipe = match.groups()
    return Action(
        kind,  # type: ignore[arg-type]
        int(pipe or 0),
        int(stage),
        tuple(int(m) for m in mbs.split("+")),
        None if half is None else int(half),
    )


@dataclass(frozen=True)
class Schedule:
    """Every worker's ordered actions for one pipeline group of ``stages`` workers.

    ``placement[pipe][stage]`` is the worker that runs that stage of that pipeline. Each worker
    holds each stage at most once, so a worker's stage copies are keyed by stage index.
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
        """The viewer's ``--json`` form (issue contract): name, sizes and each worker's actions."""
        return {
            "schedule": self.name,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "pipelines": self.pipelines,
            "workers": [[a.to_json() for a in actions] for actions in self.workers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Schedule:
        """Rebuild a schedule from :meth:`to_json`; placement is read off the actions."""
        workers = tuple(tuple(Action.from_json(a) for a in acts) for acts in data["workers"])
        pipes, stages = int(data["pipelines"]), int(data["stages"])
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
