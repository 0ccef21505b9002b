"""The Lightning integration behaves like DDPStrategy for a user: logging, validation, launchers, precision.

Three 2-rank jobs (``tests/support/lightning_job.py``, the toy MLP split into 2 stages) run concurrently,
since each spends most of its time importing Lightning:

* ``lightning``: DAPPLE, fp32, started by Lightning's own launcher (devices=2 starts rank 1);
* ``torchrun``: Chimera, fp32, started by ``python -m torch.distributed.run`` (Lightning must join it);
* ``bf16``: GPipe, ``precision="bf16-mixed"`` on CPU, Lightning's launcher.

All clip gradients by global norm (``gradient_clip_val`` below every step's norm) and use SGD with
momentum. Meanwhile this process trains the same module on the same data with the default
single-device strategy: the reference for losses, validation losses, gradient norms and parameters.
The CUDA bf16 path is not exercised here (no GPU); only CPU autocast is.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import free_port

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "tests" / "support" / "lightning_job.py"
CLIP = 0.05  # the unclipped global norms are about 0.4 and 0.5
TIMEOUT_S = 180
LAUNCHES = {
    "lightning": ([str(JOB), "--strategy", "dapple"], True),
    "torchrun": (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOB),
                  "--strategy", "chimera"], False),
    "bf16": ([str(JOB), "--strategy", "gpipe", "--precision", "bf16-mixed"], True),
    "sigterm": ([str(JOB), "--strategy", "dapple", "--sigterm-rank", "1"], True),  # lightning_job.stop_by_sigterm
}
TRAINING = [name for name in LAUNCHES if name != "sigterm"]
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
               "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")

pytestmark = pytest.mark.slow


def _env(master_port: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if master_port:  # Lightning's launcher; torchrun --standalone picks its own
        env["MASTER_PORT"] = str(master_port)
    return env


def _reference() -> dict:
    import lightning_job

    threads = torch.get_num_threads()
    try:
        return lightning_job.reference(CLIP)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("lightning_jobs")
    procs, ports = {}, set()
    while len(ports) < len(LAUNCHES):
        ports.add(free_port())
    for (name, (args, master_port)), port in zip(LAUNCHES.items(), sorted(ports)):
        out = base / name
        out.mkdir()
        cmd = [sys.executable, *args, "--out", str(out), "--clip", str(CLIP)]
        with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
            procs[name] = subprocess.Popen(cmd, cwd=out, env=_env(port if master_port else None), stdout=stdout,
                                           stderr=stderr, start_new_session=True)
    try:
        reference = _reference()
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # the whole session: Lightning's rank 1 or torchrun's workers too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    results = {"reference": reference}
    for name, proc in procs.items():
        out = base / name
        stderr = (out / "stderr.txt").read_text()
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        results[name] = {"returncode": proc.returncode, "stderr": stderr,
                         "stdout": (out / "stdout.txt").read_text(),
                         "ranks": sorted(ranks, key=lambda r: r["global_rank"])}
    return results


def _ranks(runs: dict, name: str) -> list[dict]:
    run = runs[name]
    assert run["returncode"] == 0 and len(run["ranks"]) == 2, (
        f"{name}: exit code {run['returncode']}, {len(run['ranks'])} rank files\n"
        f"{run['stdout'][-3000:]}\n{run['stderr'][-5000:]}"
    )
    return run["ranks"]


def test_every_launch_trains_and_exits_cleanly(runs: dict) -> None:
    for name in TRAINING:
        ranks = _ranks(runs, name)
        assert [r["global_rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["world_size"] == 2 and r["global_step"] == 2
            assert not r["process_group_alive"], "teardown must destroy the process group"
            assert r["fetchers"] == ["FetchAhead"], "the next batch is read in the pipeline's bubble"
        assert "terminate called" not in runs[name]["stderr"]
        assert "Traceback" not in runs[name]["stderr"]
        assert "sync_dist=True" not in runs[name]["stderr"], "no metric of PipelineModule should trigger the warning"


def test_train_loss_is_the_same_on_every_rank_and_equals_single_process(runs: dict) -> None:
    """(a) The loss exists on the last stage only; self.log, progress bar and callbacks see it everywhere."""
    reference = [s["train/loss"] for s in runs["reference"]["steps"]]
    for name in ("lightning", "torchrun"):
        ranks = _ranks(runs, name)
        for r in ranks:
            for step in r["steps"]:  # both steps log train/loss: the first and the last (test_metrics.py: the rule)
                assert step["train/loss"] == step["pbar/train/loss"] == step["step_output"]
            assert r["callback_metrics"]["train/loss"] == r["steps"][-1]["train/loss"]
        assert ranks[0]["steps"] == [{**s, "rank_local": 0.0} for s in ranks[1]["steps"]], "ranks see different values"
        assert [s["train/loss"] for s in ranks[0]["steps"]] == pytest.approx(reference, rel=1e-5), name


def test_sync_dist_reduces_over_pipeline_ranks(runs: dict) -> None:
    """(b) self.log(..., sync_dist=True) in a PipelineModule subclass reduces across all ranks, as under DDP."""
    for name in TRAINING:
        for r in _ranks(runs, name):
            assert r["callback_metrics"]["rank_local"] == r["global_rank"], "the logged value differs per rank"
            for step in r["steps"]:
                assert step["rank_sum"] == 0 + 1 and step["rank_mean"] == 0.5
            for val in r["val"]:
                assert val["val/rank_mean"] == 0.5


def test_validation_runs_the_pipeline_and_equals_single_process(runs: dict) -> None:
    """(c) val/loss (sanity check at the initial weights, then after 2 steps) is the unsplit model's loss."""
    reference = runs["reference"]["val"]
    assert [v["sanity"] for v in reference] == [True, False]
    for name in ("lightning", "torchrun"):
        ranks = _ranks(runs, name)
        assert ranks[0]["val"] == ranks[1]["val"]
        assert [v["sanity"] for v in ranks[0]["val"]] == [True, False]
        assert [v["val/loss"] for v in ranks[0]["val"]] == pytest.approx([v["val/loss"] for v in reference], rel=1e-5)
        assert ranks[0]["callback_metrics"]["val/loss"] == ranks[0]["val"][-1]["val/loss"]


def test_external_launcher_is_joined_not_relaunched(runs: dict) -> None:
    """(d) Under torchrun each of the 2 processes is one rank: Lightning starts no process of its own."""
    ranks = _ranks(runs, "torchrun")
    assert all(r["torchelastic"] and r["cluster_environment"] == "TorchElasticEnvironment" for r in ranks)
    assert ranks[0]["ppid"] == ranks[1]["ppid"], "both ranks must be children of torchrun's agent"
    assert ranks[1]["ppid"] != ranks[0]["pid"]
    # for contrast: Lightning's own launcher starts rank 1 from rank 0
    own = _ranks(runs, "lightning")
    assert own[1]["ppid"] == own[0]["pid"] and own[0]["cluster_environment"] == "LightningEnvironment"
    assert "chimera" == ranks[0]["schedule"]


def test_bf16_mixed_on_cpu_is_finite_and_close_to_fp32(runs: dict) -> None:
    """(e) CPU autocast through the pipeline: bf16 activations travel between stages; the GPU path is untested."""
    ranks = _ranks(runs, "bf16")
    reference = runs["reference"]
    assert all(r["received_dtypes"] == ["torch.bfloat16"] for r in ranks)
    assert ranks[0]["steps"] == [{**s, "rank_local": 0.0} for s in ranks[1]["steps"]]
    losses = [s["train/loss"] for s in ranks[0]["steps"]] + [v["val/loss"] for v in ranks[0]["val"]]
    fp32 = [s["train/loss"] for s in reference["steps"]] + [v["val/loss"] for v in reference["val"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(fp32, rel=2e-2)
    assert losses != pytest.approx(fp32, rel=1e-6), "bf16 autocast did not take effect"


def test_global_norm_clipping_matches_single_process(runs: dict) -> None:
    """(f) gradient_clip_val clips by the norm over all stages: parameters after 2 steps equal one process."""
    reference = runs["reference"]
    assert reference["strategy"] == "SingleDeviceStrategy"
    assert min(reference["grad_norms"]) > 2 * CLIP, "clipping must be active in every step"
    expected = {k: torch.tensor(v) for k, v in reference["params"].items()}
    for name in ("lightning", "torchrun"):
        ranks = _ranks(runs, name)
        for r in ranks:
            assert r["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name
        held: dict[str, torch.Tensor] = {}
        for r in ranks:
            for key, value in r["params"].items():
                held[key] = torch.tensor(value)
                err = (held[key] - expected[key]).abs().max().item()
                assert err < 1e-5, f"{name} rank {r['global_rank']}: {key} differs by {err:.2e}"
        assert held.keys() == expected.keys(), f"{name}: the stages together must hold every parameter"


def test_a_sigterm_on_one_rank_stops_every_rank_after_the_same_step(runs: dict) -> None:
    """Rank 1 alone is signalled after step 1: the ranks agree on it a step late (one all-reduce started
    before each step, read after it) and both leave after step 2, marked as signalled, with a subclass of
    Lightning's SIGTERMException that exits 143 (128 + SIGTERM, not 0), the process group ended; no rank
    waits for a peer that left."""
    ranks = _ranks(runs, "sigterm")
    for r in ranks:
        assert r["finished_steps"] == [1, 2] and r["stopped_by"] == "StopRequested" and r["received_sigterm"]
        assert r["exit_code"] == 128 + 15
        assert not r["process_group_alive"]
