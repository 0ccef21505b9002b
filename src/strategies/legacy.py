"""Checkpoints written before the packages moved under one import name (``pipeline_recipes``), or before a
module moved into a folder by its job (:data:`MOVED`: ``"strategies.optim"`` is
:mod:`pipeline_recipes.strategies.lightning.optim` now).

Until then the folders of ``src/`` were installed as top-level packages (``strategies``, ``models``,
``planner``, ``recipe``, ``datamodules``), so a checkpoint's model config names its builder
``"models.build_gpt2"``, and anything pickled in it names classes such as
``"strategies.optim.WarmupDecayLR"``. Reading such a checkpoint:

* :func:`upgrade_targets` rewrites every Hydra ``_target_`` of an old name to today's
  (``"models.build_gpt2"`` -> ``"pipeline_recipes.models.build_gpt2"``); other strings are left alone;
* :func:`old_module_names` makes the old module names import today's modules (the very same module
  objects) while a checkpoint file is unpickled, and removes them afterwards, so nothing else ever
  sees two copies of a module.

Both are no-ops when the packages are themselves installed under their old names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from typing_extensions import override

# namespace: keep old names (this module is about them: the conversion script leaves it as it is)

# "pipeline_recipes" once installed under it; "" while the folders are top-level packages themselves
PACKAGE = (__package__ or "").rpartition(".")[0]
OLD_PACKAGES = ("datamodules", "models", "planner", "recipe", "strategies")
# modules that moved into folders by job (module -> its place now, both under PACKAGE)
MOVED = {
    **{f"strategies.{m}": f"strategies.runtime.{m}" for m in (
        "engine", "rank_setup", "executor", "stage", "p2p", "topology", "grad_sync", "versions", "late_loss",
        "recompute", "fetch_ahead", "process_group")},
    **{f"strategies.{m}": f"strategies.compute.{m}" for m in (
        "compile", "cuda_graphs", "cuda_graph_rules", "deferred_weights", "timing")},
    **{f"strategies.{m}": f"strategies.harness.{m}" for m in ("spawn", "emulated", "nccl_replay", "recording")},
    **{f"strategies.{m}": f"strategies.lightning.{m}" for m in ("stop", "precision", "optim", "baselines")},
    "strategies.pipeline_model": "core.pipeline_model",
    "recipe.fixes": "core.fixes",
    "planner.auto": "recipe.check.auto",
}


def current_name(name: str) -> str:
    """``name`` (a dotted module or object path) under today's names: an old top-level package moved under
    :data:`PACKAGE`, a module that moved (:data:`MOVED`) at its place now."""
    top = name.partition(".")[0]
    if PACKAGE and top in OLD_PACKAGES:
        name = f"{PACKAGE}.{name}"
    prefix = f"{PACKAGE}." if PACKAGE else ""
    if not name.startswith(prefix):
        return name
    rest = name[len(prefix):]
    for old in sorted(MOVED, key=len, reverse=True):
        if rest == old or rest.startswith(f"{old}."):
            return prefix + MOVED[old] + rest[len(old):]
    return name


def upgrade_targets(config: Any) -> Any:
    """A copy of ``config`` (nested mappings and lists) whose ``_target_`` values name today's modules."""
    if isinstance(config, Mapping):
        return {k: current_name(v) if k == "_target_" and isinstance(v, str) else upgrade_targets(v)
                for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(upgrade_targets(v) for v in config)
    return config


class _AliasLoader(importlib.abc.Loader):
    """Gives the already imported module of today's name for an old one."""

    def __init__(self, module: ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    @override
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    @override
    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # already executed under its own name, which its spec keeps


class _OldNameFinder(importlib.abc.MetaPathFinder):
    """``import strategies.optim`` (or ``"pipeline_recipes.strategies.optim"``) -> the module
    :mod:`pipeline_recipes.strategies.lightning.optim`."""

    def __init__(self) -> None:
        self.aliased: list[str] = []

    @override
    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = current_name(fullname)
        if new == fullname:
            return None
        module = importlib.import_module(new)
        self.aliased.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module),
                                              is_package=hasattr(module, "__path__"))


@contextmanager
def old_module_names() -> Iterator[None]:
    """Within the block, the old top-level names (``strategies``, ``models``, …) import today's modules.

    For unpickling a checkpoint written under the old names; afterwards the aliases are gone again
    (``sys.modules`` holds only today's names)."""
    if not PACKAGE:
        yield
        return
    finder = _OldNameFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in finder.aliased:
            sys.modules.pop(name, None)
