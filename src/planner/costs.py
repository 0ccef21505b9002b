"""Pure cost formulas of the planner (no torch): line fits, α–β messages, Rabenseifner all-reduce.

* CAPTURE (§III-A2, §III-B2) profiles at two batch sizes and fits a straight line through them to
  predict any other batch size; :func:`fit_line` does the same for per-layer times and bytes.
* Chimera §3.4 models a message of ``L`` bytes as ``α + β·L`` (:class:`AlphaBeta`) and the gradient
  all-reduce over ``r`` stage replicas with Rabenseifner's algorithm,
  ``2·log2(r)·α + 2·(r−1)/r·β·L`` (:func:`rabenseifner`).
* :func:`sync_timeline` is §3.4's unoverlapped all-reduce term: each stage copy's all-reduce starts
  when every copy of that stage has launched it (after its last backward for eager sync, after the
  worker's last action otherwise) and the worker's previous all-reduce is done; what runs past the
  end of the worker's computation is the unoverlapped part (Figure 6's free regions).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearFit:
    """``y = a + b·x`` (time or bytes against the micro-batch size)."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    def clamp(self, x: float) -> float:
        """The fitted value, never negative (a noisy intercept may be)."""
        return max(self(x), 0.0)

    def __add__(self, other: LinearFit) -> LinearFit:
        return LinearFit(self.a + other.a, self.b + other.b)

    def scale(self, k: float) -> LinearFit:
        return LinearFit(self.a * k, self.b * k)

    def to_json(self) -> list[float]:
        return [self.a, self.b]

    @classmethod
    def from_json(cls, data: Sequence[float]) -> LinearFit:
        return cls(float(data[0]), float(data[1]))


ZERO = LinearFit(0.0, 0.0)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least-squares line through ``(xs, ys)``; exact through two points (CAPTURE §III-B2)."""
    if len(xs) != len(ys):
        raise ValueError(f"fit_line needs as many x as y values, got {len(xs)} and {len(ys)}")
    if len(set(float(x) for x in xs)) < 2:
        raise ValueError(f"fit_line needs at least two distinct x values (batch sizes), got {list(xs)}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    return LinearFit(my - b * mx, b)


def robust_line(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Theil–Sen line (median of pairwise slopes): one noisy micro-benchmark cannot tilt it."""
    if len(xs) != len(ys) or len(set(float(x) for x in xs)) < 2:
        raise ValueError(f"robust_line needs matching x/y values with two distinct x, got {list(xs)}, {list(ys)}")
    pts = sorted(zip(xs, ys))
    slopes = [(y2 - y1) / (x2 - x1) for k, (x1, y1) in enumerate(pts) for x2, y2 in pts[k + 1 :] if x2 != x1]
    slopes.sort()
    mid = len(slopes) // 2
    b = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    rest = sorted(y - b * x for x, y in pts)
    m = len(rest) // 2
    a = rest[m] if len(rest) % 2 else (rest[m - 1] + rest[m]) / 2
    return LinearFit(a, b)


@dataclass(frozen=True)
class AlphaBeta:
    """Latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) of the α–β model (Chimera §3.4)."""

    alpha: float
    beta: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    def to_json(self) -> dict[str, float]:
        return {"alpha": self.alpha, "beta": self.beta}

    @classmethod
    def from_json(cls, data: Mapping[str, float]) -> AlphaBeta:
        return cls(float(data["alpha"]), float(data["beta"]))


def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``samples`` (linear interpolation between order statistics)."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def rabenseifner(replicas: int, nbytes: float, alpha: float, beta: float) -> float:
    """All-reduce time of ``nbytes`` over ``replicas`` processes (Rabenseifner; Chimera §3.4, eq. above (1)).

    ``2·log2(r)·α + 2·(r−1)/r·β·L``; zero for a single replica (nothing to synchronise).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas == 1 or nbytes <= 0:
        return 0.0
    return 2.0 * math.log2(replicas) * alpha + 2.0 * (replicas - 1) / replicas * beta * nbytes


def allreduce_from_pair(fit: LinearFit) -> AlphaBeta:
    """α, β of Rabenseifner's formula from a 2-process all-reduce timing line ``t = a + b·L``.

    With ``r = 2`` the formula is ``2α + β·L``, so ``α = a / 2`` and ``β = b``.
    """
    return AlphaBeta(max(fit.a, 0.0) / 2.0, max(fit.b, 0.0))


@dataclass(frozen=True)
class Collective:
    """One gradient all-reduce: who takes part, when each member may launch it, how long it takes."""

    name: str
    members: tuple[int, ...]  # workers (all replicas behave alike)
    launch: Mapping[int, float]  # worker -> earliest launch time
    duration: float


def sync_timeline(collectives: Sequence[Collective], compute_end: Sequence[float]) -> list[float]:
    """Per worker, when its last all-reduce finishes (or its computation, if later).

    Collectives run one at a time per worker, in the order of their readiness; one starts when all
    its members launched it and are done with their previous ones (Chimera §3.2, §3.4).
    """
    free = list(compute_end)
    busy = [0.0] * len(compute_end)  # when each worker's previous collective ends
    pending = sorted(collectives, key=lambda c: (max(c.launch.values(), default=0.0), c.name))
    for c in pending:
        if not c.members or c.duration <= 0:
            continue
        start = max(max(c.launch[w] for w in c.members), max(busy[w] for w in c.members))
        for w in c.members:
            busy[w] = start + c.duration
    return [max(f, b) for f, b in zip(free, busy)]


def parse_bytes(text: str | int | float) -> int:
    """``"8GiB"``, ``"512MB"``, ``"1.5e9"`` or a number → bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in units or not number:
        raise ValueError(f"cannot read a memory size from {text!r}; use e.g. 8GiB, 512MB or 1e9")
    return int(float(number) * units[unit])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
