"""Live progress: rank 0 prints one line every ``trainer.log_every_n_steps`` training steps, at most one
a second (``min_interval_s``; the last step's line always prints).

    step 10/40 | loss 6.1423 | lr 8.66e-04 | 512.3 samples/s | 16,394 tokens/s | 0.03 TFLOP/s/device | MFU n/a | peak mem 612 MiB

Rates cover the steps since the previous logging step (the global batch, all W replicas); TFLOP/s per
device and MFU follow :mod:`pipeline_recipes.recipe.report.flops`; the peak memory is the largest over the ranks (CUDA
max allocated, or the process's peak RSS on CPUs). With ``+trainer.enable_progress_bar=true``
Lightning's bar replaces the lines and shows MFU (a fraction) beside the loss; the learning rate stays in
the loggers (the bars print floats with three decimals).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from pipeline_recipes.strategies.lightning.strategy import last_step, reporting_step

from pipeline_recipes.recipe.worker.metrics import PipelineMetrics, tokens_in

_MIB = 1024 * 1024


def format_progress(step: int, max_steps: int | None, loss: float | None, lr: float | None, samples_per_s: float,
                    tokens_per_s: float, tflops: float | None, mfu: float | None, peak_bytes: int | None) -> str:
    """One progress line (see the module docstring)."""
    parts = [
        f"step {step}/{max_steps if max_steps and max_steps > 0 else '?'}",
        "loss -" if loss is None else f"loss {loss:.4f}",
        "lr -" if lr is None else f"lr {lr:.2e}",
        f"{samples_per_s:.1f} samples/s",
        f"{tokens_per_s:,.0f} tokens/s",
        "TFLOP/s n/a" if tflops is None else f"{tflops:.3g} TFLOP/s/device",
        "MFU n/a" if mfu is None else f"MFU {mfu:.1%}",
        "peak mem -" if not peak_bytes else f"peak mem {peak_bytes / _MIB:,.0f} MiB",
    ]
    return " | ".join(parts)


class ProgressLine(Callback):
    """Rank 0's progress line every ``log_every_n_steps`` steps, no sooner than ``min_interval_s`` after the
    previous one, and at the last step; must come after ``metrics`` in the callback list (it reads that
    step's loss, learning rate and memory). Its rates, TFLOP/s and MFU go to the loggers every logging step.

    (A line costs rank 0 a write to its console, which W&B also captures: about 2 ms, which the other
    ranks of a pipeline wait for; every 5 steps of 60 ms that was half a per cent of the run.)"""

    def __init__(self, metrics: PipelineMetrics, replicas: int, min_interval_s: float = 1.0) -> None:
        self.metrics, self.replicas, self.min_interval_s = metrics, replicas, float(min_interval_s)
        self._since: tuple[float, int] | None = None  # (time, step) of the previous logging step
        self._printed = float("-inf")  # when the previous line was printed

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._since = (time.perf_counter(), trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or not reporting_step(trainer, step) or self._since is None:
            return
        now = time.perf_counter()
        then, before = self._since
        self._since = (now, step)
        steps, seconds = max(step - before, 1), max(now - then, 1e-9)
        samples = steps * self.metrics.layout.global_batch_size / seconds
        tokens = steps * tokens_in(batch) * self.replicas / seconds
        util = self.metrics.utilisation
        tflops, mfu = util.tflops_per_device(tokens), util.mfu(tokens)
        loss = self.metrics.loss_history[-1] if self.metrics.loss_history else None
        lr = self.metrics.lr_history[-1] if self.metrics.lr_history else None
        peak = max(self.metrics.peak_memory) if self.metrics.peak_memory else None
        metrics = {"throughput/samples_per_s": samples, "throughput/tokens_per_s": tokens,
                   "throughput/tflops_per_device": tflops, "throughput/mfu": mfu}
        for logger in trainer.loggers:
            logger.log_metrics({k: v for k, v in metrics.items() if v is not None}, step=step - 1)
        if trainer.progress_bar_callback is not None:  # the bar shows the step and loss; add MFU
            if mfu is not None:
                pl_module.log("mfu", mfu, prog_bar=True, logger=False, rank_zero_only=True)
            return
        if now - self._printed >= self.min_interval_s or last_step(trainer, step) or trainer.should_stop:
            self._printed = now
            print(format_progress(step, trainer.max_steps, loss, lr, samples, tokens, tflops, mfu, peak), flush=True)
