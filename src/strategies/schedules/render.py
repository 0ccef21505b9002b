"""Draw pipeline timelines as text or as a PNG, like Figures 2 and 3 of the Chimera paper.

Chimera (Li & Hoefler, SC '21) draws a schedule as one row per worker with time flowing to the
right: one box per forward or backward pass, labelled with its micro-batch, colored by pipeline
(Figure 3 merges the down and up pipelines), and the gaps between boxes are the bubbles
(Figure 2 compares GPipe, DAPPLE, GEMS and Chimera that way). Where a worker holds several stages
of one pipeline (interleaved 1F1B, ZBV), the PNG also colours each of its chunks apart.

Anything with per-worker start and end times can be drawn, so the same functions show a
simulated schedule and, later, one measured by the runtime. A *timeline* is one of:

* a :class:`~pipeline_recipes.strategies.schedules.simulate.Simulation`;
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

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.simulate import Simulation, TimedAction, peak_activations


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
    held = _stages_held(timeline)
    if any(len(stages) > 1 for stages in held):  # a worker's chunks draw alike: say which stages it runs
        parts.append("stages per worker (chunk 0 first; a box names its micro-batch, the actions below its stage): "
                     + "  ".join(f"P{w}={','.join(map(str, stages))}" for w, stages in enumerate(held)))
    if schedule is not None:
        peaks = timeline.peak_activations if isinstance(timeline, Simulation) else peak_activations(schedule)
        parts.append(
            "peak in-flight activations (micro-batches): " + "  ".join(f"P{w}={p:g}" for w, p in enumerate(peaks))
        )
        parts += ["actions per worker:", schedule.format()]
    return "\n".join(parts)


def _stages(timeline: Timeline) -> list[list[int | None]]:
    """Per worker, the stage of each box of :func:`to_spans` (``None`` for a :class:`Span`, which has none)."""
    rows = timeline.timeline if isinstance(timeline, Simulation) else timeline
    out = []
    for row in rows:
        stages: list[int | None] = []
        for item in row:
            action = item.action if isinstance(item, TimedAction) else item[0]
            stages.append(action.stage if isinstance(action, Action) else None)
        out.append(stages)
    return out


def _stages_held(timeline: Timeline) -> list[list[int]]:
    """Per worker, the stages of one pipeline it runs, when some worker runs several (else one each)."""
    chunks = chunk_of(timeline)
    if not any(chunks.values()):
        return []
    return [sorted({st for st in row if st is not None}) for row in _stages(timeline)]


def chunk_of(timeline: Timeline) -> dict[tuple[int, int], int]:
    """``(pipe, stage) -> chunk``: the stage's place among its worker's stages of that pipeline (0 for the
    first). Schedules with several stages of one pipeline per worker (interleaved 1F1B, ZBV) run a
    worker's chunks one after the other; chunk 0 holds the stages nearest the input."""
    held: dict[tuple[int, int], set[int]] = {}
    for w, (spans, stages) in enumerate(zip(to_spans(timeline), _stages(timeline))):
        for span, stage in zip(spans, stages):
            if stage is not None:
                held.setdefault((w, span.pipe), set()).add(stage)
    return {(pipe, stage): c for (_, pipe), stages in held.items() for c, stage in enumerate(sorted(stages))}


LABEL_PT = 8  # the boxes' micro-batch labels
ROW_IN = 0.5  # height of a worker's row
BAND_GAP_IN = 0.45  # between two bands of a wrapped timeline: the upper band's time ticks
LABEL_IN = 0.35  # time-axis inches a typical box gets, room for its label
MAX_AXIS_IN = 11.0  # the longest time axis of one band: with row names and legend about 1,700 px at DPI
MIN_AXIS_IN = 4.5
MAX_BANDS = 6  # a longer timeline is squeezed into this many bands: the shortest boxes lose their labels
DPI = 120


class Bands(NamedTuple):
    """How a timeline is wrapped: ``count`` bands one above the other, each ``width_in`` inches of time axis."""

    count: int
    width_in: float


def _bands(rows: list[list[Span]], makespan: float) -> Bands:
    """The bands of :func:`timeline_figure`: the time axis gives a typical box (the 10th percentile of the
    durations, so a few very short boxes of a measured step do not stretch it) :data:`LABEL_IN`, and wraps into as
    many bands of at most :data:`MAX_AXIS_IN` as that needs (at most :data:`MAX_BANDS`), so the picture reads at its
    natural size instead of growing ever wider."""
    durations = sorted(s.end - s.start for row in rows for s in row if s.end > s.start)
    typical = durations[len(durations) // 10] if durations else 1.0
    needed = LABEL_IN * (makespan or 1.0) / typical
    count = min(max(math.ceil(needed / MAX_AXIS_IN), 1), MAX_BANDS)
    return Bands(count, min(max(needed / count, MIN_AXIS_IN), MAX_AXIS_IN))


def _label_in(label: str) -> float:
    """Inches of time axis a box needs to show ``label`` at :data:`LABEL_PT` points (a digit is about 0.6 em)."""
    return (0.6 * len(label) + 0.6) * LABEL_PT / 72


def timeline_figure(timeline: Timeline, schedule: Schedule | None = None, *, title: str | None = None,
                    time_unit: str | None = None) -> Any:
    """``timeline`` as a matplotlib ``Figure``: rows = workers, one colour family per pipeline and, where
    a worker holds several stages of one pipeline, per chunk (so a worker's two chunks differ; the
    legend and the row labels name their stages), lighter for forwards, darker for backwards,
    micro-batch labels in the boxes where they fit. ``time_unit`` goes on the time axis, e.g. ``"ms"``. A long
    timeline wraps into bands one above the other, each a slice of the time axis (:func:`_bands`), so that its
    PNG reads at its natural size; the first band carries the title and the legend, the last the time label."""
    # Local: importing matplotlib's figure costs about 1 s (0.97 s by ``python -X importtime``, 2 cores),
    # twenty times the whole schedules package (45 ms); only a drawn figure pays it.
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
    chunks = chunk_of(timeline)
    by_chunk = any(chunks.values())  # some worker holds two or more stages of one pipeline
    stages = _stages(timeline)
    pipes = sorted({s.pipe for row in rows for s in row})

    def group(pipe: int, stage: int | None) -> tuple[int, int]:
        return pipe, chunks.get((pipe, stage), 0) if by_chunk and stage is not None else 0

    families = {g: i for i, g in enumerate(sorted({group(s.pipe, st) for row, sts in zip(rows, stages)
                                                  for s, st in zip(row, sts)}))}

    def color(kind: str, g: tuple[int, int]) -> Any:
        return colormaps[_COLOR_FAMILIES[families[g] % len(_COLOR_FAMILIES)]](_SHADE.get(kind, 0.75))

    bands = _bands(rows, makespan)
    span = (makespan or 1.0) / bands.count
    band_in = max(len(rows), 1) * ROW_IN
    fig = Figure(figsize=(bands.width_in, bands.count * band_in + (bands.count - 1) * BAND_GAP_IN))
    FigureCanvasAgg(fig)
    # the axes fill the figure; savefig's tight box adds the title, ticks, labels and legend around them
    fig.subplots_adjust(left=0.0, right=1.0, bottom=0.0, top=1.0, hspace=BAND_GAP_IN / band_in)
    axes = fig.subplots(bands.count, 1, squeeze=False)[:, 0]
    per_unit = bands.width_in / span  # inches per time unit

    def row_label(w: int) -> str:
        held = sorted({st for st in stages[w] if st is not None})
        return f"P{w} (stages {', '.join(map(str, held))})" if by_chunk and len(held) > 1 else f"P{w}"

    for band, ax in enumerate(axes):
        t0, t1 = band * span, (band + 1) * span if band < bands.count - 1 else makespan or 1.0
        for w, (row, sts) in enumerate(zip(rows, stages)):
            for s, st in zip(row, sts):
                if s.end <= t0 or s.start >= t1:
                    continue
                ax.barh(w, s.end - s.start, left=s.start, height=0.8, color=color(s.kind, group(s.pipe, st)),
                        edgecolor="black", linewidth=0.5, gid=f"P{w} stage {st} {s.kind}{s.label}")
                shown = (max(s.start, t0), min(s.end, t1))  # the part of the box in this band
                if (shown[1] - shown[0]) * per_unit >= _label_in(s.label):
                    ax.text(sum(shown) / 2, w, s.label, ha="center", va="center", fontsize=LABEL_PT,
                            color="black" if _SHADE.get(s.kind, 0.75) < 0.5 else "white", clip_on=True)
        ax.set_yticks(range(len(rows)), [row_label(w) for w in range(len(rows))])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(t0, t1)
    axes[-1].set_xlabel(f"time ({time_unit})" if time_unit else "time")
    ax = axes[0]  # the title and the legend go with the first band
    ax.set_title(title)
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    used = sorted({(group(s.pipe, st), s.kind) for row, sts in zip(rows, stages) for s, st in zip(row, sts)},
                  key=lambda k: (k[0], "FBIW".index(k[1])))
    members: dict[tuple[int, int], list[int]] = {}
    for (pipe, stage), c in sorted(chunks.items()):
        members.setdefault((pipe, c), []).append(stage)

    def group_name(g: tuple[int, int]) -> str:
        pipe, c = g
        name = f"pipeline {pipe}" if len(pipes) > 1 or not by_chunk else ""
        if by_chunk:
            held = members.get(g, [])
            noun = "stage" if len(held) == 1 else "stages"
            name += (", " if name else "") + f"{noun} {', '.join(map(str, held))} (chunk {c})"
        return name

    handles = [Patch(color=color(k, g), label=f"{names[k]}, {group_name(g)}") for g, k in used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def save_png(timeline: Timeline, schedule: Schedule | None, path: str, *, title: str | None = None,
             time_unit: str | None = None) -> None:
    """Draw ``timeline`` to a PNG at ``path`` (:func:`timeline_figure`)."""
    timeline_figure(timeline, schedule, title=title, time_unit=time_unit).savefig(path, dpi=DPI, bbox_inches="tight")
