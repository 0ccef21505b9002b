"""Loggers from ``_target_`` configs (``conf/logger/*.yaml``): each yaml instantiates its class with the run's
values mapped in by ``from_run``; W&B stays offline; a bad logger config is refused before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_recipes.core.fixes import ConfigError
from pipeline_recipes.recipe.worker.job_spec import JobSpec
from pipeline_recipes.recipe.check.settings import Layout
from pipeline_recipes.recipe.check.logger import check_logger
from pipeline_recipes.recipe.worker.loggers import instantiate_loggers, logger_arguments, run_values

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "logger"


def _yaml(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


def _spec(tmp_path: Path, logger: dict) -> JobSpec:
    layout = Layout("dapple", world_size=2, W=1, D=2, B=4, N=2, global_batch_size=8, pipelines=1)
    return JobSpec({"model": {"name": "gpt2-tiny"}, "logger": logger}, layout, str(tmp_path), "runs")


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_logger_yaml_passes_the_check(name: str) -> None:
    check_logger(_yaml(name))


def test_csv_writes_into_the_job_directory(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    [logger] = instantiate_loggers(_spec(tmp_path, _yaml("csv")))
    assert isinstance(logger, CSVLogger)
    assert Path(logger.log_dir) == tmp_path  # save_dir/name/version with name = version = ""


def test_no_logger(tmp_path: Path) -> None:
    assert instantiate_loggers(_spec(tmp_path, _yaml("none"))) == []


def test_wandb_is_offline_and_named_by_the_run(tmp_path: Path) -> None:
    run = run_values(_spec(tmp_path, {}))
    args = logger_arguments({**_yaml("wandb"), "tags": ["mine"]}, run)
    assert args["offline"] is True
    assert args["name"] == "dapple-W1-D2-B4-gpt2-tiny" and args["group"] == "runs" and args["job_type"] == "dapple"
    assert args["save_dir"] == str(tmp_path)
    assert args["tags"] == ["strategy=dapple", "model=gpt2-tiny", "W=1", "D=2", "B=4", "mine"]
    assert "from_run" not in args
    assert logger_arguments({**_yaml("wandb"), "name": "mine"}, run)["name"] == "mine"  # the config's value wins


@pytest.mark.parametrize("logger, message, fix", [
    ({"_target_": "CSVLogger"}, "logger._target_ = 'CSVLogger': a logger is the dotted path", "logger._target_=null"),
    ({"_target_": "a.B", "from_run": {"save_dir": "dri"}},
     "logger.from_run.save_dir = 'dri' is not a value of the run", "logger.from_run.save_dir=dir"),
    ({"_target_": "a.B", "drain_timeout_s": 0}, "logger.drain_timeout_s = 0", "logger.drain_timeout_s=300"),
])
def test_a_bad_logger_config_is_refused(logger: dict, message: str, fix: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_logger(logger)
    assert message in str(refused.value) and fix in str(refused.value)


@pytest.mark.slow
def test_train_refuses_a_bad_logger_before_launching(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=csv", "logger.from_run.save_dir=dri", "trainer=cpu",
           f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "logger.from_run.save_dir = 'dri' is not a value of the run" in result.stderr
    assert not (tmp_path / "logs").exists()  # no worker was started


def _warnings_while(call) -> list[str]:
    """The warning messages ``call()`` raises (every one shown), the warning filters restored after."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_the_csv_logger_says_its_directory_is_not_empty_only_when_it_deletes_rows(tmp_path: Path) -> None:
    """A new job directory holds job.yaml and logs/ before the logger starts: Lightning's "Previous log files in this
    directory will be deleted" is a false alarm there (nothing is deleted) and is dropped; where a metrics.csv is
    there (a resumed run's rows) Lightning deletes it, and says so."""
    from lightning.pytorch.loggers import CSVLogger

    (tmp_path / "job.yaml").write_text("{}\n")
    (tmp_path / "logs").mkdir()
    notice = "Previous log files in this directory will be deleted"
    loggers: list = []
    assert not [m for m in _warnings_while(lambda: loggers.extend(instantiate_loggers(_spec(tmp_path, _yaml("csv")))))
                if notice in m]
    [logger] = loggers
    assert isinstance(logger, CSVLogger)
    logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.save()
    assert (tmp_path / "metrics.csv").is_file()
    again = _warnings_while(lambda: instantiate_loggers(_spec(tmp_path, _yaml("csv"))))
    assert any(notice in m for m in again), again
    assert not (tmp_path / "metrics.csv").exists()  # what it said: the rows before are gone


def test_a_resume_from_the_job_directory_drops_the_checkpoint_directory_notice(tmp_path: Path) -> None:
    """ModelCheckpoint's "Checkpoint directory … exists and is not empty" is the save a resume continues from: dropped
    when ``ckpt_path`` lies in that directory, kept for a fresh run or a resume from elsewhere."""
    from pipeline_recipes.recipe.worker.job import checkpoint_callbacks, quiet_resume_notice

    [callback] = checkpoint_callbacks(JobSpec({"checkpoint": {"every_n_steps": 2}}, None, str(tmp_path), "runs"))
    saved = tmp_path / "checkpoints" / "step-000002.ckpt"
    saved.mkdir(parents=True)
    notice = f"Checkpoint directory {callback.dirpath} exists and is not empty."

    def setup_notice(ckpt_path: str | None):  # what ModelCheckpoint.setup says of its directory, after the recipe
        def call() -> None:
            quiet_resume_notice([callback], ckpt_path)
            callback._ModelCheckpoint__warn_if_dir_not_empty(callback.dirpath)
        return call

    assert _warnings_while(setup_notice(None)) == [notice]  # a fresh run into a used job directory
    assert _warnings_while(setup_notice(str(tmp_path / "elsewhere.ckpt"))) == [notice]
    assert _warnings_while(setup_notice(str(saved))) == []


def test_lightning_banners_are_dropped_and_its_warnings_kept(tmp_path: Path) -> None:
    """The recipe's own lines say the accelerator, the processes and the steps: Lightning's banners saying them again
    (as Lightning 2.6 writes them) are dropped, at INFO only; its other lines and every warning stay."""
    import logging

    from lightning.fabric.utilities.rank_zero import rank_zero_info
    from lightning.pytorch.trainer.setup import _log_device_info

    from pipeline_recipes.recipe.worker.job import NOTICE_LOGGERS, is_news, quiet_library_notices

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    kept = Kept()
    loggers = [logging.getLogger(name) for name in NOTICE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(kept)
        logger.setLevel(logging.DEBUG)
    try:
        quiet_library_notices()

        class Trainer:  # what _log_device_info reads of a Trainer on CPU
            from lightning.pytorch.accelerators import CPUAccelerator

            accelerator = CPUAccelerator()
            num_devices = 2

        warned = _warnings_while(lambda: _log_device_info(Trainer()))
        rank_zero_info("`Trainer.fit` stopped: `max_steps=40` reached.")
        rank_zero_info("`Trainer.fit` stopped: `max_epochs=1` reached.")
        rank_zero_info(f"{'-' * 100}\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 2 "
                       f"processes\n{'-' * 100}\n")
        logging.getLogger("lightning.fabric.utilities.distributed").info(
            "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").warning("GPU available: True, used: False")
        logging.getLogger("lightning.pytorch.accelerators.cuda").info("LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0,1]")
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(kept)
            logger.removeFilter(is_news)
            logger.setLevel(level)
    assert kept.lines == ["`Trainer.fit` stopped: `max_epochs=1` reached.", "GPU available: True, used: False"]
    assert warned == []  # no GPU here: nothing to warn about


def test_wandb_runs_print_no_information_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A W&B logger's job turns W&B's show_info off (its banner, panels and sync advice go to its debug log; its
    warnings stay on) unless the environment chose: ``WANDB_SHOW_INFO=true`` keeps W&B's own lines."""
    from pipeline_recipes.recipe.worker.background_logger import quiet_wandb_info

    monkeypatch.delenv("WANDB_SHOW_INFO", raising=False)
    quiet_wandb_info()
    assert os.environ["WANDB_SHOW_INFO"] == "false"
    monkeypatch.setenv("WANDB_SHOW_INFO", "true")
    quiet_wandb_info()
    assert os.environ["WANDB_SHOW_INFO"] == "true"
