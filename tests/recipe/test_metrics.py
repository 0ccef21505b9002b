"""The metrics callback gathers over the ranks only on reporting steps, yet reports every step; the
module logs ``train/loss`` on the steps that read it.

One process, no process group: a stand-in trainer drives :class:`recipe.metrics.PipelineMetrics`
through five steps with ``log_every_n_steps = 2``; a real Trainer (the toy module of
``lightning_job.py``, single device) shows which rows Lightning writes and what callbacks read.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

import torch

from pipeline_recipes.recipe.check.settings import Layout
from pipeline_recipes.recipe.worker.metrics import PipelineMetrics, ReplicaThroughputMonitor


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



def test_reporting_steps_are_the_loggers_steps_and_the_last() -> None:
    from pipeline_recipes.strategies.lightning.strategy import reporting_step

    trainer = SimpleNamespace(log_every_n_steps=4, max_steps=10)
    assert [s for s in range(1, 11) if reporting_step(trainer, s)] == [4, 8, 10]  # s % 4 == 0, and the last
    trainer.max_steps = -1  # bounded by epochs: no last step known
    assert [s for s in range(1, 11) if reporting_step(trainer, s)] == [4, 8]


class _Rows(Logger):
    """A Lightning logger that keeps every row it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows[int(step)] = {k: float(v) for k, v in metrics.items()}


class _Seen(Callback):
    """Each step's own loss and what callbacks read; optionally sets ``should_stop`` from a step on."""

    def __init__(self, stop_from: int | None = None) -> None:
        self.losses: list[float] = []
        self.read: list[float] = []
        self.stop_from = stop_from

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.read.append(float(trainer.callback_metrics["train/loss"]))  # no KeyError on any step
        if self.stop_from is not None and trainer.global_step >= self.stop_from:
            trainer.should_stop = True


def _fit(max_steps: int, min_steps: int | None = None,
         stop_from: int | None = None) -> tuple[dict[int, dict[str, float]], _Seen]:
    from lightning_job import UserModule, loaders

    import lightning.pytorch as pl

    torch.manual_seed(0)
    rows, seen = _Rows(), _Seen(stop_from)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, min_steps=min_steps,
                         log_every_n_steps=3, logger=rows, callbacks=[seen], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(UserModule(), train_dataloaders=loaders(single_process=True)[0])
    return rows.rows, seen


def test_train_loss_is_logged_on_the_steps_that_read_it() -> None:
    """A real Trainer over 4 epochs of 2 steps: every row Lightning writes carries that step's own loss
    (Lightning writes step s when s % log_every_n_steps == 0, and every step while ``should_stop`` is
    set), and ``callback_metrics["train/loss"]`` exists on every step: the last logged value."""
    rows, seen = _fit(max_steps=8)
    assert sorted(rows) == [2, 5]  # 0-based steps of the loggers: the 3rd and 6th optimizer steps
    for step, row in rows.items():
        assert row["train/loss"] == seen.losses[step], step
    logged = [1, 2, 3, 4, 6, 8]  # the first; each epoch's last (2, 4, 6, 8); the loggers' 3 and 6
    expected = [seen.losses[max(s for s in logged if s <= step) - 1] for step in range(1, 9)]
    assert seen.read == expected
    # EarlyStopping under min_steps keeps training with should_stop set: Lightning writes every step
    rows, seen = _fit(max_steps=8, min_steps=7, stop_from=3)
    assert sorted(rows) == [2, 3, 4, 5, 6]
    for step, row in rows.items():
        assert row["train/loss"] == seen.losses[step], step


def test_throughput_windows_count_the_replicas_and_only_rank_zero_measures(monkeypatch) -> None:
    """Windows of 3 steps, 0.5 s per step, batches of 4 samples × 8 tokens on each of W = 2 replicas: every
    window reads 16 samples/s, 128 tokens/s and 0.5 s per iteration, a validation run inside one left out;
    another rank records nothing."""
    from pipeline_recipes.recipe.worker import metrics as metrics_module

    now = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: now[0])
    monitor = ReplicaThroughputMonitor(replicas=2, window_size=3)
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    monitor.on_train_start(trainer, None)
    for step in range(7):
        now[0] += 0.5
        if step == 4:  # a 10 s validation run inside the second window is not training time
            monitor.on_validation_start(trainer, None)
            now[0] += 10.0
            monitor.on_validation_end(trainer, None)
        monitor.on_train_batch_end(trainer, None, None, batch, step)
    assert monitor.history == [{"samples_per_s": 16.0, "tokens_per_s": 128.0, "iteration_s": 0.5}] * 2
    assert monitor.median("iteration_s", warmup=1) == 0.5
    other = ReplicaThroughputMonitor(replicas=2, window_size=1)
    other.on_train_start(trainer, None)
    other.on_train_batch_end(SimpleNamespace(is_global_zero=False), None, None, batch, 0)
    assert other.history == []


def _gpipe_2x2_rows(waits: float = 0.0) -> list[list[tuple[Any, float, float]]]:
    """GPipe with D = 2, N = 2 as measured: per stage F of 1 s (stage 0 as 0.5 s and 1.5 s) and 2 s, B of
    3 s (2.5 s and 3.5 s) and 4 s, one after the other on each rank with ``waits`` between the boxes."""
    from pipeline_recipes.strategies.schedules import build_schedule

    seconds = {(0, "F"): [0.5, 1.5], (0, "B"): [2.5, 3.5], (1, "F"): [2.0, 2.0], (1, "B"): [4.0, 4.0]}
    rows = []
    for actions in build_schedule("gpipe", 2, 2).workers:
        row, t = [], 0.0
        for a in actions:
            duration = seconds[(a.stage, a.kind)][a.mbs[0]]
            row.append((a, t, t + duration))
            t += duration + waits
        rows.append(row)
    return rows


def test_theory_bubble_is_the_measured_quantity_for_the_schedule_at_the_measured_action_times() -> None:
    """Both ratios are 1 − Σ busy / (ranks × the longest span). By hand, GPipe D = 2, N = 2 at t_f = (1, 2),
    t_b = (3, 4) (the measured per-stage means) without communication: P0 runs F0 [0,1] F1 [1,2], P1 F0 [1,3]
    F1 [3,5] B0 [5,9] B1 [9,13], P0 B0 [9,12] B1 [13,16]: busy 8 and 12, spans 16 and 12, bubble
    1 − 20 / (2 × 16) = 0.375, whatever the recorded boxes' own start times and waits."""
    from pipeline_recipes.recipe.worker.metrics import bubble_ratio, measured_costs, theory_bubble_ratio
    from pipeline_recipes.strategies.schedules import build_schedule

    gpipe = build_schedule("gpipe", 2, 2)
    assert measured_costs(_gpipe_2x2_rows(), 2) == ([1.0, 2.0], [3.0, 4.0], None)
    assert theory_bubble_ratio(gpipe, _gpipe_2x2_rows()) == pytest.approx(0.375)
    assert theory_bubble_ratio(gpipe, _gpipe_2x2_rows(waits=5.0)) == pytest.approx(0.375)
    # measured: busy 8 s and 12 s; with 1 s between boxes the spans are 11 s and 15 s
    assert bubble_ratio([(8.0, 11.0), (12.0, 15.0)]) == pytest.approx(1 - 20 / 30)
    assert bubble_ratio([(0.0, 0.0)]) == 0.0
    # no timeline: t_b = 2·t_f, as Chimera §2 draws it: P0 F [0,2] B [5,9], P1 F [1,3] B [3,7]; busy 6 and 6,
    # spans 9 and 6
    assert theory_bubble_ratio(gpipe, None) == pytest.approx(1 - 12 / 18)


def test_measured_costs_of_split_backwards_put_i_plus_w_into_t_b() -> None:
    """A split backward costs t_b − t_w (I) and t_w (W) in the simulator: I of 3 s and W of 1 s per micro-batch
    give t_b = 4, t_w = 1; a halved backward counts half a micro-batch."""
    from pipeline_recipes.recipe.worker.metrics import measured_costs
    from pipeline_recipes.strategies.schedules import Action

    row = [(Action("F", 0, 0, (0,)), 0.0, 1.0), (Action("I", 0, 0, (0,)), 1.0, 4.0),
           (Action("W", 0, 0, (0,)), 4.0, 5.0), (Action("B", 0, 1, (0,), half=0), 0.0, 1.5),
           (Action("F", 0, 1, (0, 1)), 2.0, 4.0)]
    assert measured_costs([row], 2) == ([1.0, 1.0], [4.0, 3.0], [1.0, 1.0])
