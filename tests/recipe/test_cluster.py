"""The accelerator a job gets and where its processes sit: ``trainer=auto`` on faked GPU and CPU nodes,
torchrun / SLURM / several-node environments as dicts (checked against Lightning's own cluster
environments), the SLURM launcher preset, and two multi-process runs: a faked SLURM job and two
torchrun "nodes" over loopback, each writing ``results.json`` once, from global rank 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline_recipes.core.node import NodeDevices, probe_node
from pipeline_recipes.recipe.check.accelerator import check_precision, resolve_accelerator
from pipeline_recipes.recipe.check.launch_mode import (SLURM_TASK_VARS, Launch, detect_launch, global_rank, is_global_zero,
                                             slurm_port, slurm_root_address, worker_env)
from pipeline_recipes.recipe.check.settings import ConfigError
from pipeline_recipes.recipe.report.results import find_results

ROOT = Path(__file__).resolve().parents[2]
H100_NODE = NodeDevices(cuda_devices=8, bf16=True, gpu_name="NVIDIA H100 80GB HBM3")
V100_NODE = NodeDevices(cuda_devices=4, bf16=False, gpu_name="Tesla V100-SXM2-32GB")
CPU_NODE = NodeDevices()


def _trainer(option: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"trainer={option}", *overrides])
    return OmegaConf.to_container(cfg.trainer, resolve=True)


# -- trainer=auto -------------------------------------------------------------------------------------

def test_auto_is_the_default_and_takes_every_gpu_of_a_bf16_node() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        default = OmegaConf.to_container(compose("config").trainer, resolve=True)
    assert default == _trainer("auto")
    choice = resolve_accelerator(default, H100_NODE)
    assert (choice.trainer["accelerator"], choice.trainer["devices"], choice.trainer["precision"]) == \
        ("gpu", 8, "bf16-mixed")
    assert choice.describe().startswith("accelerator: gpu × 8 per node, bf16-mixed (auto: 8 CUDA devices found")


def test_auto_without_native_bf16_trains_in_fp32() -> None:
    choice = resolve_accelerator(_trainer("auto"), V100_NODE)
    assert (choice.trainer["accelerator"], choice.trainer["devices"], choice.trainer["precision"]) == \
        ("gpu", 4, "32-true")
    assert "no native bf16 on Tesla V100" in choice.reason


def test_auto_without_cuda_runs_the_cpu_job() -> None:
    """No CUDA: CPU processes over gloo, as many as trainer=cpu starts, in fp32."""
    choice = resolve_accelerator(_trainer("auto"), CPU_NODE)
    cpu = _trainer("cpu")
    assert (choice.trainer["accelerator"], choice.trainer["devices"], choice.trainer["precision"]) == \
        ("cpu", cpu["devices"], "32-true")
    assert choice.describe() == f"accelerator: cpu × {cpu['devices']} per node, 32-true (auto: no CUDA)"
    assert resolve_accelerator(_trainer("auto", "trainer.devices=8"), CPU_NODE).trainer["devices"] == 8


def test_auto_under_an_external_launcher_takes_its_processes_per_node() -> None:
    torchrun_node = NodeDevices(cuda_devices=8, bf16=True, launched_per_node=4)
    assert resolve_accelerator(_trainer("auto"), torchrun_node).trainer["devices"] == 4
    assert probe_node({"LOCAL_WORLD_SIZE": "4"}, cuda=False) == NodeDevices(launched_per_node=4)
    assert probe_node({"LOCAL_WORLD_SIZE": "4"}).launched_per_node == 4
    assert probe_node({"SLURM_NTASKS_PER_NODE": "8"}).launched_per_node == 8
    assert probe_node({}).launched_per_node is None
    assert probe_node({"SLURM_NTASKS_PER_NODE": "1"}).launched_per_node is None  # one task per node: its GPUs


def test_cpu_and_gpu_still_force_one() -> None:
    forced_cpu = resolve_accelerator(_trainer("cpu"), H100_NODE)
    assert forced_cpu.trainer["accelerator"] == "cpu" and forced_cpu.reason == "trainer.accelerator=cpu"
    forced_gpu = resolve_accelerator(_trainer("gpu"), H100_NODE)
    # nothing of the gpu preset is changed but its float32_matmul_precision=auto, which is TF32 on an H100
    assert forced_gpu.trainer == {**_trainer("gpu"), "float32_matmul_precision": "high"}
    with pytest.raises(ConfigError, match="no native bf16 .* set trainer.precision=32-true"):
        resolve_accelerator(_trainer("gpu"), V100_NODE)
    with pytest.raises(ConfigError, match=r"this node has no CUDA device .*; set trainer=cpu"):
        resolve_accelerator(_trainer("gpu", "trainer.devices=auto"), CPU_NODE)


@pytest.mark.parametrize("option, node", [("auto", H100_NODE), ("auto", V100_NODE), ("auto", CPU_NODE),
                                          ("cpu", H100_NODE), ("cpu", CPU_NODE), ("gpu", H100_NODE)])
def test_every_trainer_resolves_to_lightning_arguments(option: str, node: NodeDevices) -> None:
    """No ``auto`` is left for Lightning, whose precision flag does not take one (trainer=gpu on a CPU
    node is refused by check_devices, see test_recipes)."""
    from lightning.fabric.connector import _convert_precision_to_unified_args

    trainer = resolve_accelerator(_trainer(option), node).trainer
    assert trainer["accelerator"] in ("cpu", "gpu") and isinstance(trainer["devices"], int)
    assert _convert_precision_to_unified_args(trainer["precision"]) == trainer["precision"]


def test_fp16_with_loss_scaling_is_refused_for_pipelines_only() -> None:
    with pytest.raises(ConfigError, match="trainer.precision = 16-mixed .* strategy=chimera"):
        check_precision("chimera", {"precision": "16-mixed"})
    check_precision("ddp", {"precision": "16-mixed"})
    check_precision("gpipe", {"precision": "bf16-mixed"})


def test_fp16_scaler_with_a_fused_optimizer_and_clipping_is_refused() -> None:
    """Lightning refuses to clip a fused optimizer's gradients under a GradScaler at the first step:
    the launcher says so before any process starts, naming the three settings."""
    fused = {"_target_": "torch.optim.AdamW", "fused": True}
    with pytest.raises(ConfigError, match="16-mixed with optim.fused = true and trainer.gradient_clip_val = 1.0"):
        check_precision("ddp", {"precision": "16-mixed", "gradient_clip_val": 1.0}, fused)
    check_precision("ddp", {"precision": "16-mixed", "gradient_clip_val": None}, fused)
    check_precision("ddp", {"precision": "16-mixed", "gradient_clip_val": 1.0}, {**fused, "fused": None})
    check_precision("ddp", {"precision": "bf16-mixed", "gradient_clip_val": 1.0}, fused)


@pytest.mark.slow
def test_the_paper_command_on_a_cpu_machine_is_refused_by_the_preflight(tmp_path: Path) -> None:
    """``python train.py model=gpt2 trainer.devices=8 strategy=chimera`` as a new user types it: here
    auto picks 8 CPU processes, which cannot hold the 1.39 B-parameter model; nothing is started."""
    import psutil
    import torch

    if torch.cuda.is_available() or psutil.virtual_memory().available > 200 * 2**30:
        pytest.skip("this machine could run the command")
    command = ["model=gpt2", "trainer.devices=8", "strategy=chimera"]
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *command, f"hydra.run.dir={tmp_path}"],
                            cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "predicted memory does not fit: chimera W=4 D=2" in result.stderr and "GiB" in result.stderr
    assert "add devices, lower data.global_batch_size or use a smaller model" in result.stderr
    assert "(accelerator: cpu × 8 per node, 32-true (auto: no CUDA))" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "job.yaml").exists()  # nothing was started


# -- launchers, ranks and rendezvous ---------------------------------------------------------------

def _unset(monkeypatch: pytest.MonkeyPatch, *keys: str) -> None:
    """Unset ``keys`` for this test, and undo what Lightning writes into them meanwhile."""
    for key in keys:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


TORCHRUN_NODE1 = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0",
                  "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM_RANK3 = {"SLURM_JOB_ID": "4123456", "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
               "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "2",
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "3",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[07-08]",
               "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_torchrun_rank_comes_from_rank_not_node_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    launch = detect_launch(TORCHRUN_NODE1, devices=1, num_nodes=2)
    assert launch == Launch("torchrun", node_rank=1, rank=1, master_addr="10.0.0.1", master_port="29500")
    assert launch.external and not launch.is_global_zero and not is_global_zero(TORCHRUN_NODE1)
    assert is_global_zero({**TORCHRUN_NODE1, "RANK": "0", "GROUP_RANK": "0"})
    for key, value in TORCHRUN_NODE1.items():
        monkeypatch.setenv(key, value)
    lightning = TorchElasticEnvironment()
    assert (lightning.global_rank(), lightning.node_rank()) == (launch.rank, launch.node_rank)
    with pytest.raises(ConfigError, match="torchrun started WORLD_SIZE = 2 processes but .* = 8"):
        detect_launch(TORCHRUN_NODE1, devices=4, num_nodes=2)


def test_slurm_task_per_rank_agrees_with_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    launch = detect_launch(SLURM_RANK3, devices=2, num_nodes=2)
    assert (launch.launcher, launch.rank, launch.node_rank) == ("slurm", 3, 1)
    assert global_rank(SLURM_RANK3) == 3 and not is_global_zero(SLURM_RANK3)
    for key, value in SLURM_RANK3.items():
        monkeypatch.setenv(key, value)
    _unset(monkeypatch, "MASTER_ADDR", "MASTER_PORT")  # Lightning sets them from SLURM's
    lightning = SLURMEnvironment()
    assert SLURMEnvironment.detect()
    lightning.validate_settings(num_devices=2, num_nodes=2)
    assert (lightning.global_rank(), lightning.node_rank(), lightning.world_size()) == (3, 1, 4)
    assert (lightning.main_address, str(lightning.main_port)) == (launch.master_addr, launch.master_port)


@pytest.mark.parametrize("nodelist", ["gpu[07-08]", "gpu[03-05,09],cpu1", "host0,host1", "node[7]", "a1 b2",
                                      "single"])
def test_slurm_root_address_is_lightnings(nodelist: str) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    assert slurm_root_address(nodelist) == SLURMEnvironment.resolve_root_node_address(nodelist)


def test_slurm_port_is_lightnings(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    _unset(monkeypatch, "MASTER_PORT")
    monkeypatch.setenv("SLURM_JOB_ID", "987654321")
    assert slurm_port("987654321") == str(SLURMEnvironment().main_port)
    assert slurm_port(None) == "12910"


def test_slurm_task_per_node_starts_the_nodes_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """One SLURM task per node: train.py starts its node's 8 workers; they must not look like SLURM tasks."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    env = {**SLURM_RANK3, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}
    launch = detect_launch(env, devices=8, num_nodes=2)
    assert launch == Launch("self", node_rank=1, rank=None, master_addr="gpu07", master_port=str(15000 + 3456),
                            tasks="one SLURM task per node (2 tasks): train.py starts each node's 8 workers")
    assert not launch.is_global_zero
    worker = worker_env(env, launch, world_size=16, devices=8, local_rank=5, master_port=launch.master_port)
    assert not any(key in worker for key in SLURM_TASK_VARS) and worker["SLURM_JOB_ID"] == "4123456"
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_")) or key in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in worker.items():
        monkeypatch.setenv(key, value)
    assert not SLURMEnvironment.detect()
    lightning = LightningEnvironment()
    assert (lightning.node_rank(), lightning.local_rank(), worker["WORLD_SIZE"]) == (1, 5, "16")
    assert global_rank(worker) == 13 and (lightning.main_address, lightning.main_port) == ("gpu07", 18456)


def test_slurm_tasks_that_match_no_layout_are_refused() -> None:
    with pytest.raises(ConfigError, match="SLURM started SLURM_NTASKS = 4 tasks but .* = 6"):
        detect_launch(SLURM_RANK3, devices=3, num_nodes=2)
    with pytest.raises(ConfigError, match="SLURM_NNODES = 2 nodes but trainer.num_nodes = 1"):
        detect_launch(SLURM_RANK3, devices=4, num_nodes=1)
    with pytest.raises(ConfigError, match="--ntasks-per-node=2"):
        detect_launch({**SLURM_RANK3, "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1"}, devices=2, num_nodes=1)
    interactive = {**SLURM_RANK3, "SLURM_JOB_NAME": "interactive"}  # srun inside salloc: still a task
    assert detect_launch(interactive, devices=2, num_nodes=2).launcher == "slurm" and global_rank(interactive) == 3
    shell = {k: v for k, v in SLURM_RANK3.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")}
    assert detect_launch({**shell, "SLURM_NNODES": "1"}, devices=4, num_nodes=1).launcher == "self"  # sbatch script
    assert global_rank(shell) is None
    with pytest.raises(ConfigError, match="not a SLURM task .* srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
                                          "--cpus-per-task=2 python train.py"):
        detect_launch(shell, devices=2, num_nodes=2)


def test_several_nodes_without_a_rendezvous_stop_before_launch() -> None:
    with pytest.raises(ConfigError) as err:
        detect_launch({}, devices=2, num_nodes=2)
    message = str(err.value)
    assert "trainer.num_nodes = 2 but MASTER_ADDR, MASTER_PORT, NODE_RANK are not set" in message
    assert "torchrun (--nnodes=2)" in message and "NODE_RANK to the node's index 0..1" in message
    with pytest.raises(ConfigError, match="NODE_RANK is not set"):
        detect_launch({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, devices=2, num_nodes=2)
    with pytest.raises(ConfigError, match="NODE_RANK = '2' is not a node index"):
        detect_launch({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "2"}, devices=2, num_nodes=2)
    node1 = detect_launch({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}, devices=2, num_nodes=2)
    assert node1 == Launch("self", 1, None, "10.0.0.1", "29500") and not node1.is_global_zero
    one = detect_launch({"NODE_RANK": "3"}, devices=2, num_nodes=1)  # one node: nothing to meet, node 0
    assert one == Launch("self", 0, None, "127.0.0.1", None) and one.is_global_zero


def test_global_rank_from_the_environment() -> None:
    assert is_global_zero({}) and is_global_zero({"RANK": "0", "LOCAL_RANK": "0"})
    assert not is_global_zero({"RANK": "2", "LOCAL_RANK": "0"})  # torchrun node 1: no NODE_RANK
    assert not is_global_zero({"NODE_RANK": "1"})  # train.py's parent on node 1
    assert global_rank({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == 0
    assert global_rank({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None and global_rank({}) is None  # no step


# -- the SLURM launcher preset -------------------------------------------------------------------------

def _launcher_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.sweep.dir=/tmp/sweep", *overrides],
                      return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_slurm_preset_composes_without_the_plugin_and_asks_one_task_per_gpu() -> None:
    params = _launcher_cfg("trainer=gpu", "trainer.num_nodes=4")
    assert params["_target_"] == "hydra_plugins.pipeline_recipes_slurm.launcher.SlurmLauncher"
    assert (params["nodes"], params["tasks_per_node"], params["gpus_per_node"]) == (4, 8, 8)
    assert params["submitit_folder"] == "/tmp/sweep/.submitit/%j"


def test_slurm_preset_is_a_valid_submitit_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the plugin installed (the ``slurm`` extra): every key is the plugin's, and submitit turns them
    into the sbatch header of one task per GPU (no cluster needed: a stand-in ``srun`` is on PATH)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf

    params = _launcher_cfg("trainer=gpu", "trainer.num_nodes=2")
    assert set(params) == set(OmegaConf.structured(SlurmQueueConf).keys())
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    # what SlurmLauncher.launch does before it submits
    executor = submitit.AutoExecutor(folder=str(tmp_path), cluster="slurm",
                                     slurm_max_num_timeout=params["max_num_timeout"])
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{(k if k in shared else f"slurm_{k}"): v for k, v in params.items()
                                  if k not in ("_target_", "submitit_folder", "max_num_timeout")})
    header = executor._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=8"):
        assert line in header, header


@pytest.mark.slow
def test_slurm_preset_without_the_plugin_or_without_multirun_says_what_to_do(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    single = subprocess.run([sys.executable, str(ROOT / "train.py"), "hydra/launcher=slurm", "trainer=gpu"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert single.returncode == 2 and "add -m" in single.stderr
    shown = subprocess.run([sys.executable, str(ROOT / "train.py"), "hydra/launcher=slurm", "trainer=gpu", "--cfg",
                            "hydra", "-p", "hydra.launcher"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and "tasks_per_node: ${trainer.devices}" in shown.stdout, shown.stderr
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        sweep = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm", "trainer=gpu"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert sweep.returncode == 2 and 'pip install -e ".[slurm]"' in sweep.stderr, sweep.stderr
        assert "Traceback" not in sweep.stderr


# -- several processes: faked SLURM and two torchrun "nodes" -------------------------------------------

COMMON = ["strategy=gpipe", "strategy.D=2", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
          "data.global_batch_size=4", "logger=csv", "preflight=false"]


def _clean_env() -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in drop}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _communicate(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _check_written_once_by_rank_zero(tmp_path: Path, outputs: list[str], launcher: str) -> None:
    """Each process had its own job directory (nodes without a shared disk): only global rank 0's holds
    results.json and metrics, only rank 0 printed the layout and the summary, and no process started
    workers of its own."""
    (result,) = find_results([tmp_path])
    assert result.path == tmp_path / "rank0" / "results.json"
    assert result.status == "ok" and result.world_size == 2 and result.D == 2 and len(result.loss_history) == 2
    assert len(result.peak_memory_bytes) == 2 and all(p > 0 for p in result.peak_memory_bytes)
    assert "train/loss" in (tmp_path / "rank0" / "metrics.csv").read_text()
    assert not (tmp_path / "rank1" / "metrics.csv").exists()
    assert [out.count("final train/loss") for out in outputs] == [1, 0]
    assert [out.count("layout: gpipe") for out in outputs] == [1, 0]
    assert f"launcher: {launcher} (node 0, rank 0" in outputs[0]
    assert not list(tmp_path.glob("rank*/logs"))


@pytest.mark.slow
def test_two_torchrun_nodes_over_loopback_write_results_once(tmp_path: Path) -> None:
    """``torchrun --nnodes=2 --node_rank=n`` on each "node", one process each: torchrun sets RANK and
    GROUP_RANK, no NODE_RANK; rank 1 (local rank 0 of node 1) must not act as rank 0. The checkpoint's
    stages (stage 1 written by rank 1) land in rank 0's directory too."""
    from distributed import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={n}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / f'rank{n}'}", "trainer.devices=1",
                               "trainer.num_nodes=2", "checkpoint.every_n_steps=2", *COMMON], cwd=tmp_path,
                              text=True, env=_clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for n in (0, 1)]
    outputs = _communicate(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    _check_written_once_by_rank_zero(tmp_path, outputs, "torchrun")
    saved = tmp_path / "rank0" / "checkpoints" / "step-000002.ckpt"
    assert (saved / ".metadata").is_file() and len(list(saved.glob("*.distcp"))) == 2
    assert not (tmp_path / "rank1" / "checkpoints").exists()
