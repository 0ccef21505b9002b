"""End-to-end ``train.py`` runs on CPU with the tiny model, and the layout checks before launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline_recipes.recipe.check.settings import ConfigError, resolve_layout
from train_jobs import run_train_jobs

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _check_trained(run_dir: Path, result: subprocess.CompletedProcess, strategy: str) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final train/loss" in result.stdout
    assert f"layout: {strategy}" in result.stdout
    metrics = (run_dir / "metrics.csv").read_text()
    assert "train/loss" in metrics


# the README's command: DAPPLE, W = 2 replicas × D = 2 stages on 4 processes
DAPPLE_ON_FOUR = ("strategy=dapple", "strategy.D=2", "trainer.devices=4", "trainer.max_steps=3",
                  "data.global_batch_size=8", "logger=csv", "trainer.log_every_n_steps=1")


@pytest.fixture(scope="module")
def dapple_on_four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One run of :data:`DAPPLE_ON_FOUR`: a strategy that trains, and the one-node reference of the two-node run."""
    run_dir = tmp_path_factory.mktemp("dapple_on_four")
    return run_dir, _train(run_dir, *DAPPLE_ON_FOUR)


@pytest.mark.slow
def test_train_py_runs_dapple_on_four_processes(dapple_on_four: tuple[Path, subprocess.CompletedProcess]) -> None:
    _check_trained(*dapple_on_four, "dapple")


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, devices, extra",
    [("gems", 2, []), ("interleaved_1f1b", 2, ["strategy.chunks=2"]),
     ("dualpipev", 2, [])],  # dapple: the test above; chimera: the test below; gpipe: the same-batches run
)
def test_train_py_runs_each_strategy(tmp_path: Path, strategy: str, devices: int, extra: list[str]) -> None:
    result = _train(tmp_path, f"strategy={strategy}", f"trainer.devices={devices}", "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                    "data.global_batch_size=8", "logger=csv", *extra)
    _check_trained(tmp_path, result, strategy)


@pytest.mark.slow
def test_two_nodes_over_loopback_equal_one_node(tmp_path: Path,
                                                dapple_on_four: tuple[Path, subprocess.CompletedProcess]) -> None:
    """2 "nodes" × 2 processes (NODE_RANK, MASTER_ADDR/PORT as on a cluster) = the same layout's 4 processes on one
    node (:func:`dapple_on_four`): the same losses, and only rank 0 (node 0) reports."""
    from distributed import free_port

    from pipeline_recipes.recipe.report.results import find_results

    common = ["strategy=dapple", "strategy.D=2", "trainer.max_steps=3", "data.global_batch_size=8", "logger=none"]
    port = str(free_port())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    nodes = [
        subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / f'node{n}'}",
                          "trainer.devices=2", "trainer.num_nodes=2", *common], cwd=tmp_path, text=True,
                         env={**env, "NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for n in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    one_node_dir, one_node_run = dapple_on_four
    assert one_node_run.returncode == 0, one_node_run.stdout[-3000:] + one_node_run.stderr[-3000:]
    (two_nodes,) = find_results([tmp_path / "node0"])
    (one_node,) = find_results([one_node_dir])
    assert (two_nodes.world_size, two_nodes.W, len(two_nodes.peak_memory_bytes)) == (4, 2, 4)
    assert (one_node.world_size, one_node.W, one_node.D) == (two_nodes.world_size, two_nodes.W, two_nodes.D)
    assert two_nodes.loss_history == pytest.approx(one_node.loss_history, abs=1e-6)
    assert not (tmp_path / "node1" / "results.json").exists()  # rank 0 (node 0) reports


@pytest.mark.slow
def test_bad_layout_stops_before_launch(tmp_path: Path) -> None:
    result = _train(tmp_path, "strategy.D=3", "trainer.devices=4", timeout=120)
    assert result.returncode == 2
    assert "strategy.D = 3 does not divide the 4 processes" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "strategy, trainer, batch, fragment",
    [
        ({"name": "gpipe", "D": 3, "micro_batch_size": 1}, {"devices": 8}, 8, "set strategy.D to one of [1, 2, 4]"),  # 8 > 6 layers
        ({"name": "gpipe", "D": 2, "W": 3, "micro_batch_size": 1}, {"devices": 8}, 8, "W·D = 3·2 = 6"),
        ({"name": "gpipe", "D": 2, "micro_batch_size": 3}, {"devices": 4}, 8, "not divisible by W·B = 2·3 = 6"),
        ({"name": "chimera", "D": 3, "micro_batch_size": 1}, {"devices": 3}, 6, "chimera needs strategy.D to be even"),
        ({"name": "gems", "D": 3, "micro_batch_size": 1}, {"devices": 3}, 6, "gems needs strategy.D to be even"),
        ({"name": "pipedream_2bw", "D": 4, "micro_batch_size": 1}, {"devices": 4}, 3, "N ≥ D"),
        ({"name": "pipedream", "D": 2, "micro_batch_size": 1}, {"devices": 2}, 4, "N must be 1"),
        ({"name": "pipedream", "D": 2, "micro_batch_size": 1, "grad_sync": "eager"}, {"devices": 2}, 1,
         "runs with strategy.grad_sync=end and strategy.recompute=none"),
        ({"name": "chimera", "D": 4, "pipelines": 3, "micro_batch_size": 1}, {"devices": 4}, 8, "set strategy.pipelines=2 or strategy.pipelines=4"),
        ({"name": "gpipe", "D": 16, "micro_batch_size": 1}, {"devices": 16}, 16, "only 6 pipeline layers"),
        ({"name": "gpipe", "D": 0, "micro_batch_size": 1}, {"devices": 2}, 8, "strategy.D must be a positive integer"),
        ({"name": "gpipe", "D": 2, "micro_batch_size": 1}, {"devices": 2, "strategy": "ddp"}, 8,
         "trainer.strategy = 'ddp' would bypass the layout; the strategy group chooses the strategy instead"),
        ({"name": "gpipe", "D": 2, "micro_batch_size": 1}, {"devices": 2, "peak_tflops": 0}, 8,
         "trainer.peak_tflops = 0 must be a positive number"),
    ],
)
def test_layout_rules(strategy: dict, trainer: dict, batch: int, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_layout(strategy, trainer, batch, num_layers=6)
    assert fragment in str(err.value)


def test_layout_derives_w_and_n() -> None:
    layout = resolve_layout({"name": "chimera", "D": 4, "micro_batch_size": 2}, {"devices": 8}, 32, num_layers=10)
    assert (layout.W, layout.N, layout.pipelines) == (2, 8, 2)


@pytest.mark.slow
@pytest.mark.parametrize("model, layers",
                         [("gpt2-tiny", "model.n_layer=2"), ("bert-tiny", "model.num_hidden_layers=2")])
def test_train_py_chimera_trains_gpt2_and_bert(tmp_path: Path, model: str, layers: str) -> None:
    """``train.py strategy=chimera`` on 4 processes (D = 4, one block per stage) for each model family;
    BERT's batches carry padding masks, MLM labels and NSP labels through every stage."""
    result = _train(tmp_path, "strategy=chimera", f"model={model}", "trainer.devices=4", "strategy.D=4", layers,
                    "trainer.max_steps=3", "trainer.log_every_n_steps=1", "data.global_batch_size=8", "logger=csv")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final train/loss" in result.stdout
    assert "layout: chimera" in result.stdout
    assert "train/loss" in (tmp_path / "metrics.csv").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("strategy, extra", [
    ("pipedream_2bw", ["data.global_batch_size=4"]),
    ("pipedream", ["data.global_batch_size=2"]),  # B = B̂/W = 2, N = 1; tied embeddings (gpt2-tiny)
])
def test_train_py_asynchronous_strategies_train(tmp_path: Path, strategy: str, extra: list[str]) -> None:
    """PipeDream-2BW and PipeDream converge on one repeated synthetic mini-batch (the loss falls)."""
    result = _train(tmp_path, f"strategy={strategy}", "trainer.devices=2", "trainer.max_steps=25", "logger=none",
                    "data.num_samples=4", "optim.lr=3e-3", *extra)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = json.loads((tmp_path / "results.json").read_text())["loss_history"]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_every_strategy_sees_the_same_batches(tmp_path: Path) -> None:
    """single, ddp (W = 2) and two pipelines (GPipe D = 2; DAPPLE W = 2 × D = 1) with the same seed and
    global batch: the same samples every step, so the same fp32 losses (gpt2-tiny has no dropout; that the same
    command gives the same losses bit for bit, tests/e2e/test_stops.py shows, across a stop and a resume too) and
    the same learning rates. Rank 0 prints its progress line every step; the single run shows
    Lightning's progress bar instead (a user's trainer key over the recipe's); W&B names and tags
    carry strategy, model, W, D and B."""
    from pipeline_recipes.recipe.worker.wandb_offline import find_offline_runs

    common = ["trainer.max_steps=3", "trainer.log_every_n_steps=1", "metrics.progress_interval_s=0",
              "data.global_batch_size=8", "preflight=false"]
    jobs = {"single": ["strategy=single", "trainer.devices=1", "+trainer.enable_progress_bar=true"],
            "ddp": ["strategy=ddp", "strategy.D=1", "trainer.devices=2"],
            "gpipe": ["strategy=gpipe", "strategy.D=2", "trainer.devices=2"],
            "dapple": ["strategy=dapple", "strategy.D=1", "trainer.devices=2"]}
    results, outputs = run_train_jobs(tmp_path, common, jobs)
    assert "layout: gpipe" in outputs["gpipe"] and "layout: dapple" in outputs["dapple"]
    reference = results["single"]
    for name, output in outputs.items():  # the last line's loss is the history's last, at 4 decimals
        final = next(line for line in output.splitlines() if "final train/loss" in line).split("=")[1].split()[0]
        assert final == f"{results[name]['loss_history'][-1]:.4f}", name
    assert len(reference["loss_history"]) == len(reference["lr_history"]) == 3
    for name, result in results.items():
        assert result["loss_history"] == pytest.approx(reference["loss_history"], abs=1e-5), name
        assert result["lr_history"] == reference["lr_history"], name
        assert result["tflops_per_device"] > 0 and result["mfu"] is None  # CPUs have no known peak
    assert reference["lr_history"][0] < reference["lr_history"][1] < reference["lr_history"][2]  # warm-up
    for name in ("ddp", "gpipe", "dapple"):
        lines = [line for line in outputs[name].splitlines() if line.startswith("step ")]
        assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"], outputs[name][-2000:]
        assert all(field in lines[-1] for field in (" | loss ", " | lr ", " samples/s | ", " tokens/s | ",
                                                    " TFLOP/s/device | ", " | MFU n/a | ", " | peak mem "))
    assert not any(line.startswith("step ") for line in outputs["single"].splitlines())
    runs = {run.job_type: run for run in find_offline_runs(tmp_path)}
    assert runs["dapple"].name == "dapple-W2-D1-B1-gpt2-tiny"
    assert runs["dapple"].tags == ["strategy=dapple", "model=gpt2-tiny", "W=2", "D=1", "B=1"]
    assert sorted(runs) == ["dapple", "ddp", "gpipe", "single"]
    logged = [row["train/lr"] for row in runs["gpipe"].history if "train/lr" in row]
    assert logged == pytest.approx(reference["lr_history"])  # every step


def _ddp_share_vs_whole_batch(rank: int, world: int) -> float:
    """Rank ``rank`` of a DDP world: its half of a BERT mini-batch through ``PipelineModule``'s replica
    loss, gradients averaged as DDP does, against the gradient of the whole mini-batch in one process."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from pipeline_recipes.datamodules import build_datasets
    from pipeline_recipes.strategies.lightning.strategy import PipelineModule
    from pipeline_recipes.core.pipeline_model import sequential_loss

    cfg = {**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "bert-tiny.yaml")), "num_hidden_layers": 1}
    torch.manual_seed(0)
    module = PipelineModule(instantiate(cfg))
    data, _ = build_datasets("synthetic", family="bert", seq_len=32, vocab_size=1000, seed=3, num_samples=8)
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in data[0]}
    masked = (batch["labels"] != -100).sum(dim=1)
    assert masked[:4].sum() != masked[4:].sum()  # the replicas hold different numbers of masked tokens
    sequential_loss(module.model, batch).backward()
    whole = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module._trainer = SimpleNamespace(world_size=world)
    half = {k: v.chunk(world)[rank] for k, v in batch.items()}
    module._replica_loss(half).backward()
    worst = 0.0
    for p, want in zip(module.parameters(), whole):
        dist.all_reduce(p.grad)
        worst = max(worst, float((p.grad / world - want).abs().max()))
    return worst


@pytest.mark.slow
def test_ddp_normalises_every_loss_term_over_the_mini_batch() -> None:
    from distributed import run_world

    assert max(run_world(2, _ddp_share_vs_whole_batch)) < 1e-6
