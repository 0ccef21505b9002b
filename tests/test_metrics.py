"""The metrics callback gathers over the ranks only on reporting steps, yet reports every step.

Pure Python (one process, no process group): a stand-in trainer drives
:class:`recipe.metrics.PipelineMetrics` through five steps with ``log_every_n_steps = 2``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pipeline_recipes.recipe.layout import Layout
from pipeline_recipes.recipe.metrics import PipelineMetrics, ReplicaThroughputMonitor


class _Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append((step, dict(metrics)))


def _setup(tmp_path: Path) -> tuple[PipelineMetrics, SimpleNamespace, _Logger]:
    layout = Layout("single", world_size=1, W=1, D=1, B=8, N=1, global_batch_size=8, pipelines=1)
    metrics = PipelineMetrics(layout, tmp_path, ReplicaThroughputMonitor(1))
    logger = _Logger()
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), global_step=0,
                              log_every_n_steps=2, max_steps=5, is_global_zero=True, loggers=[logger],
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 0.0}])])
    metrics._trainer = trainer  # what setup() keeps (setup also resolves the device's peak FLOP/s)
    return metrics, trainer, logger


def _step(metrics: PipelineMetrics, trainer: SimpleNamespace, step: int) -> None:
    trainer.optimizers[0].param_groups[0]["lr"] = step / 10
    metrics.on_train_batch_start(trainer, None, {}, step - 1)
    trainer.global_step = step  # Lightning counts the optimizer step before on_train_batch_end
    metrics.on_train_batch_end(trainer, None, {"loss": torch.tensor(float(step))}, {}, step - 1)


def test_losses_arrive_on_reporting_steps_and_every_step_has_its_logger_row(tmp_path: Path) -> None:
    metrics, trainer, logger = _setup(tmp_path)
    seen = []
    for step in range(1, 6):
        _step(metrics, trainer, step)
        seen.append(list(metrics.loss_history))
    # reporting steps: every 2nd and the last one; the losses of the steps between come with them
    assert seen == [[], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]]
    assert metrics.lr_history == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert [(step, row["train/lr"]) for step, row in logger.rows] == [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4), (4, 0.5)]
    with_memory = [step for step, row in logger.rows if "memory/peak_bytes_max" in row]
    assert with_memory == [1, 3, 4]  # the reporting steps' rows (steps are 0-based in the loggers)
    assert metrics.peak_memory and metrics.peak_memory[0] > 0


def test_a_checkpoint_between_reporting_steps_keeps_every_loss(tmp_path: Path) -> None:
    metrics, trainer, _ = _setup(tmp_path)
    _step(metrics, trainer, 1)
    assert metrics.loss_history == []
    assert metrics.state_dict()["loss_history"] == [1.0]  # saved state includes the step not yet reported
    _step(metrics, trainer, 2)
    assert metrics.loss_history == [1.0, 2.0]


def test_train_loss_is_logged_on_the_steps_that_read_it() -> None:
    """``PipelineModule`` logs ``train/loss`` on the loggers' steps and the last one (Lightning's
    rule: step s, counted from 1, when s % log_every_n_steps == 0), its first step, and every step
    while a progress bar shows."""
    from pipeline_recipes.strategies.lightning import PipelineModule, reporting_step

    trainer = SimpleNamespace(log_every_n_steps=4, max_steps=10, global_step=0, progress_bar_callback=None,
                              callback_metrics={})
    assert [s for s in range(1, 11) if reporting_step(trainer, s)] == [4, 8, 10]
    module = PipelineModule(torch.nn.Linear(2, 2))
    module._trainer = trainer
    logged = []
    for step in range(10):  # global_step counts the optimizer steps done before this training step
        trainer.global_step = step
        if module._loss_read_now():
            logged.append(step + 1)
            trainer.callback_metrics["train/loss"] = 0.0
    assert logged == [1, 4, 8, 10]
    trainer.progress_bar_callback = object()
    assert module._loss_read_now()
