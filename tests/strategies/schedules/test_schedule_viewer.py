"""The schedule viewer: scripts/schedule.py's command-line contract and strategies.schedules.render."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_recipes.strategies.schedules import Schedule, best_concat, build_schedule, get_spec, simulate
from pipeline_recipes.strategies.schedules.asynchronous import run as async_run
from pipeline_recipes.strategies.schedules.render import Span, ascii_chart, ascii_timeline, to_spans
from schedule_grids import viewer_cases

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "schedule.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("schedule_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


viewer = _load_script()


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = viewer.main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["gpipe", "--stages", "4", "--micro-batches", "4"], build_schedule("gpipe", 4, 4)),
        (["dapple", "--stages", "4", "--micro-batches", "6"], build_schedule("dapple", 4, 6)),
        (
            ["chimera", "--stages", "8", "--micro-batches", "16", "--pipelines", "4"],
            build_schedule("chimera", 8, 16, 4),
        ),
        (
            ["chimera", "--stages", "4", "--micro-batches", "8", "--concat", "forward_doubling"],
            build_schedule("chimera", 4, 8, 2, "forward_doubling"),
        ),
        (
            ["chimera", "--stages", "4", "--micro-batches", "8", "--concat", "backward_halving"],
            build_schedule("chimera", 4, 8, 2, "backward_halving"),
        ),
        (["gems", "--stages", "4", "--micro-batches", "6"], build_schedule("gems", 4, 6)),
        (["pipedream_2bw", "--stages", "4", "--micro-batches", "4", "--steps", "2"], async_run("pipedream_2bw", 4, 4, 2)),
        (["pipedream", "--stages", "3", "--micro-batches", "1"], async_run("pipedream", 3, 1, 3)),
    ],
)
def test_json_round_trips(argv: list[str], expected: Schedule, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main([*argv, "--json"], capsys)
    assert code == 0
    assert out == json.dumps(expected.to_json()) + "\n"
    data = json.loads(out)
    assert list(data) == ["schedule", "stages", "micro_batches", "pipelines", "placement", "workers"]
    assert (data["schedule"], data["stages"], data["pipelines"]) == (expected.name, expected.stages, expected.pipelines)
    restored = Schedule.from_json(data)
    assert (restored.workers, restored.placement) == (expected.workers, expected.placement)
    for action in (a for worker in data["workers"] for a in worker):
        assert set(action) - {"half", "overlap"} == {"kind", "pipe", "stage", "mb"}
        assert action["kind"] in ("F", "B", "I", "W")


def test_json_doubled_forward_and_halved_backward(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["chimera", "--stages", "4", "--micro-batches", "8", "--json", "--concat"]
    doubled = json.loads(run_main([*base, "forward_doubling"], capsys)[1])
    forwards = [a for w in doubled["workers"] for a in w if a["kind"] == "F"]
    assert forwards and all(isinstance(a["mb"], list) and len(a["mb"]) == 2 for a in forwards)
    halved = json.loads(run_main([*base, "backward_halving"], capsys)[1])
    backwards = [a for w in halved["workers"] for a in w if a["kind"] == "B"]
    assert {a["half"] for a in backwards} == {0, 1}
    assert all("half" not in a for w in halved["workers"] for a in w if a["kind"] == "F")


def test_concat_auto_shows_the_method_it_picks(capsys: pytest.CaptureFixture[str]) -> None:
    """``--concat auto`` is strategy.concat=auto's choice (best_concat; the viewer has no micro-batch size,
    so backward halving competes as for an even one)."""
    for n in (4, 8, 16):
        chosen = best_concat(4, n, 2, None)
        code, out, _ = run_main(["chimera", "--stages", "4", "--micro-batches", str(n), "--concat", "auto"], capsys)
        assert code == 0 and f"concat=auto → {chosen}," in out.splitlines()[0]
        code, out, _ = run_main(["chimera", "--stages", "4", "--micro-batches", str(n), "--concat", "auto", "--json"],
                                capsys)
        assert code == 0 and out == json.dumps(build_schedule("chimera", 4, n, 2, chosen).to_json()) + "\n"
    assert best_concat(4, 8, 2, None) == "backward_halving" and best_concat(4, 4, 2, None) == "direct"
    code, _, err = run_main(["dapple", "--stages", "4", "--micro-batches", "8", "--concat", "auto"], capsys)
    assert code == 2 and "--concat applies to schedules that concatenate units of micro-batches (chimera, chimera_zb) only" in err


def test_ascii_chimera_subprocess() -> None:
    result = run_script("chimera", "--stages", "4", "--micro-batches", "4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("P0 ", "P1 ", "P2 ", "P3 ")) and "|" in line]
    assert len(rows) == 4 and not any(line.startswith("P4") for line in lines)
    assert len({len(row) for row in rows}) == 1  # all rows span the same makespan
    sim = simulate(build_schedule("chimera", 4, 4), 1.0, 2.0)
    assert f"bubble ratio: {sim.bubble_ratio:.1%}" in result.stdout
    assert "F0" in rows[0] and "B0" in rows[0] and "p1" in result.stdout  # F/B and the up pipeline
    assert "peak in-flight activations" in result.stdout and "P0: 0F0" in result.stdout


def test_ascii_gpipe_bubble_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["gpipe", "--stages", "4", "--micro-batches", "4", "--t-f", "1", "--t-b", "1"], capsys)
    assert code == 0
    assert "bubble ratio: 42.9%" in out  # (D - 1) / (N + D - 1) = 3/7
    assert "makespan: 14" in out


def test_ascii_cell_widths_follow_costs(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_main(["gpipe", "--stages", "2", "--micro-batches", "1", "--t-f", "1", "--t-b", "2"], capsys)
    row = next(line for line in out.splitlines() if line.startswith("P0 "))
    cells = row.split()[1].strip("|").split("|")  # "|F0  ....|B0=======|" -> F cell, B cell
    forward, backward = cells[0].rstrip("."), cells[1]
    assert forward.startswith("F0") and backward.startswith("B0")
    assert len(backward) + 1 == 2 * (len(forward) + 1)  # each cell's width includes its leading "|"


def test_render_accepts_measured_timelines() -> None:
    sim = simulate(build_schedule("dapple", 2, 2), 1.0, 2.0)
    measured = [[(t.action, t.start * 0.01 + 0.0003, t.end * 0.01) for t in row] for row in sim.timeline]
    spans = to_spans(measured)
    assert spans[0][0] == Span("0", 0.0003, 0.01, "F", 0)
    text = ascii_timeline(measured)
    assert text.count("\nP") == 2 and "bubble ratio" in text
    assert ascii_chart([[("4+5", 0, 2, "F", 1)]]).splitlines()[1].startswith("P0 |F4+5p1")


def test_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chimera.png"
    code, out, _ = run_main(["chimera", "--stages", "4", "--micro-batches", "4", "--png", str(path)], capsys)
    assert code == 0 and str(path) in out
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    "argv, setting",
    [
        (["chimera", "--stages", "3", "--micro-batches", "4"], "stages"),
        (["chimera", "--stages", "4", "--micro-batches", "4", "--pipelines", "3"], "pipelines"),
        (["gpipe", "--stages", "4", "--micro-batches", "4", "--pipelines", "2"], "--pipelines"),
        (["dapple", "--stages", "4", "--micro-batches", "4", "--concat", "forward_doubling"], "--concat"),
        (["gpipe", "--stages", "4", "--micro-batches", "4", "--chunks", "2"], "--chunks"),
        (["gpipe", "--stages", "4", "--micro-batches", "0"], "--micro-batches"),
        (["chimera", "--stages", "4", "--micro-batches", "4", "--pipelines", "0"], "--pipelines"),
        (["dapple", "--stages", "4", "--micro-batches", "4", "--t-b", "-1"], "--t-b"),
        (["gems", "--stages", "4", "--micro-batches", "4", "--pipelines", "4"], "--pipelines"),
        (["dapple", "--stages", "4", "--micro-batches", "4", "--steps", "2"], "--steps"),
        (["pipedream_2bw", "--stages", "4", "--micro-batches", "2"], "N ≥ D"),
        (["pipedream", "--stages", "4", "--micro-batches", "2"], "N must be 1"),
    ],
)
def test_invalid_inputs(argv: list[str], setting: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and setting in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_invalid_input_subprocess() -> None:
    result = run_script("chimera", "--stages", "3", "--micro-batches", "4")
    assert result.returncode == 2 and result.stdout == ""
    assert "stages" in result.stderr and "3" in result.stderr and "Traceback" not in result.stderr


def test_ascii_asynchronous_names_the_steps(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["pipedream_2bw", "--stages", "2", "--micro-batches", "2", "--steps", "4"], capsys)
    assert code == 0
    assert out.startswith("pipedream_2bw: D=2 N=2 per update, 4 updates without flushes, then the drain")
    assert "bubble ratio: 11.1%" in out  # (D - 1) / (T·N + D - 1): only the first fill and the last drain


@pytest.mark.parametrize("name, D, N, options", viewer_cases(),
                         ids=lambda v: "-".join(map(str, v.values())) or "defaults" if isinstance(v, dict) else None)
def test_every_schedule_of_the_registry_is_viewed_as_built(name: str, D: int, N: int, options: dict,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Each registered schedule and each choice its spec offers: the viewer's JSON is the registry's
    schedule and its timeline draws (``--workers`` where a worker holds several stages, else ``--stages``)."""
    several = get_spec(name).total_stages(D, options.get("chunks")) > D
    argv = [name, "--workers" if several else "--stages", str(D), "--micro-batches", str(N)]
    argv += [f"--{k}={v}" for k, v in options.items()]
    code, out, _ = run_main([*argv, "--json"], capsys)
    expected = build_schedule(name, D, N, options.get("pipelines"), options.get("concat", "direct"),
                              chunks=options.get("chunks"))
    assert code == 0 and json.loads(out) == json.loads(json.dumps(expected.to_json()))
    code, out, _ = run_main(argv, capsys)
    assert code == 0 and out.startswith(f"{expected.name}: ")  # the name its generator gives it


def test_workers_and_chunks_build_the_schedules_with_several_stages_per_worker(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_recipes.strategies.schedules.interleaved import interleaved_1f1b
    from pipeline_recipes.strategies.schedules.zero_bubble import zbv

    code, out, _ = run_main(["interleaved_1f1b", "--workers", "4", "--chunks", "3", "--micro-batches", "8", "--json"],
                            capsys)
    assert code == 0 and out == json.dumps(interleaved_1f1b(4, 3, 8).to_json()) + "\n"
    data = json.loads(out)
    assert (data["stages"], len(data["workers"])) == (12, 4)  # S = v·P stages, P lists of actions
    code, out, _ = run_main(["zbv", "--workers", "3", "--micro-batches", "6", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and Schedule.from_json(data) == zbv(3, 6)
    assert {a["kind"] for w in data["workers"] for a in w} == {"F", "I", "W"}
    code, out, _ = run_main(["dapple", "--workers", "3", "--micro-batches", "4", "--json"], capsys)
    assert code == 0 and json.loads(out) == build_schedule("dapple", 3, 4).to_json()  # --workers P = --stages D


def test_overlapped_pairs_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["dualpipev", "--workers", "2", "--micro-batches", "4", "--json"], capsys)
    workers = json.loads(out)["workers"]
    pairs = [(w[i - 1], w[i]) for w in workers for i in range(len(w)) if w[i].get("overlap")]
    assert code == 0 and pairs  # an overlapped pair: two consecutive actions, "overlap": true on the second
    assert all("overlap" not in first and first["kind"] == "F" and second["kind"] == "B" for first, second in pairs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["zbv", "--stages", "4", "--micro-batches", "8"],
         "error: zbv holds 2 stages per worker, so --stages is ambiguous; pass --workers P instead (S = 2·P stages), "
         "e.g. --workers 4\n"),
        (["interleaved_1f1b", "--stages", "4", "--micro-batches", "8"],
         "error: interleaved_1f1b holds 2 stages per worker, so --stages is ambiguous; pass --workers P instead "
         "(S = 2·P stages), e.g. --workers 4\n"),
        (["interleaved_1f1b", "--workers", "4", "--chunks", "1", "--micro-batches", "8"],
         "error: interleaved_1f1b: --chunks = 1 must be an integer ≥ 2 (stages per worker); use --chunks = 2\n"),
        (["dualpipev", "--workers", "4", "--micro-batches", "6"],
         "error: dualpipev needs N ≥ 2·D micro-batches per step (one per stage of the V), got N = 6 (--micro-batches) "
         "< 2·D = 8 (--workers = 4); raise --micro-batches, lower --workers, or use a schedule with no such bound (zbv)\n"),
        (["zb_h1", "--workers", "0", "--micro-batches", "4"],
         "error: --workers must be a positive integer, got 0; pass 1 or more, e.g. --workers 4\n"),
        (["zb_h1", "--workers", "4", "--micro-batches", "4", "--t-w", "3"],
         "error: --t-w is the weight-gradient share of a backward, 0 ≤ t_w ≤ t_b = 2, got 3; e.g. --t-w 1\n"),
    ],
)
def test_bad_sizes_of_the_new_schedules_exit_2_with_one_error_line(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(argv, capsys)
    assert (code, out, err) == (2, "", message)


def test_png_tells_a_workers_two_chunks_apart_by_stage() -> None:
    """ZBV with P = 2 puts stages 0 and 3 on P0: their boxes get different colours, the legend names each
    chunk's stages and the row label the worker's; Chimera's two pipelines keep one colour family each."""
    from matplotlib.colors import to_hex

    from pipeline_recipes.strategies.schedules.render import timeline_figure
    from pipeline_recipes.strategies.schedules.zero_bubble import zbv

    schedule = zbv(2, 4)
    ax = timeline_figure(simulate(schedule, 1.0, 2.0), schedule).axes[0]
    colours = {bar.get_gid(): to_hex(bar.get_facecolor()) for bar in ax.patches}
    assert colours["P0 stage 0 F0"] != colours["P0 stage 3 F0"]
    assert colours["P0 stage 0 F0"] == colours["P1 stage 1 F0"]  # one colour per chunk on every worker
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "forward, stages 0, 1 (chunk 0)" in legend and "forward, stages 2, 3 (chunk 1)" in legend
    assert not any("pipeline" in text for text in legend)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["P0 (stages 0, 3)", "P1 (stages 1, 2)"]
    text = ascii_timeline(simulate(schedule, 1.0, 2.0), schedule)  # the text view names them too
    assert "stages per worker (chunk 0 first" in text and text.count("P0=0,3  P1=1,2") == 1

    chimera = build_schedule("chimera", 4, 4)
    ax = timeline_figure(simulate(chimera, 1.0, 2.0), chimera).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "forward, pipeline 0", "backward, pipeline 0", "forward, pipeline 1", "backward, pipeline 1"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["P0", "P1", "P2", "P3"]
    assert "stages per worker" not in ascii_timeline(simulate(chimera, 1.0, 2.0), chimera)


def test_time_axes_name_their_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The viewer's simulated times are cost units (t_f sets the scale); a figure given a unit shows it."""
    from pipeline_recipes.strategies.schedules.render import timeline_figure

    drawn: list[str] = []

    def save_png(timeline, schedule, path, *, title=None, time_unit=None) -> None:
        drawn.append(timeline_figure(timeline, schedule, title=title, time_unit=time_unit).axes[0].get_xlabel())

    monkeypatch.setattr(viewer, "save_png", save_png)
    code, _, _ = run_main(["gpipe", "--stages", "2", "--micro-batches", "2", "--t-f", "2", "--png",
                           str(tmp_path / "g.png")], capsys)
    assert code == 0 and drawn == ["time (cost units, t_f = 2)"]
    sim = simulate(build_schedule("gpipe", 2, 2), 1.0, 2.0)
    assert timeline_figure(sim, time_unit="ms").axes[0].get_xlabel() == "time (ms)"
