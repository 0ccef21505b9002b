"""The W&B logger that writes metric rows from a background thread: same records, same order as the
plain logger (read back from the offline run file); failures and stalls surface on the training thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import WandbLogger

from pipeline_recipes.recipe.background_logger import BackgroundWandbLogger


def test_rows_reach_the_offline_run_in_order(tmp_path: Path) -> None:
    import wandb

    from pipeline_recipes.recipe.wandb_offline import find_offline_runs

    logger = BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True, name="bg")
    try:
        logger.log_hyperparams({"lr": 0.5})
        for step in range(30):
            logger.log_metrics({"train/lr": step / 10, "train/loss": 100.0 - step}, step=step)
        logger.experiment.summary.update({"done": 1})  # another use of the run: waits for the rows first
        logger.finalize("success")
    finally:
        wandb.finish()
    deadline = time.monotonic() + 60  # W&B's service may still be writing the run file when finish() returns
    while True:
        (run,) = find_offline_runs(tmp_path)
        rows = [r for r in run.history if "train/lr" in r]
        if len(rows) >= 30 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [r["trainer/global_step"] for r in rows] == list(range(30))
    assert [r["train/loss"] for r in rows] == [100.0 - s for s in range(30)]
    assert run.config["lr"] == 0.5 and run.summary["done"] == 1


def test_a_failed_write_is_raised_on_the_training_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    written: list[int] = []

    def write(self: WandbLogger, metrics: dict, step: int | None = None) -> None:
        if step == 2:
            raise OSError("disk full")
        written.append(step)

    monkeypatch.setattr(WandbLogger, "log_metrics", write)
    logger = BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True)
    logger._experiment = SimpleNamespace()  # no W&B run: the writes are faked
    for step in range(4):
        logger.log_metrics({"x": 1.0}, step=step)
    with pytest.raises(RuntimeError, match="writing metrics to the W&B run failed: OSError"):
        logger.drain()
    assert written == [0, 1]  # rows after the failure are dropped, not written out of order
    logger.log_metrics({"x": 1.0}, step=5)  # reported once; the writer goes on
    logger.stop()
    assert written == [0, 1, 5]


def test_a_stalled_writer_times_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    release = threading.Event()
    monkeypatch.setattr(WandbLogger, "log_metrics", lambda self, metrics, step=None: release.wait(30))
    logger = BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True, drain_timeout_s=0.2)
    logger._experiment = SimpleNamespace()
    logger.log_metrics({"x": 1.0}, step=0)
    with pytest.raises(TimeoutError, match=r"logger.drain_timeout_s"):
        logger.drain()
    release.set()
    logger.stop()


def test_the_drain_timeout_must_be_positive(tmp_path: Path) -> None:
    from pipeline_recipes.recipe.settings import ConfigError, check_drain_timeout

    assert check_drain_timeout(5) == 5.0
    for bad in (0, -1.0, "300", None, True):
        with pytest.raises(ConfigError, match="logger.drain_timeout_s"):
            check_drain_timeout(bad)
    with pytest.raises(ConfigError, match="positive number of seconds"):
        BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True, drain_timeout_s=0)


def test_lightnings_own_wandb_logger_is_a_drop_in_target() -> None:
    """``logger._target_=lightning.pytorch.loggers.WandbLogger`` works without also removing the
    background writer's ``drain_timeout_s`` (which ``wandb.init`` would reject)."""
    from lightning.pytorch.loggers import WandbLogger

    from pipeline_recipes.recipe.loggers import without_writer_keys

    ours = {"_target_": "pipeline_recipes.recipe.background_logger.BackgroundWandbLogger", "drain_timeout_s": 9}
    assert without_writer_keys(ours) == ours
    theirs = without_writer_keys({**ours, "_target_": "lightning.pytorch.loggers.WandbLogger", "offline": True})
    assert theirs == {"_target_": "lightning.pytorch.loggers.WandbLogger", "offline": True}
    assert "drain_timeout_s" not in WandbLogger.__init__.__code__.co_varnames  # it would reach wandb.init
