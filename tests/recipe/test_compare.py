"""Run results: recipe.results (write/read/find/table) and scripts/compare.py's command-line contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_recipes.recipe.report.results import (BUBBLE_NOTE, RESULT_KEYS, RunResult, find_results, read_results,
                                             summary_table, write_results)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare.py"


def _ok(strategy: str, D: int, B: int, speed: float, **extra) -> dict:
    W, N = extra.pop("W", 2), extra.pop("N", 4)
    fields = dict(
        status="ok", strategy=strategy, W=W, D=D, B=B, N=N, global_batch_size=W * B * N, world_size=W * D,
        samples_per_s=speed, tokens_per_s=speed * 128, iteration_s=W * B * N / speed,
        bubble_ratio_measured=0.2, bubble_ratio_theory=0.25, peak_memory_bytes=[3 * 2**20, 5 * 2**20],
        loss_history=[4.0, 3.5, 3.25], final_loss=3.25,
    )
    return fields | extra


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A multirun directory: jobs 0..11 (so 10 and 11 sort after 2), one skipped and one failed."""
    root = tmp_path / "multirun" / "2026-11-22" / "10-00-00"
    jobs = [
        _ok("gpipe", 4, 1, 10.0),
        _ok("dapple", 4, 1, 12.5),
        _ok("chimera", 4, 1, 15.0),
        dict(status="skipped", reason="chimera needs an even D", strategy="chimera", W=1, D=3, B=1, N=4),
        _ok("gpipe", 4, 2, 11.0),
        _ok("dapple", 4, 2, 14.0),
        _ok("chimera", 4, 2, 17.5),
        dict(status="failed", reason="CUDA out of memory", strategy="gpipe", W=1, D=2, B=8, N=2),
        _ok("gpipe", 2, 1, 20.0),
        _ok("dapple", 2, 1, 21.0),
        _ok("chimera", 2, 1, 22.0),
        _ok("ddp", 1, 1, 30.0, W=4),
    ]
    for num, fields in enumerate(jobs):
        write_results(root / str(num), **fields)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_write_results_fills_every_key_and_round_trips(tmp_path: Path) -> None:
    path = write_results(tmp_path / "job", status="skipped", reason="needs 8 GPUs", strategy="chimera")
    assert path == tmp_path / "job" / "results.json"
    data = json.loads(path.read_text())
    assert tuple(data) == RESULT_KEYS
    assert data["samples_per_s"] is None and data["peak_memory_bytes"] == [] and data["loss_history"] == []
    result = read_results(path)
    assert result == RunResult(status="skipped", reason="needs 8 GPUs", strategy="chimera", path=path)
    assert read_results(tmp_path / "job") == result  # a job directory works too

    full = write_results(tmp_path / "x.json", **_ok("gpipe", 4, 2, 8.0, final_loss=float("nan")))
    again = read_results(full)
    assert again.peak_memory_bytes == (3 * 2**20, 5 * 2**20) and again.peak_memory_mib == 5.0
    assert again.final_loss is None  # NaN is not JSON; it is written as null
    assert again.to_dict()["loss_history"] == [4.0, 3.5, 3.25]


def test_write_results_rejects_unknown_keys_and_statuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown results key.*'throughput'"):
        write_results(tmp_path, status="ok", throughput=3.0)
    with pytest.raises(ValueError, match="status must be one of"):
        write_results(tmp_path, status="oom")
    assert not (tmp_path / "results.json").exists()


def test_find_results_accepts_sweeps_jobs_and_files_in_a_stable_order(sweep: Path) -> None:
    found = find_results([sweep])
    assert [r.path.parent.name for r in found] == [str(n) for n in range(12)]
    assert find_results([sweep / "3", sweep / "1" / "results.json", sweep]) == (
        [found[3], found[1]] + [r for i, r in enumerate(found) if i not in (1, 3)]
    )
    with pytest.raises(FileNotFoundError, match="nope"):
        find_results([sweep / "nope"])


def test_summary_table_sorts_fastest_first_then_skipped_then_failed(sweep: Path) -> None:
    lines = summary_table(find_results([sweep])).splitlines()
    header, rule, rows, note = lines[0], lines[1], lines[2:-1], lines[-1]
    assert note == BUBBLE_NOTE
    assert header.split()[:5] == ["strategy", "W", "D", "B", "N"] and header.rstrip().endswith("status")
    assert set(rule.replace(" ", "")) == {"-"}
    speeds = [float(row.split()[5]) for row in rows[:10]]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] == 30.0
    assert rows[10].startswith("chimera") and rows[10].endswith("skipped: chimera needs an even D")
    assert rows[11].startswith("gpipe") and rows[11].endswith("failed: CUDA out of memory")
    first = rows[0].split()
    assert first[0] == "ddp" and first[8] == "20.0%/25.0%" and first[9] == "5.0" and first[10] == "3.2500"
    assert rows[11].split()[5:11] == ["-"] * 6


@pytest.mark.slow
def test_compare_script_prints_table_writes_png_and_json(sweep: Path, tmp_path: Path) -> None:
    proc = run_script(str(sweep), "--json", str(tmp_path / "rows.json"))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines()[2:] if not line.startswith(("wrote ", "bubble meas/theory:"))]
    assert [row.split()[0] for row in rows[:4]] == ["ddp", "chimera", "dapple", "gpipe"]
    assert "skipped: chimera needs an even D" in rows[-2] and "failed: CUDA out of memory" in rows[-1]
    png = sweep / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000

    data = json.loads((tmp_path / "rows.json").read_text())
    assert [d["samples_per_s"] for d in data[:3]] == [30.0, 22.0, 21.0]
    assert [d["status"] for d in data[-2:]] == ["skipped", "failed"]
    assert set(data[0]) == set(RESULT_KEYS) | {"path"}


@pytest.mark.slow
def test_compare_script_takes_job_dirs_and_png_path(sweep: Path, tmp_path: Path) -> None:
    png = tmp_path / "out" / "chart.png"
    png.parent.mkdir()
    proc = run_script(str(sweep / "0"), str(sweep / "6" / "results.json"), "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()[2:4]] == ["chimera", "gpipe"]
    assert png.stat().st_size > 0 and not (sweep / "0" / "compare.png").exists()


@pytest.mark.parametrize("make_path", [lambda tmp: tmp / "missing", lambda tmp: tmp])
def test_compare_script_errors_without_results(tmp_path: Path, make_path) -> None:
    proc = run_script(str(make_path(tmp_path)))
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_the_bubble_column_says_what_it_counts_under_the_table(sweep: Path) -> None:
    """Under the table, one line defines both halves of ``bubble meas/theory`` as the same quantity (idle share
    of the step) and says what the measured one includes and what the theory assumes."""
    lines = summary_table(find_results([sweep])).splitlines()
    assert "bubble meas/theory" in lines[0]
    note = lines[-1]
    assert note.startswith("bubble meas/theory:") and "1 - busy/(ranks x step span)" in note
    assert "message waits" in note and "host-side stalls" in note
    assert "measured action times" in note and "zero communication" in note
    assert summary_table(find_results([sweep]), note=False).splitlines()[-1].startswith("gpipe")


def test_chart_legend_covers_no_bar(sweep: Path) -> None:
    """The legend sits outside every panel: its box on the canvas overlaps no bar's, the tallest included."""
    import importlib.util

    from matplotlib.patches import Rectangle

    spec = importlib.util.spec_from_file_location("compare_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fig = module.chart(find_results([sweep]))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    bars = [p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle)]
    tallest = max(bars, key=lambda p: p.get_height())
    assert tallest.get_height() == 30.0 and len(bars) == 10
    assert not any(box.overlaps(bar.get_window_extent(renderer)) for bar in bars)
    assert [t.get_text() for t in legend.get_texts()] == ["gpipe", "dapple", "chimera", "ddp"]


def test_chart_panels_share_one_throughput_scale_and_name_their_w(sweep: Path) -> None:
    """Every panel reads on one y-scale (a bar's height compares across D as within a panel) and its title gives
    the replicas W its bars ran at, as the fixture wrote them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fig = module.chart(find_results([sweep]))
    axes = fig.axes
    assert len(axes) == 4  # D = 1 (ddp), 2, 3 (only a skipped run) and 4
    assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes[1:])
    assert len({ax.get_ylim() for ax in axes}) == 1 and axes[0].get_ylim()[1] >= 30.0  # the fastest run, ddp
    assert [ax.get_title() for ax in axes] == ["D = 1, W = 4", "D = 2, W = 1, 2 (under each group)", "D = 3, W = 1",
                                               "D = 4, W = 2"]
