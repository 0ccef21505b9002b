"""Draw pipeline timelines as text or as a PNG, like Figures 2 and 3 of the Chimera paper.

Chimera (Li & Hoefler, SC '21) draws a schedule as one row per worker with time flowing to the
right: one box per forward or backward pass, labelled with its micro-batch, colored by pipeline
(Figure 3 merges the down and up pipelines), and the gaps between boxes are the bubbles
(Figure 2 compares GPipe, DAPPLE, GEMS and Chimera that way).

Anything with per-worker start and end times can be drawn, so the same functions show a
simulated schedule and, later, one measured by the runtime. A *timeline* is one of:

* a :class:`~strategies.schedules.simulate.Simulation`;
* per-worker rows of ``(Action, start, end)`` or :class:`TimedAction` (e.g. measured seconds);
* per-worker rows of :class:`Span` ``(label, start, end, kind, pipe)``.

Times are in any unit, measured from the start of the iteration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from functools import reduce
from typing import Any, NamedTuple, Union

from .actions import Action, Schedule
from .simulate import Simulation, TimedAction, peak_activations


class Span(NamedTuple):
    """One box of a timeline: ``label`` is the micro-batch text ("0", "4+5", "4h1")."""

    label: str
    start: float
    end: float
    kind: str  # "F", "B", "I" or "W"
    pipe: int


Timeline = Union[Simulation, Sequence[Sequence[Any]]]

LEGEND = (
    "F/B: forward/backward of a micro-batch; pK: pipeline K (none: pipeline 0); "
    "F4+5: doubled forward; B4h1: backward half 1; '.': idle (bubble)"
)
SPLIT_LEGEND = "I/W: input/weight gradient of a split backward (zero bubble); &: overlapped with the action before"
_FILL = {"F": " ", "B": "=", "I": "-", "W": "~"}  # ASCII fill per action kind
_SHADE = {"F": 0.35, "B": 0.75, "I": 0.6, "W": 0.9}  # PNG shade per action kind
_COLOR_FAMILIES = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys", "YlOrBr", "BuGn")


def _mb_label(action: Action) -> str:
    text = "+".join(map(str, action.mbs))
    return text if action.half is None else f"{text}h{action.half}"


def to_spans(timeline: Timeline) -> list[list[Span]]:
    """Normalize any accepted timeline to per-worker lists of :class:`Span`."""
    rows = timeline.timeline if isinstance(timeline, Simulation) else timeline
    out: list[list[Span]] = []
    for row in rows:
        spans = []
        for item in row:
            if isinstance(item, TimedAction):
                item = (item.action, item.start, item.end)
            if isinstance(item[0], Action):
                action, start, end = item
                spans.append(Span(_mb_label(action), float(start), float(end), action.kind, action.pipe))
            else:
                label, start, end, kind, pipe = item
                spans.append(Span(str(label), float(start), float(end), kind, int(pipe)))
        out.append(spans)
    return out


def cell_text(span: Span) -> str:
    """Text of a box in the ASCII timeline, e.g. ``F0``, ``B2p1``, ``F4+5``."""
    return f"{span.kind}{span.label}" + (f"p{span.pipe}" if span.pipe else "")


def _stats(rows: list[list[Span]]) -> tuple[float, float]:
    """(makespan, bubble ratio = idle / (workers × makespan))."""
    makespan = max((s.end for row in rows for s in row), default=0.0)
    if not makespan or not rows:
        return makespan, 0.0
    busy = sum(s.end - s.start for row in rows for s in row)
    return makespan, 1.0 - busy / (makespan * len(rows))


def _quantum(times: Sequence[float]) -> Fraction | None:
    """Largest time step of which every time is a multiple (None for irregular, measured times)."""
    fracs = [Fraction(t).limit_denominator(64) for t in times]
    if any(abs(float(f) - t) > 1e-9 * max(1.0, abs(t)) for f, t in zip(fracs, times)):
        return None
    denom = reduce(math.lcm, (f.denominator for f in fracs), 1)
    step = reduce(math.gcd, (int(f * denom) for f in fracs), 0)
    return Fraction(step, denom) if step else None


def _fmt(t: float) -> str:
    return f"{round(t, 9):g}"


def ascii_chart(timeline: Timeline, *, width: int | None = None) -> str:
    """Time axis, one row per worker (``P0``, ``P1``, ...) and a legend.

    Box widths are proportional to durations. By default the time quantum is the common step
    of all start/end times and each quantum gets enough characters for every label to fit
    (so with ``t_b = 2·t_f`` backward boxes are twice as wide); ``width`` (columns) overrides
    that. Irregular (e.g. measured) times are rounded to columns at the scale where every label fits.
    """
    rows = to_spans(timeline)
    makespan, _ = _stats(rows)
    if not makespan:
        return "(empty timeline)"
    spans = [s for row in rows for s in row if s.end > s.start]
    quantum = None if width else _quantum([t for s in spans for t in (s.start, s.end)])
    if quantum is not None and makespan / quantum > 500:
        quantum = None  # too fine a step (e.g. t_b = 1.01): round to columns instead
    fit = max((len(cell_text(s)) + 1) / (s.end - s.start) for s in spans)  # columns per time unit
    if width:
        scale = width / makespan
    elif quantum is not None:
        scale = math.ceil(fit * float(quantum)) / float(quantum)
    else:
        scale = fit

    def col(t: float) -> int:
        return round(t * scale)

    total = col(makespan)
    name_w = len(f"P{len(rows) - 1}") + 1
    lines = []
    # Time axis: ticks at the first 1/2/5×10^k multiple of the quantum whose labels fit apart.
    unit = float(quantum) if quantum is not None else 10 ** math.floor(math.log10(makespan) - 3)
    for m in (f * 10**e for e in range(12) for f in (1, 2, 5)):
        ticks = [i * m * unit for i in range(int(makespan / (m * unit) + 1e-9) + 1)]
        if m * unit * scale >= max(len(_fmt(t)) for t in ticks) + 1:
            break
    axis = [" "] * (total + 12)
    for t in ticks:
        axis[col(t) : col(t) + len(_fmt(t))] = _fmt(t)
    lines.append("t".ljust(name_w) + "".join(axis).rstrip())
    for w, row in enumerate(rows):
        line = ["."] * total
        for s in row:
            c0, c1 = col(s.start), col(s.end)
            if c1 <= c0:
                continue
            text = cell_text(s)
            body = "|" + text if c1 - c0 > len(text) else text[: c1 - c0]
            line[c0:c1] = body.ljust(c1 - c0, _FILL.get(s.kind, "="))
        lines.append(f"P{w}".ljust(name_w) + "".join(line) + "|")
    lines.append(LEGEND)
    if any(s.kind in "IW" for row in rows for s in row):
        lines.append(SPLIT_LEGEND)
    return "\n".join(lines)


def ascii_timeline(timeline: Timeline, schedule: Schedule | None = None, *, width: int | None = None) -> str:
    """:func:`ascii_chart` followed by makespan, bubble ratio and, given the schedule, each
    worker's peak in-flight activations and action list (:meth:`Schedule.format`)."""
    rows = to_spans(timeline)
    makespan, ratio = _stats(rows)
    if isinstance(timeline, Simulation):
        makespan, ratio = timeline.makespan, timeline.bubble_ratio
    parts = [ascii_chart(rows, width=width), "", f"makespan: {_fmt(makespan)}", f"bubble ratio: {ratio:.1%}"]
    if schedule is not None:
        peaks = timeline.peak_activations if isinstance(timeline, Simulation) else peak_activations(schedule)
        parts.append(
            "peak in-flight activations (micro-batches): " + "  ".join(f"P{w}={p:g}" for w, p in enumerate(peaks))
        )
        parts += ["actions per worker:", schedule.format()]
    return "\n".join(parts)


def save_png(timeline: Timeline, schedule: Schedule | None, path: str, *, title: str | None = None) -> None:
    """Draw ``timeline`` to a PNG at ``path``: rows = workers, one color family per pipeline
    (lighter for forwards, darker for backwards), micro-batch labels in the boxes."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = to_spans(timeline)
    makespan, ratio = _stats(rows)
    if isinstance(timeline, Simulation):
        ratio = timeline.bubble_ratio
    if title is None:
        title = f"bubble ratio {ratio:.1%}"
        if schedule is not None:
            extra = f", {schedule.pipelines} pipelines" if schedule.pipelines > 1 else ""
            title = f"{schedule.name}: {schedule.describe_size().replace(' = ', '=')}{extra}, " + title

    def color(kind: str, pipe: int) -> Any:
        return colormaps[_COLOR_FAMILIES[pipe % len(_COLOR_FAMILIES)]](_SHADE.get(kind, 0.75))

    shortest = min((s.end - s.start for row in rows for s in row if s.end > s.start), default=1.0)
    fig_w = min(max(0.35 * (makespan or 1.0) / shortest + 1.5, 6.0), 40.0)
    fig = Figure(figsize=(fig_w, 0.5 * len(rows) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for w, row in enumerate(rows):
        for s in row:
            ax.barh(w, s.end - s.start, left=s.start, height=0.8, color=color(s.kind, s.pipe),
                    edgecolor="black", linewidth=0.5)
            ax.text((s.start + s.end) / 2, w, s.label, ha="center", va="center", fontsize=8,
                    color="black" if _SHADE.get(s.kind, 0.75) < 0.5 else "white", clip_on=True)
    ax.set_yticks(range(len(rows)), [f"P{w}" for w in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, makespan or 1.0)
    ax.set_xlabel("time")
    ax.set_title(title)
    used = sorted({(s.pipe, s.kind) for row in rows for s in row}, key=lambda k: (k[0], "FBIW".index(k[1])))
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    handles = [Patch(color=color(k, p), label=f"{names[k]}, pipeline {p}") for p, k in used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
