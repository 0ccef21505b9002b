"""The ``logger`` group, instantiated from ``_target_`` configs, as lightning-hydra-template's
``instantiate_loggers`` does: ``conf/logger/<name>.yaml`` names a Lightning logger class (``_target_``) and its
arguments, so a new logger is one yaml. ``_target_: null`` (``logger=none``) is no logger.

What depends on the run is not written in the yaml but mapped in from the run by the yaml's ``from_run``
(``{argument: run value}``), one rule for every logger: the run's values are :data:`~pipeline_recipes.recipe.check.logger.RUN_VALUES` (its
directory, its name ``{strategy}-W{W}-D{D}-B{B}-{model}``, its group, its strategy and its tags, those of
:func:`run_tags`). An argument also set in the yaml or on the command line keeps that value; a list (the
tags) is extended by it. :func:`~pipeline_recipes.recipe.check.logger.check_logger` refuses a bad logger config
before any process is launched.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_recipes.recipe.worker.background_logger import BackgroundWandbLogger, quiet_wandb_info
from pipeline_recipes.recipe.worker.job_spec import JobSpec
from pipeline_recipes.recipe.check.logger import DRAIN_TIMEOUT, FROM_RUN, check_logger

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger

# Lightning's CSVLogger warns whenever its directory is not empty, and the job directory always holds job.yaml and
# logs/; it deletes only its metrics.csv, so the warning is news only where that file is there (a resumed run's rows)
CSV_DIR_NOTICE = r"Experiment logs directory .* exists and is not empty\. Previous log files in this directory"


def run_tags(spec: JobSpec) -> list[str]:
    """W&B tags that filter a sweep: ``strategy=…``, ``model=…``, ``W=…``, ``D=…``, ``B=…``."""
    layout = spec.layout
    return [f"strategy={layout.label}", f"model={model_name(spec)}", f"W={layout.W}", f"D={layout.D}",
            f"B={layout.B}"]


def model_name(spec: JobSpec) -> str:
    return str((spec.config.get("model") or {}).get("name") or "model")


def run_values(spec: JobSpec) -> dict[str, Any]:
    """The run's values a logger argument may take (:data:`~pipeline_recipes.recipe.check.logger.RUN_VALUES`)."""
    return {"dir": spec.out_dir, "name": f"{spec.layout.run_name}-{model_name(spec)}", "group": spec.group,
            "strategy": spec.layout.label, "tags": run_tags(spec)}


def logger_arguments(cfg: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``instantiate`` config of the logger ``cfg`` for a run of ``run`` values (see the module
    docstring), without the keys its class does not take; None for no logger."""
    cfg = dict(cfg)
    mapping = dict(cfg.pop(FROM_RUN, None) or {})
    if cfg.get("_target_") is None:
        return None
    for argument, value in mapping.items():
        given = cfg.get(argument)
        if isinstance(run[value], list):
            cfg[argument] = [*run[value], *(given or [])]
        elif given is None:
            cfg[argument] = run[value]
    return without_writer_keys(cfg)


def without_writer_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """The logger config without ``drain_timeout_s`` when its ``_target_`` is not the background W&B writer
    (:class:`pipeline_recipes.recipe.worker.background_logger.BackgroundWandbLogger`): Lightning's own ``WandbLogger``
    would hand the key on to ``wandb.init``, which rejects it."""
    if DRAIN_TIMEOUT not in cfg:
        return cfg
    from hydra.utils import get_class

    cls = get_class(cfg["_target_"])
    if isinstance(cls, type) and issubclass(cls, BackgroundWandbLogger):
        return cfg
    return {k: v for k, v in cfg.items() if k != DRAIN_TIMEOUT}


def instantiate_loggers(spec: JobSpec) -> list[Logger]:
    """The run's loggers (none or one), each given the resolved config and the derived layout as
    hyperparameters. A W&B logger's run prints none of W&B's information lines
    (:func:`~pipeline_recipes.recipe.worker.background_logger.quiet_wandb_info`); Lightning's CSV logger says its directory
    is not empty only where it holds a ``metrics.csv`` for it to delete (:data:`CSV_DIR_NOTICE`)."""
    cfg = spec.config.get("logger") or {}
    check_logger(cfg)
    arguments = logger_arguments(cfg, run_values(spec))
    if arguments is None:
        return []
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import WandbLogger

    logger = instantiate(arguments)
    if isinstance(logger, WandbLogger):
        quiet_wandb_info()  # before the run starts (log_hyperparams): its block becomes finish_wandb's one line
    with _without_csv_false_alarm(logger):
        logger.log_hyperparams({**spec.config, "derived": spec.layout.as_dict()})  # a CSV logger opens its file here
    return [logger]


@contextlib.contextmanager
def _without_csv_false_alarm(logger: Logger) -> Iterator[None]:
    """Inside it, :data:`CSV_DIR_NOTICE` is dropped when ``logger`` is a CSV logger whose directory holds no metrics
    file (nothing to delete); any other logger, or one that would delete rows, is left as it is."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    if not isinstance(logger, CSVLogger) or (Path(logger.log_dir) / ExperimentWriter.NAME_METRICS_FILE).exists():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CSV_DIR_NOTICE)
        yield
