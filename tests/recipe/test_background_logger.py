"""The W&B logger that writes metric rows from a background thread: same records, same order as the
plain logger (read back from the offline run file); failures and stalls surface on the training thread, except
that a backend that is gone (W&B's service signalled with the job) is one warning and never the job's end."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import WandbLogger

from pipeline_recipes.recipe.worker import background_logger as background_logger
from pipeline_recipes.recipe.worker.background_logger import BackgroundWandbLogger, backend_gone, finish_wandb, lost


@pytest.mark.slow
def test_rows_reach_the_offline_run_in_order(tmp_path: Path) -> None:
    import wandb

    from pipeline_recipes.recipe.worker.wandb_offline import find_offline_runs, read_offline_run

    logger = BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True, name="bg")
    try:
        logger.log_hyperparams({"lr": 0.5})
        for step in range(30):
            logger.log_metrics({"train/lr": step / 10, "train/loss": 100.0 - step}, step=step)
        logger.experiment.summary.update({"done": 1})  # another use of the run: waits for the rows first
        logger.finalize("success")
    finally:
        wandb.finish()
        wandb.teardown()  # its service ends and WANDB_SERVICE leaves os.environ: later train.py runs start their own
    deadline = time.monotonic() + 60  # W&B's service may still be writing the run file when finish() returns
    while True:
        (run,) = find_offline_runs(tmp_path)
        rows = [r for r in run.history if "train/lr" in r]
        if (len(rows) >= 30 and "done" in run.summary) or time.monotonic() > deadline:  # the summary comes last
            break
        time.sleep(0.5)
    assert [r["trainer/global_step"] for r in rows] == list(range(30))
    assert [r["train/loss"] for r in rows] == [100.0 - s for s in range(30)]
    assert run.config["lr"] == 0.5 and run.summary["done"] == 1
    cut = tmp_path / "cut" / run.path.name  # a run file whose writer was killed mid-record reads up to it
    cut.parent.mkdir()
    cut.write_bytes(run.path.read_bytes()[:-3])
    assert read_offline_run(cut).history == run.history[:len(read_offline_run(cut).history)]


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
    from pipeline_recipes.recipe.check.settings import ConfigError, check_drain_timeout

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

    from pipeline_recipes.recipe.worker.loggers import without_writer_keys

    ours = {"_target_": "pipeline_recipes.recipe.worker.background_logger.BackgroundWandbLogger", "drain_timeout_s": 9}
    assert without_writer_keys(ours) == ours
    theirs = without_writer_keys({**ours, "_target_": "lightning.pytorch.loggers.WandbLogger", "offline": True})
    assert theirs == {"_target_": "lightning.pytorch.loggers.WandbLogger", "offline": True}
    assert "drain_timeout_s" not in WandbLogger.__init__.__code__.co_varnames  # it would reach wandb.init


class MailboxClosedError(Exception):
    """Named as wandb 0.31's error for a connection to its service that closed."""


@pytest.mark.parametrize("error, gone", [
    (ConnectionResetError(104, "Connection reset by peer"), True), (BrokenPipeError(), True), (EOFError(), True),
    (MailboxClosedError(), True), (OSError("disk full"), False), (ValueError("bad metric"), False),
    (KeyboardInterrupt(), False),
])
def test_what_says_the_backend_is_gone(monkeypatch: pytest.MonkeyPatch, error: BaseException, gone: bool) -> None:
    monkeypatch.setattr(background_logger, "service_exited", lambda: None)
    assert backend_gone(error) is gone
    try:  # anywhere in the chain
        try:
            raise error
        except BaseException as cause:
            raise RuntimeError("wrapped") from cause
    except RuntimeError as wrapped:
        assert backend_gone(wrapped) is gone
    monkeypatch.setattr(background_logger, "service_exited", lambda: True)  # any error once the service has exited
    assert backend_gone(ValueError("bad metric")) and not backend_gone(KeyboardInterrupt())


def _warnings(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]


def test_a_backend_gone_is_one_warning_and_logging_stops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """W&B's service is gone from step 2 on (a signal reached it): no logger call raises, one warning says it,
    nothing more is sent to the run; ``finish_wandb`` (its ``wandb.finish()`` failing too) adds no second line."""
    import wandb

    monkeypatch.setattr(background_logger, "service_exited", lambda: None)
    written: list[int] = []

    def write(self: WandbLogger, metrics: dict, step: int | None = None) -> None:
        if step >= 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        written.append(step)

    def config_update(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run was used after its backend was gone")

    monkeypatch.setattr(WandbLogger, "log_metrics", write)
    logger = BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True)
    logger._experiment = SimpleNamespace(config=SimpleNamespace(update=config_update))
    for step in range(6):
        logger.log_metrics({"x": 1.0}, step=step)
    logger.drain()  # the write error is heard here: a warning, not an exception
    assert lost(logger) == "ConnectionResetError: [Errno 104] Connection reset by peer"
    logger.log_metrics({"x": 1.0}, step=6)
    logger.log_hyperparams({"lr": 0.5})
    logger.finalize("success")
    finished, torn_down = [], []
    monkeypatch.setattr(wandb, "finish", lambda: finished.append(1) or (_ for _ in ()).throw(BrokenPipeError()))
    monkeypatch.setattr(wandb, "teardown", lambda: torn_down.append(1))
    finish_wandb([logger], run_error=None)
    assert written == [0, 1] and finished == [1] and torn_down == [1]  # wandb's exit hook ends here, not at exit
    [warning] = _warnings(capsys)
    assert "BackgroundWandbLogger stopped logging for the rest of the run, its backend is gone" in warning
    assert "results.json" in warning


def test_a_hung_or_failing_wandb_finish(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``wandb.finish()`` is bounded (``drain_timeout_s``): one that does not return is a warning; one that finds
    the service gone is a warning; any other error is raised after a run that raised nothing, and only said after
    a run's own error (which it must not hide)."""
    import wandb

    monkeypatch.setattr(background_logger, "service_exited", lambda: None)
    monkeypatch.setattr(wandb, "teardown", lambda: None)
    release = threading.Event()

    def fresh() -> BackgroundWandbLogger:
        return BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True, drain_timeout_s=0.3)

    monkeypatch.setattr(wandb, "finish", lambda: release.wait(30))
    started = time.monotonic()
    finish_wandb([fresh()], run_error=None)
    assert time.monotonic() - started < 5
    release.set()
    [hung] = _warnings(capsys)
    assert "TimeoutError: wandb.finish() did not return within 0.3 s" in hung

    def fail(error: BaseException):  # noqa: ANN202
        def finish() -> None:
            raise error
        return finish

    monkeypatch.setattr(wandb, "finish", fail(EOFError("service closed")))
    finish_wandb([fresh()], run_error=None)
    assert "EOFError: service closed" in _warnings(capsys)[0]
    monkeypatch.setattr(wandb, "finish", fail(ValueError("a bug of ours")))
    with pytest.raises(ValueError, match="a bug of ours"):
        finish_wandb([fresh()], run_error=None)
    finish_wandb([fresh()], run_error=RuntimeError("the run's own error"))
    assert _warnings(capsys) == ["warning: wandb.finish() failed: ValueError: a bug of ours"]
    finish_wandb([], run_error=None)  # no W&B logger: nothing to finish


def test_the_job_end_stands_when_the_wandb_service_is_gone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0's end of a stopped job whose W&B service was signalled with it: the last rows, the summary and
    ``wandb.finish()`` all meet the dead service; ``results.json`` still holds the losses and step reached (for the
    launcher to write the job's end over), and the logger's failure is one warning line."""
    import wandb

    from pipeline_recipes.recipe.worker.metrics import PipelineMetrics, ReplicaThroughputMonitor
    from pipeline_recipes.recipe.report.results import read_results
    from pipeline_recipes.recipe.check.settings import Layout

    monkeypatch.setattr(background_logger, "service_exited", lambda: None)

    def gone(*args: object, **kwargs: object) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(WandbLogger, "log_metrics", gone)
    monkeypatch.setattr(wandb, "finish", gone)
    monkeypatch.setattr(wandb, "teardown", gone)
    logger = BackgroundWandbLogger(project="test", save_dir=str(tmp_path), offline=True)
    logger._experiment = SimpleNamespace(summary=SimpleNamespace(update=gone))
    layout = Layout("dapple", world_size=2, W=1, D=2, B=4, N=2, global_batch_size=8, pipelines=1)
    metrics = PipelineMetrics(layout, tmp_path, ReplicaThroughputMonitor(1))
    metrics.loss_history, metrics._rows = [6.9, 6.8, 6.7], [(2, {"train/lr": 1e-3})]
    trainer = SimpleNamespace(strategy=None, is_global_zero=True, loggers=[logger], global_step=3)
    metrics.on_train_end(trainer, None)  # type: ignore[arg-type]
    logger.finalize("success")  # Lightning's teardown after a stop
    finish_wandb([logger], run_error=None)
    result = read_results(tmp_path)
    # rank 0's figures were written before the loggers were called; the launcher writes the job's end over them
    assert (result.status, list(result.loss_history), result.global_step) == ("running", [6.9, 6.8, 6.7], 3)
    [warning] = _warnings(capsys)
    assert "its backend is gone (ConnectionResetError: [Errno 104] Connection reset by peer" in warning


KILLED_SERVICE = """
import signal, sys
import psutil
from pipeline_recipes.recipe.worker.background_logger import BackgroundWandbLogger, backend_failures_warned, finish_wandb, lost

logger = BackgroundWandbLogger(project="test", save_dir=sys.argv[1], offline=True)
logger.log_hyperparams({"lr": 0.5})
for step in range(5):
    logger.log_metrics({"x": float(step)}, step=step)
logger.drain()
services = [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]
assert services, "no W&B service process"
for service in services:  # what SLURM does to every process of the job step
    service.send_signal(signal.SIGTERM)
psutil.wait_procs(services, timeout=30)
for step in range(5, 10):
    logger.log_metrics({"x": float(step)}, step=step)
with backend_failures_warned(logger):  # as rank 0's metrics put the run's summary
    logger.experiment.summary.update({"done": 1})
logger.finalize("success")
finish_wandb([logger], run_error=None)
print("lost:", lost(logger))
sys.exit(143)
"""


@pytest.mark.slow
def test_a_real_wandb_service_signalled_mid_run(tmp_path: Path) -> None:
    """wandb 0.31 itself: its service process SIGTERMed mid-run (as SLURM signals every process of a step); the
    process goes on, says it once, and exits with its own status, no traceback, not even from wandb's exit hook."""
    import os
    import subprocess
    import sys

    script = tmp_path / "killed_service.py"
    script.write_text(KILLED_SERVICE)
    # without the service this process may have started (WANDB_SERVICE): the script starts its own
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**env, "WANDB_SILENT": "true"}, check=False)
    assert done.returncode == 143, done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "its backend is gone" in warnings[0], done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "socket.send() raised exception" not in done.stderr, done.stderr
    assert "lost: " in done.stdout and "lost: None" not in done.stdout
