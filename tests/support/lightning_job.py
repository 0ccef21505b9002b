"""A tiny Lightning job for tests/strategies/lightning/test_lightning_strategy.py: the toy MLP under a pipeline strategy.

Run by Lightning's own launcher (``python tests/support/lightning_job.py --out DIR``: devices=2 starts the
second rank) or by an external one (``torchrun --nproc_per_node=2 tests/support/lightning_job.py ...``).
Each rank writes ``DIR/rank{r}.json``: what callbacks saw every step (train/loss, a per-rank value
logged with ``sync_dist=True``), the validation losses, the global gradient norms before clipping,
how the process was started, and its final local parameters. ``reference()`` trains the same
module with the same data in one process (SingleDeviceStrategy) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_model import ToyMLP  # noqa: E402

import lightning.pytorch as pl  # noqa: E402

from pipeline_recipes.strategies.lightning.strategy import PipelineModule, PipelineStrategy  # noqa: E402
from pipeline_recipes.strategies.schedules import derive_layout  # noqa: E402

WIDTH, LAYERS, LR = 8, 8, 0.1
TRAIN_SAMPLES, VAL_SAMPLES, BATCH = 8, 6, 4  # 2 training steps per epoch; validation batches of 4 and 2
# the strategies' layout: W = 1 replica × D = 2 workers, B = 1, N = BATCH micro-batches per step


def samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def loaders(single_process: bool = False) -> tuple[DataLoader, DataLoader]:
    """Under a distributed strategy Lightning replaces the training sampler by a shuffling
    ``DistributedSampler`` (seed 0) with the strategy's ``distributed_sampler_kwargs``: W = 1
    replica here, so one process gets the same order from the same sampler built by hand."""
    train = samples(TRAIN_SAMPLES, 1)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0) if single_process else None
    return (DataLoader(train, batch_size=BATCH, sampler=sampler, shuffle=False),
            DataLoader(samples(VAL_SAMPLES, 2), batch_size=BATCH, shuffle=False))


class UserModule(PipelineModule):
    """What a user writes: extra metrics, their own optimizer, a hook reading gradients."""

    def __init__(self) -> None:
        super().__init__(ToyMLP(layers=LAYERS, width=WIDTH, seed=0), lr=LR)
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        rank = float(self.global_rank)
        self.log("rank_sum", rank, sync_dist=True, reduce_fx="sum", batch_size=BATCH)
        self.log("rank_mean", rank, sync_dist=True, batch_size=BATCH)
        self.log("rank_local", rank, batch_size=BATCH)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.log("val/rank_mean", float(self.global_rank), sync_dist=True, batch_size=BATCH)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:  # Lightning calls it before clipping
        engine = self.pipeline
        if engine is not None:
            norm = engine.grad_norm_sq().sqrt()  # a collective: every rank runs this hook
        else:
            norm = torch.stack([p.grad.square().sum() for p in self.parameters() if p.grad is not None]).sum().sqrt()
        self.grad_norms.append(float(norm))

    def configure_optimizers(self):  # SGD: the clipped step size shows in the parameters
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.val: list[dict[str, Any]] = []
        self.fetchers: set[str] = set()  # the training loop's batch fetchers

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        cb, bar = trainer.callback_metrics, trainer.progress_bar_metrics
        self.fetchers.add(type(trainer.fit_loop._data_fetcher).__name__)
        self.steps.append({
            "train/loss": float(cb["train/loss"]), "pbar/train/loss": float(bar["train/loss"]),
            "step_output": float(outputs["loss"]),
            **{k: float(cb[k]) for k in ("rank_sum", "rank_mean", "rank_local")},
        })

    def on_validation_end(self, trainer, pl_module) -> None:
        cb = trainer.callback_metrics
        self.val.append({"sanity": trainer.sanity_checking, "val/loss": float(cb["val/loss"]),
                         "val/rank_mean": float(cb["val/rank_mean"])})


def trainer_kwargs(clip: float | None, precision: str) -> dict[str, Any]:
    return dict(accelerator="cpu", max_steps=2, max_epochs=1, num_sanity_val_steps=2, gradient_clip_val=clip,
                precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False)


def fit(
    strategy: Any, devices: int, clip: float | None, precision: str = "32-true"
) -> tuple[pl.Trainer, UserModule, Recorder]:
    torch.set_num_threads(1)
    module, recorder = UserModule(), Recorder()
    trainer = pl.Trainer(**trainer_kwargs(clip, precision), strategy=strategy, devices=devices, callbacks=[recorder])
    train, val = loaders(single_process=devices == 1)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    return trainer, module, recorder


def local_parameters(module: UserModule) -> dict[str, list]:
    """Parameters this rank holds (remote layers were replaced by ``nn.Identity``)."""
    return {name: p.detach().float().tolist() for name, p in module.named_parameters()}


def reference(clip: float | None) -> dict[str, Any]:
    """The same module, data and trainer settings in one process (SingleDeviceStrategy)."""
    trainer, module, recorder = fit("auto", 1, clip)
    return {"strategy": type(trainer.strategy).__name__, "steps": recorder.steps, "val": recorder.val,
            "grad_norms": module.grad_norms, "params": local_parameters(module)}


def stop_by_sigterm(out: Path, schedule: str, signalled_rank: int) -> None:
    """Train for up to 6 steps; rank ``signalled_rank`` sends itself SIGTERM after the first step. Each rank
    writes the steps it finished and how fit ended."""
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    finished: list[int] = []

    class SignalAfterFirstStep(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            finished.append(trainer.global_step)
            if trainer.global_rank == signalled_rank and trainer.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    torch.set_num_threads(1)
    strategy = PipelineStrategy.from_layout(derive_layout(schedule, 2, 2, BATCH, B=1), timeout_s=60)
    trainer = pl.Trainer(**{**trainer_kwargs(None, "32-true"), "max_steps": 6, "max_epochs": 3}, strategy=strategy,
                         devices=2, callbacks=[SignalAfterFirstStep()])
    train, val = loaders()
    stopped_by, code = None, None
    try:
        trainer.fit(UserModule(), train_dataloaders=train, val_dataloaders=val)
    except SIGTERMException as stop:  # Lightning's own type, with the exit status of a stop
        stopped_by, code = type(stop).__name__, stop.code
    result = {"global_rank": trainer.global_rank, "world_size": trainer.world_size, "finished_steps": finished,
              "stopped_by": stopped_by, "exit_code": code, "received_sigterm": trainer.received_sigterm,
              "process_group_alive": torch.distributed.is_initialized()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--strategy", default="gpipe", choices=["gpipe", "dapple", "chimera"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--sigterm-rank", type=int, default=None, help="run stop_by_sigterm instead")
    args = parser.parse_args()
    if args.sigterm_rank is not None:
        stop_by_sigterm(args.out, args.strategy, args.sigterm_rank)
        return

    strategy = PipelineStrategy.from_layout(derive_layout(args.strategy, 2, 2, BATCH, B=1), timeout_s=60)
    trainer, module, recorder = fit(strategy, 2, args.clip, args.precision)
    assert isinstance(trainer.strategy, PipelineStrategy)
    shapes = trainer.strategy.engine.executor._shapes  # the activation messages' shapes and dtypes, as learnt
    result = {
        "global_rank": trainer.global_rank, "world_size": trainer.world_size, "pid": os.getpid(),
        "ppid": os.getppid(), "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "creates_processes_externally": trainer.strategy.cluster_environment.creates_processes_externally,
        "process_group_alive": torch.distributed.is_initialized(),
        "schedule": trainer.strategy.pipeline_config.schedule, "precision": args.precision,
        "global_step": trainer.global_step, "steps": recorder.steps, "val": recorder.val,
        "grad_norms": module.grad_norms, "params": local_parameters(module),
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "received_dtypes": sorted({str(dtype) for _, dtype in shapes.values()}),
        "fetchers": sorted(recorder.fetchers),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank{trainer.global_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").rename(path)


if __name__ == "__main__":
    main()
