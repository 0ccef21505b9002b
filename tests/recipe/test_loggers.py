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
from pipeline_recipes.recipe.job_spec import JobSpec
from pipeline_recipes.recipe.settings import Layout
from pipeline_recipes.recipe.loggers import check_logger, instantiate_loggers, logger_arguments, run_values

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


def test_train_refuses_a_bad_logger_before_launching(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=csv", "logger.from_run.save_dir=dri", "trainer=cpu",
           f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "logger.from_run.save_dir = 'dri' is not a value of the run" in result.stderr
    assert not (tmp_path / "logs").exists()  # no worker was started
