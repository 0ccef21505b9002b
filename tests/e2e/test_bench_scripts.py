"""The benchmark scripts' pure parts: the end-to-end table, the comparison systems' optimizer, the planner timer."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_e2e  # noqa: E402
import bench_planner  # noqa: E402
import bench_tables  # noqa: E402
import torch_stages  # noqa: E402


def _row(ours: str, theirs: str, ratio: float, same: bool = False) -> dict:
    return {"ours": ours, "theirs": theirs, "same_schedule": same, "ours_median_s": 0.07,
            "theirs_median_s": 0.07 * ratio, "throughput_ratio": ratio, "rounds": 60}


def test_e2e_table_names_the_same_schedule_torch_best_and_the_engine() -> None:
    job = "train.py strategy=dapple"
    data = {"e2e_vs_torch": [_row(job, "ScheduleGPipe", 1.07), _row(job, "Schedule1F1B", 0.93, same=True),
                             {**_row(job, "torch best", 0.93), "best_class": "Schedule1F1B"},
                             _row(job, "engine:dapple", 0.94)]}
    summary, matrix = bench_tables.e2e(data).split("\n\n")
    assert f"| {job} | 0.07 | Schedule1F1B 0.930 | Schedule1F1B 0.930 | 0.94 | 60 |" in summary
    assert "| ours \\ theirs | ScheduleGPipe | Schedule1F1B |" in matrix  # engine and best are not classes
    assert f"| {job} | 1.07 | 0.93 |" in matrix


def test_torch_best_is_the_class_with_the_lowest_median() -> None:
    times = {"job": [1.0, 1.0, 1.0], "A": [0.9, 1.2, 1.1], "B": [1.1, 0.8, 0.95], "engine:dapple": [1.0, 1.0, 1.0]}
    assert bench_e2e.fastest(times, ("A", "B")) == "B"  # medians 1.1 and 0.95
    rows = {r["theirs"]: r for r in bench_e2e.e2e_rows("train.py strategy=dapple", "dapple", times, ("A", "B"))}
    assert rows["torch best"]["best_class"] == "B"
    assert rows["torch best"]["throughput_ratio"] == rows["B"]["throughput_ratio"] == 0.95  # paired, per round
    assert rows["engine:dapple"]["throughput_ratio"] == 1.0 and not rows["A"]["same_schedule"]


def test_comparison_systems_step_the_jobs_optimizer() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    job = torch.optim.AdamW([weight], lr=3e-4, betas=(0.8, 0.9), weight_decay=0.05, fused=True)
    other = bench_e2e.same_optimizer(job)([torch.nn.Parameter(torch.ones(2))])
    assert type(other) is torch.optim.AdamW
    assert other.defaults == job.defaults and other.defaults["fused"] is True
    assert {k: other.defaults[k] for k in ("lr", "betas", "weight_decay")} == {"lr": 3e-4, "betas": (0.8, 0.9),
                                                                             "weight_decay": 0.05}


# The stages rank r of P holds under each of torch.distributed.pipelining's classes (torch's documented
# placements: one stage per rank; a loop for the interleaved class, v = 2; a V for ZBV and DualPipeV).
TORCH_PLACEMENT = {
    "ScheduleGPipe": lambda r, P: (r,),
    "Schedule1F1B": lambda r, P: (r,),
    "ScheduleInterleaved1F1B": lambda r, P: (r, r + P),
    "ScheduleInterleavedZeroBubble": lambda r, P: (r,),
    "ScheduleZBVZeroBubble": lambda r, P: (r, 2 * P - 1 - r),
    "ScheduleDualPipeV": lambda r, P: (r, 2 * P - 1 - r),
}


def test_every_torch_class_has_the_placement_of_ours() -> None:
    assert sorted(torch_stages.torch_classes()) == sorted(TORCH_PLACEMENT)
    assert bench_e2e.SAME_SCHEDULE["dapple"] == "Schedule1F1B"
    assert bench_e2e.SAME_SCHEDULE["zbv"] == "ScheduleZBVZeroBubble"
    for cls, placement in TORCH_PLACEMENT.items():
        for world in (2, 3):
            for rank in range(world):
                assert sorted(torch_stages.stages_held(cls, rank, world)) == sorted(placement(rank, world)), cls


def test_every_torch_class_exists_in_torch() -> None:
    from torch.distributed import pipelining

    assert all(hasattr(pipelining, cls) for cls in torch_stages.torch_classes())


def test_the_committed_record_re_derives_from_its_per_round_times() -> None:
    """``benchmarks/bench.json`` can be checked: every paired ratio of §0, §1 (Chimera vs DAPPLE) and
    §2 (against torch, and Chimera + zero bubble against ours) equals the median of per-round ratios
    recomputed from the times stored beside it."""
    data = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "bench.json").read_text())
    details = data["details"]

    def paired(theirs: list[float], ours: list[float]) -> float:  # their time ÷ ours, per round
        return statistics.median(t / o for t, o in zip(theirs, ours, strict=True))

    times = {r["system"]: r["times_s"] for r in details["vs_torch_times"]}
    for row in data["vs_torch"]:
        assert row["throughput_ratio"] == paired(times[f"theirs:{row['theirs']}"], times[f"ours:{row['ours']}"])
    for row in data["bidirectional"]:
        assert row["throughput_ratio"] == paired(times[f"ours:{row['versus']}"], times[f"ours:{row['schedule']}"])
    rounds = {(r["schedule"], r["D"], r["N"]): r["times_s"] for r in details["efficiency_times"]}
    for row in data["chimera_vs_dapple"]:
        key = (row["D"], row["N"])
        assert row["measured_ratio"] == paired(rounds[("chimera", *key)], rounds[("dapple", *key)])
    for row in data["e2e_vs_torch"]:
        job = details["e2e_times"][row["ours"]]
        theirs = row["best_class"] if row["theirs"] == "torch best" else row["theirs"]
        assert row["throughput_ratio"] == paired(job[theirs], job["job"]), (row["ours"], row["theirs"])


@pytest.mark.slow
def test_planner_timer_reports_a_childs_own_cpu_memory_and_cache() -> None:
    """A child that burns CPU and holds 200 MB: its CPU seconds and peak RSS (``wait4``), its exit status,
    and the empty cache directory it was given (the planner must measure, not read a cache). The timer
    runs in a fresh process, as ``bench_planner.py`` does: Linux carries the caller's own peak into the
    child's across ``exec``, and this test's process may hold more than a GiB."""
    import subprocess

    code = ("import os, time\nx = bytearray(200 * 2**20)\nfor i in range(0, len(x), 4096): x[i] = 1\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print(sorted(os.listdir(os.environ['PIPELINE_RECIPES_CACHE'])))\nraise SystemExit(3)")
    timer = (f"import json, sys; sys.path.insert(0, {str(SCRIPTS)!r}); import bench_planner; "
             f"print(json.dumps(bench_planner.time_command('probe', [sys.executable, '-c', {code!r}])))")
    result = subprocess.run([sys.executable, "-c", timer], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["returncode"] == 3 and row["cpu_s"] >= 0.3 and row["wall_s"] >= row["cpu_s"] - 0.1
    assert 200 * 2**20 <= row["peak_rss_bytes"] < 2**30
    assert row["last_lines"][-1] == "['output.txt']"  # only the timer's own log: an empty cache


def test_hop_seconds_recovers_the_transfer_time_the_simulator_was_given() -> None:
    """``bench.hop_seconds`` inverts ``simulate(..., t_comm=c)``: a step as long as the simulation with
    3 ms per message between workers reads 3 ms, for one-chunk and two-chunk schedules and split
    backwards; a step no longer than the simulation without messages reads 0."""
    import bench

    from pipeline_recipes.strategies.schedules import build_schedule, simulate

    for name, D, N, t_w in [("dapple", 2, 4, None), ("gpipe", 3, 5, None), ("interleaved_1f1b", 2, 4, None),
                            ("zbv", 2, 4, 0.01), ("chimera", 4, 4, None)]:
        schedule = build_schedule(name, D, N)
        step = simulate(schedule, 0.02, 0.04, t_w=t_w, t_comm=0.003).makespan
        assert bench.hop_seconds(schedule, step, 0.02, 0.04, t_w) == pytest.approx(0.003, rel=1e-6), name
        assert bench.hop_seconds(schedule, simulate(schedule, 0.02, 0.04, t_w=t_w).makespan, 0.02, 0.04, t_w) == 0.0


@pytest.mark.slow
def test_the_sharding_benchmark_records_both_variants_side_by_side(tmp_path: Path) -> None:
    """``bench_shard.py --quick``: each layout sharded and whole in one run, the same losses, the sharded rank's
    optimizer state half the whole one's (two copies of every stage), the ratios re-derived from the rows."""
    import bench_shard

    assert bench_shard.main(["--quick", "--out", str(tmp_path / "shard.json")]) == 0
    data = json.loads((tmp_path / "shard.json").read_text())
    assert [(r["layout"], r["variant"]) for r in data["rows"]] == [
        ("chimera D=2 W=1", "whole"), ("chimera D=2 W=1", "sharded"), ("dapple D=1 W=2", "whole"),
        ("dapple D=1 W=2", "sharded")]
    for ratio in data["ratios"]:
        whole, sharded = (next(r for r in data["rows"] if r["layout"] == ratio["layout"] and r["variant"] == v)
                          for v in ("whole", "sharded"))
        assert sharded["losses"] == whole["losses"] and ratio["loss_difference"] == 0.0
        assert sharded["parameter_bytes"] == whole["parameter_bytes"]
        for part, full in zip(sharded["optimizer_state_bytes"], whole["optimizer_state_bytes"]):
            assert 0.49 <= part / full <= 0.51
        assert ratio["optimizer_state_ratio"] == max(s / w for s, w in zip(sharded["optimizer_state_bytes"],
                                                                           whole["optimizer_state_bytes"]))
        assert ratio["time_ratio"] > 0 and data["meta"]["command"].startswith("python scripts/bench_shard.py")


@pytest.mark.slow
def test_the_checkpoint_benchmark_runs_the_three_variants_on_the_same_data(tmp_path: Path) -> None:
    """``bench_checkpoint.py --quick``: no saves, foreground saves and background saves of the same run; the same
    losses, a save at steps 5 (and only there, 8 steps), each with its times and bytes; the ratios re-derived."""
    import bench_checkpoint

    assert bench_checkpoint.main(["--quick", "--out", str(tmp_path / "ckpt.json")]) == 0
    data = json.loads((tmp_path / "ckpt.json").read_text())
    runs = data["runs"]
    assert runs["sync"]["loss_history"] == runs["none"]["loss_history"] == runs["async"]["loss_history"]
    assert runs["none"]["checkpoint_saves"] == []
    for variant in ("sync", "async"):
        [save] = runs[variant]["checkpoint_saves"]
        assert save["step"] == 5 and save["bytes"] > 0 and save["write_s"] >= save["blocking_s"] * (variant == "async")
    blocking = {v: runs[v]["checkpoint_saves"][0]["blocking_s"] for v in ("sync", "async")}
    assert data["ratios"]["async_blocking_over_sync"] == pytest.approx(blocking["async"] / blocking["sync"])
    for variant in ("sync", "async"):
        ends = runs[variant]["step_ends"]
        assert len(ends) == 8 and runs[variant]["steps_per_s"] == pytest.approx(7 / (ends[-1] - ends[0]))
        assert data["ratios"][f"{variant}_throughput"] == pytest.approx(
            runs[variant]["steps_per_s"] / runs["none"]["steps_per_s"])
