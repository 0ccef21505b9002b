"""The ``logger`` config checked before any process is launched (:mod:`pipeline_recipes.recipe.worker.loggers`
instantiates it in the workers); imports neither Lightning nor torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline_recipes.core.errors import did_you_mean
from pipeline_recipes.core.fixes import ConfigError, values
from pipeline_recipes.recipe.check.settings import check_drain_timeout

FROM_RUN = "from_run"  # the yaml's key mapping logger arguments to run values
RUN_VALUES = ("dir", "name", "group", "strategy", "tags")
DRAIN_TIMEOUT = "drain_timeout_s"  # BackgroundWandbLogger's own argument


def check_logger(cfg: Mapping[str, Any] | None) -> None:
    """Refuse a ``logger`` config whose ``_target_`` is not a dotted class path, whose ``from_run`` maps an
    argument to something that is not a run value, or whose ``drain_timeout_s`` is not a positive number."""
    cfg = cfg or {}
    target = cfg.get("_target_")
    if target is not None and (not isinstance(target, str) or "." not in target.strip(".")):
        raise ConfigError(f"logger._target_ = {target!r}: a logger is the dotted path of a Lightning logger class "
                          "(e.g. lightning.pytorch.loggers.CSVLogger), or null for none",
                          [values("logger._target_", [None], lead="no logger:")])
    mapping = cfg.get(FROM_RUN) or {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"logger.{FROM_RUN} = {mapping!r}: it maps logger arguments to run values "
                          f"({{argument: value}}, values among {', '.join(RUN_VALUES)})",
                          [values("logger._target_", [None], lead="no logger:")])
    for argument, value in mapping.items():
        if value not in RUN_VALUES:
            key = f"logger.{FROM_RUN}.{argument}"
            close = did_you_mean(value, RUN_VALUES)
            raise ConfigError(f"{key} = {value!r} is not a value of the run: the run gives a logger argument one of "
                              f"{', '.join(RUN_VALUES)}",
                              [values(key, [close] if close else RUN_VALUES, keep=1,
                                      lead=f"did you mean {close!r}?" if close else "")])
    if cfg.get(DRAIN_TIMEOUT) is not None:
        check_drain_timeout(cfg[DRAIN_TIMEOUT])
