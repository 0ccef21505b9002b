"""A GPU box as a user finds it, decided on faked nodes (no GPU needed): the default job on one GPU runs
its two Chimera ranks sharing it over gloo, eight GPUs give one NCCL rank each, ``trainer=gpu`` with too
few GPUs stops with both fixes; each rank's device and backend; TF32 and the data loader's defaults on
CUDA, and a loader with workers yielding the very batches of one without.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline_recipes.core.node import NodeDevices, loader_settings
from pipeline_recipes.recipe.check.accelerator import (apply_float32_matmul_precision, layout_processes, resolve_accelerator,
                                                 resolve_loader, shared_devices)
from pipeline_recipes.recipe.check.settings import ConfigError, check_devices, resolve_layout

ROOT = Path(__file__).resolve().parents[2]
ONE_H100 = NodeDevices(cuda_devices=1, bf16=True, gpu_name="NVIDIA H100 80GB HBM3")
EIGHT_H100 = NodeDevices(cuda_devices=8, bf16=True, gpu_name="NVIDIA H100 80GB HBM3")
TWO_V100 = NodeDevices(cuda_devices=2, bf16=False, gpu_name="Tesla V100-SXM2-32GB")


def _config(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def _choose(node: NodeDevices, *overrides: str):
    cfg = _config(*overrides)
    choice = resolve_accelerator(cfg["trainer"], node, layout_processes(cfg["strategy"], cfg["trainer"]["num_nodes"]))
    return cfg, choice


def _layout(cfg: dict, trainer: dict):
    return resolve_layout(cfg["strategy"], trainer, cfg["data"]["global_batch_size"], cfg["model"]["n_layer"] + 2)


# -- the choice -----------------------------------------------------------------------------------------

def test_the_default_job_on_one_gpu_runs_two_ranks_sharing_it_over_gloo() -> None:
    from pipeline_recipes.recipe.check.command import node_gpus as _gpus

    cfg, choice = _choose(ONE_H100)
    assert cfg["strategy"]["schedule"] == "chimera" and cfg["strategy"]["D"] == 2  # the README's main job
    assert (choice.trainer["accelerator"], choice.trainer["devices"], choice.shared_gpus, choice.backend) == \
        ("gpu", 2, 1, "gloo")
    assert choice.describe() == (
        "accelerator: gpu × 2 per node sharing 1 GPU over gloo (auto: 1 CUDA device found, NVIDIA H100 80GB HBM3 "
        "has bf16, fp32 matmuls in TF32 (trainer.float32_matmul_precision=high); fine for trying schedules, "
        "not for speed), bf16-mixed")
    layout = _layout(cfg, choice.trainer)  # was: "strategy.D = 2 does not divide the 1 processes"
    assert (layout.W, layout.D, layout.world_size) == (1, 2, 2)
    assert _gpus(choice) is None  # the launcher's one-GPU-per-process check does not apply
    check_devices(choice.trainer, _gpus(choice))


def test_eight_gpus_give_one_nccl_rank_each() -> None:
    cfg, choice = _choose(EIGHT_H100)
    assert (choice.trainer["devices"], choice.shared_gpus, choice.backend) == (8, 0, "nccl")
    assert choice.describe().startswith("accelerator: gpu × 8 per node, bf16-mixed (auto: 8 CUDA devices found")
    assert "sharing" not in choice.describe()
    assert (_layout(cfg, choice.trainer).W, _layout(cfg, choice.trainer).D) == (4, 2)


def test_more_processes_than_gpus_under_auto_share_them_round_robin() -> None:
    _, choice = _choose(TWO_V100, "strategy.D=4")
    assert (choice.trainer["devices"], choice.shared_gpus, choice.backend) == (4, 2, "gloo")
    assert "sharing 2 GPUs over gloo" in choice.describe()
    _, asked = _choose(ONE_H100, "trainer.devices=4", "strategy=gpipe")  # trainer.devices beyond the GPUs
    assert (asked.trainer["devices"], asked.shared_gpus) == (4, 1)
    torchrun = NodeDevices(cuda_devices=1, bf16=True, launched_per_node=2)  # torchrun --nproc_per_node=2, one GPU
    assert resolve_accelerator(_config()["trainer"], torchrun, 2).shared_gpus == 1
    assert shared_devices(4, 2) == [0, 1, 0, 1] and shared_devices(2, 1) == [0, 0]
    assert shared_devices(2, 2) is None and shared_devices(2, 8) is None and shared_devices(2, 0) is None


def test_ranks_sharing_a_gpu_split_its_memory_for_the_preflight() -> None:
    gib = 2**30
    node = NodeDevices(cuda_devices=2, bf16=True, gpu_name="NVIDIA H100 80GB HBM3", gpu_memory_bytes=80 * gib)
    context = 512 * 2**20  # each rank's own CUDA context, outside torch's allocator
    assert resolve_accelerator(_config("strategy.D=4")["trainer"], node, 4).memory_per_rank == 40 * gib - context
    assert resolve_accelerator(_config("strategy.D=6")["trainer"], node, 6).memory_per_rank == (80 * gib - 3 * context) // 3
    assert resolve_accelerator(_config()["trainer"], node, 2).memory_per_rank is None  # one GPU each: measured


def test_layout_processes_are_w_times_d_over_the_nodes() -> None:
    assert layout_processes({"D": 2, "W": None}) == 2
    assert layout_processes({"D": 4, "W": 2}, 2) == 4
    assert layout_processes({"D": 1, "W": None}) == 1  # ddp: every GPU
    assert layout_processes({"D": "x"}) is None


def test_trainer_gpu_with_too_few_gpus_names_both_fixes() -> None:
    from pipeline_recipes.recipe.check.command import node_gpus as _gpus

    cfg, choice = _choose(ONE_H100, "trainer=gpu")
    assert choice.shared_gpus == 0 and _gpus(choice) == 1
    with pytest.raises(ConfigError) as err:
        check_devices(choice.trainer, _gpus(choice))
    message = str(err.value)
    assert "trainer.devices = 8 processes per node, but this node has 1 GPU" in message
    assert "run at most 1 per node" in message and "let the 8 processes share the 1 GPU over gloo" in message
    assert {"trainer.devices": "1"} in err.value.fixes and {"trainer": "auto"} in err.value.fixes


# -- each rank's device and backend ---------------------------------------------------------------

@pytest.fixture(autouse=True)
def _keep_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's ``setup_distributed`` and environments set the process-wide rank-zero flag; keep this
    process rank 0 for the tests after these (loggers give rank > 0 a dummy experiment)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    monkeypatch.setattr(utilities_rank_zero_only, "rank", getattr(utilities_rank_zero_only, "rank", 0))


@pytest.mark.parametrize("processes, gpus, local_rank, expected", [(2, 1, 1, 0), (4, 2, 3, 1), (4, 2, 2, 0)])
def test_place_ranks_puts_local_rank_r_on_gpu_r_mod_g_over_gloo(monkeypatch: pytest.MonkeyPatch, processes: int,
                                                                 gpus: int, local_rank: int, expected: int) -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    from pipeline_recipes.recipe.worker.job import place_ranks
    from pipeline_recipes.strategies.lightning.baselines import DDPBaseline
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy

    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    from pipeline_recipes.strategies.schedules import derive_layout

    for strategy in (PipelineStrategy.from_layout(derive_layout("chimera", processes, 2, processes, B=1)),
                     DDPBaseline()):
        trainer = {"accelerator": "gpu", "devices": processes}
        assert place_ranks(strategy, trainer, gpus=gpus) == [r % gpus for r in range(processes)]
        strategy.cluster_environment = LightningEnvironment()
        assert strategy.root_device == torch.device("cuda", expected)
        assert strategy.num_processes == processes and strategy.process_group_backend == "gloo"
        assert trainer["devices"] == gpus  # Lightning's devices: the GPUs used, which it checks exist


def test_place_ranks_leaves_one_gpu_per_rank_and_cpu_alone() -> None:
    from pipeline_recipes.recipe.worker.job import place_ranks
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy

    from pipeline_recipes.strategies.schedules import derive_layout

    strategy = PipelineStrategy.from_layout(derive_layout("gpipe", 2, 2, 2, B=1))
    for trainer, gpus in (({"accelerator": "gpu", "devices": 8}, 8), ({"accelerator": "cpu", "devices": 2}, 0)):
        before = dict(trainer)
        assert place_ranks(strategy, trainer, gpus=gpus) is None and trainer == before
    assert strategy.parallel_devices is None and strategy.process_group_backend is None


def test_ranks_sharing_a_gpu_start_a_gloo_group_bound_to_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/strategies/runtime/test_gpu.py runs them: no ``device_id`` (Lightning would bind the rank's GPU)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    import pipeline_recipes.strategies.lightning.strategy as module
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy, share_gpus

    calls = []
    monkeypatch.setattr(module, "_init_dist_connection", lambda env, backend, **kw: calls.append((backend, kw)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    from pipeline_recipes.strategies.schedules import derive_layout

    strategy = PipelineStrategy.from_layout(derive_layout("chimera", 2, 2, 2, B=1), timeout_s=7)
    share_gpus(strategy, [0, 0])
    strategy.cluster_environment = LightningEnvironment()
    strategy.setup_distributed()
    assert len(calls) == 1 and calls[0][0] == "gloo" and "device_id" not in calls[0][1]
    assert calls[0][1]["timeout"].total_seconds() == 7
    assert strategy.global_rank == 1 and strategy.world_size == 2


# -- TF32 -------------------------------------------------------------------------------------------------

def test_tf32_is_the_cuda_default_and_overridable() -> None:
    assert _choose(EIGHT_H100)[1].trainer["float32_matmul_precision"] == "high"
    cpu = _choose(NodeDevices())[1]
    assert cpu.trainer["float32_matmul_precision"] == "highest" and "matmul" not in cpu.describe()
    assert _choose(TWO_V100)[1].trainer["float32_matmul_precision"] == "highest"  # no TF32 before Ampere
    exact = _choose(EIGHT_H100, "trainer.float32_matmul_precision=highest")[1]
    assert exact.trainer["float32_matmul_precision"] == "highest" and "in full fp32" in exact.describe()
    assert _choose(EIGHT_H100, "trainer=gpu")[1].trainer["float32_matmul_precision"] == "high"
    with pytest.raises(ConfigError, match=r"float32_matmul_precision = 'tf32' .* to one of \[auto, highest, high, medium\]"):
        _choose(EIGHT_H100, "trainer.float32_matmul_precision=tf32")


def test_the_worker_sets_the_precision_and_keeps_it_out_of_the_trainer() -> None:
    from pipeline_recipes.recipe.worker.job import trainer_kwargs

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert apply_float32_matmul_precision({"accelerator": "gpu", "float32_matmul_precision": "high"}) == "high"
        assert torch.get_float32_matmul_precision() == "high"
        assert apply_float32_matmul_precision({"accelerator": "gpu"}) == "high"  # a job file without the key
        apply_float32_matmul_precision({"accelerator": "cpu", "float32_matmul_precision": "auto"})
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
    kwargs = trainer_kwargs({"max_steps": 3, "float32_matmul_precision": "high", "peak_tflops": 989.0}, {})
    assert "float32_matmul_precision" not in kwargs and "peak_tflops" not in kwargs and kwargs["max_steps"] == 3


# -- the data loader ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_loader_defaults_on_cuda_and_cpu_and_overrides() -> None:
    assert loader_settings("auto", "auto", cuda=True, cpus=2) == (2, True)  # 16 cores, 8 ranks
    assert loader_settings(None, None, cuda=True, cpus=16) == (4, True)
    assert loader_settings("auto", "auto", cuda=False, cpus=16) == (0, False)
    assert loader_settings(3, False, cuda=True, cpus=16) == (3, False)
    assert loader_settings(0, True, cuda=False, cpus=1) == (0, True)
    with pytest.raises(ConfigError, match="data.num_workers = -1 .* set data.num_workers=auto"):
        loader_settings(-1, "auto", cuda=True, cpus=4)
    with pytest.raises(ConfigError, match="data.pin_memory = 'yes' must be auto, true or false"):
        loader_settings(0, "yes", cuda=True, cpus=4)
    cfg, choice = _choose(ONE_H100)
    assert cfg["data"]["num_workers"] == "auto" and cfg["data"]["pin_memory"] == "auto"
    assert resolve_loader(cfg["data"], choice, cpus=8) == {"num_workers": 4, "pin_memory": True}
    assert resolve_loader(cfg["data"], _choose(NodeDevices())[1]) == {"num_workers": 0, "pin_memory": False}


@pytest.mark.slow
def test_a_loader_with_workers_yields_the_batches_of_one_without() -> None:
    """The sampler (the datamodule's DistributedSampler) runs in the rank's process: workers only fetch."""
    from pipeline_recipes.datamodules import build_datamodule

    def batches(family: str, workers: int) -> list[dict[str, torch.Tensor]]:
        data = build_datamodule("synthetic", family=family, seq_len=16, vocab_size=200, global_batch_size=4, seed=5,
                                num_samples=48, num_workers=workers, pin_memory=False)
        loader = data.train_dataloader()
        assert loader.num_workers == workers
        return list(loader)

    for family in ("gpt2", "bert"):  # BERT: masks drawn per item from (seed, index)
        without, with_two = batches(family, 0), batches(family, 2)
        assert len(without) == 12
        for a, b in zip(without, with_two, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert build_datamodule("synthetic", family="gpt2", seq_len=8, vocab_size=64, global_batch_size=4,
                            num_samples=8, num_workers="auto", pin_memory="auto").loader_args() == \
        {"num_workers": 0, "pin_memory": False}  # no trainer: this process, not CUDA


# -- on a GPU (skipped without one) ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overrides, processes", [((), 2), (("strategy=ddp", "trainer.devices=2"), 2)])
def test_train_py_on_one_gpu_runs_its_ranks_sharing_it(tmp_path: Path, overrides: tuple[str, ...],
                                                       processes: int) -> None:
    """The README's main job (Chimera, D = 2) and the DDP baseline with one GPU visible: every rank on
    cuda:0 over gloo, TF32 set, the loss falls."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", "logger=none", "trainer.max_steps=20",
           *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"accelerator: gpu × {processes} per node sharing 1 GPU over gloo" in result.stdout
    assert "fp32 matmuls in TF32" in result.stdout and "not for speed" in result.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "ok" and res["world_size"] == processes
    assert res["loss_history"][-1] < res["loss_history"][0]
    assert all(m > 0 for m in res["peak_memory_bytes"])  # CUDA memory: the ranks ran on the GPU
