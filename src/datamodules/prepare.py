"""The job's data, checked and prepared on the node before any rank starts.

:func:`pipeline_recipes.recipe.launch.main.run` calls :func:`prepare_data` after the layout checks. First the local
``data.data_files`` must exist (no ``datasets`` import needed to say so); then :func:`.factory.build_source` runs
once in the launcher with the job's data settings: it downloads a hub dataset (or reads it from the local
cache), trains the tokenizer and writes the tokenized blocks or sentence pairs into ``data.cache_dir``
(:mod:`pipeline_recipes.datamodules.cache`), so that the ranks only read the cache. With network the data is still
fetched, once, here. A source that cannot be had (no such file, offline with an empty cache, no answer
from the hub) stops the job before any process starts, with the cause and the fixes, instead of
failing inside every rank before its layers exist.
"""

from __future__ import annotations

import glob
import importlib
import inspect
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import huggingface_hub.constants

from pipeline_recipes.core.errors import ConfigError, DataError, did_you_mean
from . import factory
from .corpus import DataUnavailable, all_files, normalize_data_files
from .tokenizer import OFFLINE_VARIABLES

TARGETS = ("pipeline_recipes.datamodules.build_datamodule", "pipeline_recipes.datamodules.datamodule.build_datamodule")
LOADER_KEYS = ("_target_", "name", "global_batch_size", "batch_size", "num_workers", "pin_memory")


def source_arguments(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(name, build_source keyword arguments)`` exactly as :class:`.datamodule.PipelineDataModule` passes them, for a
    data config whose target is ``build_datamodule``; None for another target (nothing to prepare)."""
    if data.get("_target_") not in TARGETS:
        return None
    return str(data.get("name", "synthetic")), {k: v for k, v in data.items() if k not in LOADER_KEYS}


def missing_files(data_files: Any) -> list[str]:
    """The local ``data_files`` (paths or glob patterns; URLs are skipped) that name nothing."""
    missing = []
    for f in all_files(normalize_data_files(data_files)):
        if "://" in f:
            continue
        if not (glob.glob(f) if glob.has_magic(f) else Path(f).exists()):
            missing.append(f)
    return missing


def check_data_files(name: str, data_files: Any) -> None:
    """``data.data_files`` names existing local files; else a :class:`DataError` with the fixes."""
    if data_files == "???":  # OmegaConf's missing value: data=text without files
        raise DataError(f"data={name} needs data.data_files: a local text file or a list of them "
                        "(data.data_files=/path/to/corpus.txt), or use data=synthetic")
    missing = missing_files(data_files)
    if not missing:
        return
    shown = ", ".join(repr(str(Path(f).resolve())) if not glob.has_magic(f) else repr(f) for f in missing)
    local = "" if name == "text" else f" (local copies of data={name}'s text)"
    raise DataError(f"data.data_files={data_files}: FileNotFoundError: no such file {shown} (a relative path is "
                      f"read from the working directory {os.getcwd()}). data.data_files must name existing local "
                      f"text/parquet/json/csv files{local}: give their paths (data.data_files=/path/to/corpus.txt or "
                      "a list), or use data=synthetic")


@contextmanager
def _offline_switches_kept() -> Iterator[None]:
    """``data.offline=true`` switches this process's hub access off (:func:`.tokenizer.hub_offline`); the
    launcher's own switches, which the next job of a sweep inherits, are restored afterwards."""
    env = {var: os.environ.get(var) for var in OFFLINE_VARIABLES}
    import datasets.config  # local: datasets ≥0.8 s (not for synthetic data)

    flags = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    try:
        yield
    finally:
        for var, value in env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = flags


def check_options(name: str, arguments: Mapping[str, Any]) -> None:
    """``data.name`` is a source and every other data key is one of its options (``build_source``'s keyword
    arguments and the source's ``SOURCE_DEFAULTS``): else a :class:`ConfigError` naming the key, instead of
    ``build_source``'s ``TypeError``."""
    if name not in factory.SOURCES:
        close = did_you_mean(name, factory.SOURCES)
        raise ConfigError(f"data.name={name}: no such data source; it is one of {list(factory.SOURCES)}: set "
                          f"data={close or '<one of them>'}" + (" (did you mean it?)" if close else ""))
    parameters = inspect.signature(factory.build_source).parameters.values()
    named = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
    known = sorted(named | set(factory.SOURCE_DEFAULTS[name]))
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        key = unknown[0]
        close = did_you_mean(key, known)
        raise ConfigError(f"data.{key}={arguments[key]}: data={name} has no option {key!r}"
                          + (f" (did you mean data.{close}?)" if close else "") + f"; its options are {known}. "
                          f"Fix: remove it (its override, ~data.{key} on the command line, or its line in "
                          f"conf/data/{name}.yaml)"
                          + (f", or set data.{close} instead" if close else ""))


def _cause_chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and, when it is ``datasets``' ``DatasetGenerationError`` (a builder's or a generator's error,
    wrapped), what it wraps; nothing else is looked through (a bug raised while handling another error
    is not that error)."""
    from datasets.exceptions import DatasetGenerationError  # local: datasets ≥0.8 s (not for synthetic data)

    current: BaseException | None = err
    for _ in range(8):
        if current is None:
            return
        yield current
        current = current.__cause__ if isinstance(current, DatasetGenerationError) else None


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What the hub's clients raise for no answer (no network, a refused connection, a timeout) or an
    answer they did not like (not found, gated, unauthorized)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, attr in (("huggingface_hub.errors", "HfHubHTTPError"), ("httpx2", "TransportError"),
                         ("httpx", "TransportError"), ("requests.exceptions", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # a client this version does not use
            pass
    return tuple(found)


def data_failure(name: str, arguments: Mapping[str, Any], err: BaseException) -> DataError | None:
    """What :func:`.factory.build_source` raised, when its data cannot be had, as a :class:`DataError` with the fixes
    for this source; None for anything else (a bug keeps its traceback)."""
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError  # local: datasets ≥0.8 s

    files = "data.data_files=/path/to/corpus.txt (or a list)"
    local = f"a local copy of its text ({files})" if name != "text" else f"other files ({files})"
    for cause in _cause_chain(err):
        if isinstance(cause, (ConfigError, DataUnavailable)):  # already say their cause and fixes
            return cause if isinstance(cause, DataError) else DataError(f"data={name}: {cause}")
        what = f"{type(cause).__name__}: {cause}"
        if isinstance(cause, TimeoutError) and "data.prepare_timeout_s" in str(cause):  # another builder's lock
            return DataError(f"data={name}: {what}")
        if isinstance(cause, DatasetNotFoundError):
            return DataError(f"data={name}: data.path={arguments.get('path')}: {what}. Fixes: data.path=<a hub "
                             f"dataset id or a directory written by save_to_disk>; or {local}; or data=synthetic")
        if isinstance(cause, PermissionError):
            cache = arguments.get("cache_dir")
            in_cache = (cache is not None and cause.filename is not None
                        and str(Path(str(cause.filename)).absolute()).startswith(str(Path(str(cache)).expanduser()
                                                                                     .absolute())))
            where = ("data.cache_dir=<a directory this user can write>" if in_cache else
                     "make the files readable by this user, or point data.data_files at readable copies")
            return DataError(f"data={name}: {what}. Fixes: {where}; or data=synthetic")
        if isinstance(cause, FileNotFoundError):
            hub_path = arguments.get("path") and not arguments.get("data_files")
            path = f" data.path={arguments['path']}:" if hub_path else ""
            return DataError(f"data={name}:{path} {what}. Fixes: {files} naming existing files"
                             + (", or data.path=<an existing directory or a hub dataset id>" if path else "")
                             + "; or data=synthetic")
        if isinstance(cause, _hub_errors()):
            return DataError(f"data={name}: {what}. Fixes: run once with network (and without data.offline) to "
                             f"download it into data.cache_dir; or {local}; or data=synthetic")
        if isinstance(cause, DatasetGenerationError) and cause.__cause__ is None:
            return DataError(f"data={name}: the data files cannot be read: {what}. Fixes: {files} naming "
                             "text/parquet/json/csv files whose contents match their extension; or data=synthetic")
    if isinstance(err, DatasetGenerationError):  # a file the builder cannot parse: the parser's error is the cause
        inner = list(_cause_chain(err))[-1]
        return DataError(f"data={name}: the data files cannot be read: {type(inner).__name__}: {inner}. Fixes: "
                         f"{files} naming text/parquet/json/csv files whose contents match their extension; or "
                         "data=synthetic")
    return None


def check_data(data: Mapping[str, Any]) -> None:
    """What can be told at once about the job's data (``cfg.data``, resolved): its keys are the source's
    options and its local files exist."""
    found = source_arguments(data)
    if found is not None and found[0] != "synthetic":
        check_options(*found)
        check_data_files(found[0], found[1].get("data_files"))


def prepare_data(data: Mapping[str, Any]) -> None:
    """Check the job's data (``cfg.data``, resolved) and prepare it into the node's cache, once, before
    the ranks start; a :class:`DataError` names the cause and the fixes when it cannot be had."""
    found = source_arguments(data)
    if found is None or found[0] == "synthetic":
        return
    name, arguments = found
    check_options(name, arguments)
    check_data_files(name, arguments.get("data_files"))
    with _offline_switches_kept():
        try:
            factory.build_source(name, **arguments)
        except ConfigError:
            raise
        except Exception as err:  # only the data's failures become a DataError; a bug keeps its traceback
            failure = data_failure(name, arguments, err)
            if failure is None:
                raise
            if any(failure is cause for cause in _cause_chain(err)):  # a DataError that datasets wrapped:
                failure = DataError(str(failure))  # raised anew, so that no cause chain loops back to err
            raise failure from err
