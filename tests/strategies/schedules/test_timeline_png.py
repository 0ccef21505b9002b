"""A drawn timeline reads at its natural size: a long step wraps into bands instead of one ever wider strip."""

from __future__ import annotations

import random
import struct
from pathlib import Path

from pipeline_recipes.strategies.schedules import build_schedule, simulate
from pipeline_recipes.strategies.schedules.render import save_png, timeline_figure

MAX_WIDTH_PX = 1920  # a laptop screen's width: the picture needs no zoom, no scrolling sideways
LABEL_PX = 13  # 8 pt at 120 dpi, the size of the boxes' labels and the smallest text a person reads there


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk (bytes 16-24, big-endian), as any image viewer reads it."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def measured_chimera_step() -> list[list[tuple]]:
    """A step as rank 0 gathers it: Chimera at D = 2, N = 32 (the default run), every action's start and end in ms,
    the forwards about 2 ms and the backwards about 4 ms with jitter, as a loaded CPU measures them."""
    schedule = build_schedule("chimera", 2, 32)
    rng = random.Random(0)
    return [[(timed.action, timed.start * 2.0 + rng.random(), timed.end * 2.0 + 0.5 + rng.random())
             for timed in row] for row in simulate(schedule, 1.0, 2.0).timeline]


def test_a_long_measured_step_wraps_into_bands_a_screen_shows_whole(tmp_path: Path) -> None:
    """The default run's 128 boxes (2 ranks × 2 pipelines' 32 forwards and backwards over 2 stages each) drawn one
    strip would be 4,003 × 332 px with its labels overlapping; wrapped, the PNG fits a screen's width, each band's
    time axis goes on where the one above stopped, and (nearly) every box shows its micro-batch."""
    rows = measured_chimera_step()
    path = tmp_path / "timeline.png"
    save_png(rows, None, str(path), title="chimera-W1-D2-B1: measured step (rows = ranks)", time_unit="ms")
    width, height = png_size(path)
    assert width <= MAX_WIDTH_PX and height <= width, (width, height)

    fig = timeline_figure(rows, None, time_unit="ms")
    axes = fig.axes
    assert len(axes) > 1
    assert [ax.get_xlim()[1] for ax in axes[:-1]] == [ax.get_xlim()[0] for ax in axes[1:]]  # one time axis, wrapped
    assert axes[0].get_xlim()[0] == 0 and axes[-1].get_xlim()[1] == max(end for row in rows for _, _, end in row)
    boxes = sum(len(row) for row in rows)
    assert boxes == 2 * 2 * 32
    labels = [text for ax in axes for text in ax.texts]
    assert len(labels) >= 0.9 * boxes
    assert min(text.get_fontsize() for text in labels) * 120 / 72 >= LABEL_PX
    assert axes[-1].get_xlabel() == "time (ms)" and axes[0].get_legend() is not None


def test_a_short_schedule_stays_one_band(tmp_path: Path) -> None:
    """A picture of the README's size (D = 4, N = 8) is one band, every box labelled."""
    schedule = build_schedule("chimera", 4, 8)
    sim = simulate(schedule, 1.0, 2.0)
    fig = timeline_figure(sim, schedule)
    assert len(fig.axes) == 1
    assert len(fig.axes[0].texts) == sum(len(row) for row in sim.timeline)
    path = tmp_path / "chimera.png"
    save_png(sim, schedule, str(path))
    assert png_size(path)[0] <= MAX_WIDTH_PX
