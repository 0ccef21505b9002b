"""Train a model with a pipeline schedule: ``python train.py strategy=chimera model=gpt2 trainer.devices=8``.

Hydra composes ``conf/``; :func:`recipe.launch.run` derives and checks the layout (W, D, B, N)
before any process starts, starts fresh worker processes for the job (or joins torchrun/SLURM),
and writes ``results.json`` next to the logs. Sweeps work the same way:
``python train.py -m strategy=gpipe,dapple,chimera strategy.D=2,4 trainer.devices=4``.
A misspelled key (``model.n_layr=4``) is refused before Hydra runs, with the key it resembles.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a stop signal during the imports and checks below is a clean stop, not a death
    from pipeline_recipes.core.signals import install_early

    install_early()

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import pipeline_recipes.recipe  # noqa: F401 - registers the config's resolvers (recipe/check/resolvers.py)

AUTO = "strategy=auto"
CONFIG_PATH, CONFIG_NAME = "conf", "config"  # as in @hydra.main below


def resolve_auto_strategy(argv: list[str]) -> list[str]:
    """``strategy=auto``: the planner profiles the model (cached), predicts every layout of the
    configured devices and global batch (Chimera §3.4) and puts its best one in place."""
    if AUTO not in argv:
        return argv
    if "-m" in argv or "--multirun" in argv:
        sys.exit("error: strategy=auto picks one layout; it cannot be part of a -m sweep")
    from pipeline_recipes.recipe.check.auto import auto_overrides

    config_overrides = [a for a in argv if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
    others = [a for a in argv if a not in config_overrides]
    chosen = auto_overrides(config_overrides, Path(__file__).parent / "conf", log=print)
    return others + chosen


SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")  # conf/hydra/launcher/slurm.yaml and the plugin's


def check_launcher_plugin(argv: list[str]) -> None:
    """``hydra/launcher=slurm`` needs Hydra's submitit plugin; without it Hydra composes the preset
    and then fails on launch with "Unknown plugin class", so say what to install instead. With it, the
    preset's launcher (:mod:`hydra_plugins.pipeline_recipes_slurm.launcher`) is registered with Hydra."""
    chosen = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "hydra/launcher"]
    inspecting = any(a in ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help") for a in argv)
    if not chosen or chosen[-1] not in SUBMITIT_LAUNCHERS or inspecting:  # --cfg hydra shows it without a run
        return
    if "-m" not in argv and "--multirun" not in argv:  # Hydra uses a launcher in multirun mode only
        print(f"error: hydra/launcher={chosen[-1]} submits jobs in Hydra's multirun mode only; add -m (one job is a "
              "sweep of one), otherwise the job would run here", file=sys.stderr)
        sys.exit(2)
    import importlib.util

    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        print(f"error: hydra/launcher={chosen[-1]} needs Hydra's submitit launcher plugin, which is not installed; "
              'pip install -e ".[slurm]" (hydra-submitit-launcher)', file=sys.stderr)
        sys.exit(2)
    from hydra.core.plugins import Plugins
    from hydra_plugins.pipeline_recipes_slurm.launcher import SlurmLauncher

    Plugins.instance().register(SlurmLauncher)  # an editable install's hydra_plugins package is not scanned by Hydra


def _compose(args: Any, overrides: list[str]) -> DictConfig:
    """The job's config as Hydra composes it for ``train.py`` (same search path, ``--config-dir``,
    ``--config-path`` and ``--config-name``), with the ``hydra`` node."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    search_path = create_automatic_config_search_path(str(Path(__file__).resolve()), None,
                                                      args.config_path or CONFIG_PATH)
    if args.config_dir is not None:
        search_path.prepend("command-line", f"file://{os.path.abspath(args.config_dir)}", SearchPathQuery("schema"))
    loader = Hydra.create_main_hydra2(task_name=Path(__file__).stem, config_search_path=search_path)
    try:
        return loader.compose_config(args.config_name or CONFIG_NAME, overrides, run_mode=RunMode.RUN)
    finally:
        GlobalHydra.instance().clear()


def _probe(overrides: list[Any]) -> tuple[list[tuple[str, Any]], list[tuple[int, list[str]]]]:
    """The overrides to compose, as (line to compose, the override), each sweep at its first value, and the
    sweeps (index, values). ``strategy=auto`` is the planner's, not a config option."""
    base: list[tuple[str, Any]] = []
    sweeps: list[tuple[int, list[str]]] = []
    for o in overrides:
        if o.input_line == AUTO or o.value_type is not None and o.value_type.name == "GLOB_CHOICE_SWEEP":
            continue
        if o.is_sweep_override():
            values = [str(v) for v in o.sweep_string_iterator()]
            sweeps.append((len(base), values))
            base.append((f"{o.get_key_element()}={values[0]}", o))
        else:
            base.append((o.input_line, o))
    return base, sweeps


def unknown_key_message(cfg: DictConfig, key: str, line: str) -> str | None:
    """The project's message for an override of a key the composed ``cfg`` lacks, or None (no key is
    missing, or its parent is not a mapping: Hydra's own message then)."""
    from pipeline_recipes.core.errors import did_you_mean

    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        if not OmegaConf.is_dict(node):
            return None
        if part not in node:
            break
        node = node[part]
    else:
        return None
    parent = ".".join(parts[:depth])
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {}
    group = parts[0] if depth and parts[0] in choices else None
    if not parent:
        where = f"a top-level setting of {OmegaConf.select(cfg, 'hydra.job.config_name', default=CONFIG_NAME)}.yaml"
    elif group is not None:
        where = f"a setting of {group}={choices[group]}" + (f" (under {parent})" if parent != group else "")
    else:
        where = f"a setting of {parent}"
    known = [str(k) for k in node.keys() if not str(k).startswith("_") and (parent or str(k) != "hydra")]
    close = did_you_mean(part, known)
    hint = f"did you mean {close!r}?" if close else f"its keys are {', '.join(known)}"
    return f"{key} is not {where}; {hint} (to add a new key on purpose, write +{line})"


def check_setting_keys(argv: list[str]) -> DictConfig | None:
    """A key that no config of the command line has (``model.n_layr=4``, a misspelling of ``n_layer``)
    stops with the key it resembles and exit status 2, instead of Hydra's advice to append it: every
    override is tried against the composed config first (each option of a swept config group too).
    Anything else that fails to compose is left to Hydra's own message. Returns the composed config (each
    sweep at its first value, with the ``hydra`` node), or None."""
    try:
        message, cfg = _unknown_key(argv)
    except (Exception, SystemExit):  # a command line Hydra itself refuses: its own message follows
        return None
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    return cfg


def check_output_space(cfg: DictConfig | None, argv: list[str]) -> None:
    """The job's output directory (``hydra.run.dir``, or ``hydra.sweep.dir`` with ``-m``) is on a file system
    with space left (else exit status 1) and can be created and written (else exit status 2, refused with a
    directory that can): Hydra writes its ``.hydra`` files there before any of ours, and would fail in a
    traceback."""
    from hydra.core.utils import setup_globals

    from pipeline_recipes.core import exits
    from pipeline_recipes.core.disk import LOW_SPACE_BYTES, free_bytes, no_space_message

    if cfg is None:
        return
    key = "hydra.sweep.dir" if "-m" in argv or "--multirun" in argv else "hydra.run.dir"
    setup_globals()  # Hydra's resolvers (${now:...} of the default directories), as its run registers them
    try:
        out = OmegaConf.select(cfg, key)
    except Exception:  # an interpolation only Hydra's run resolves: it checks its own directory then
        return
    if not out:
        return
    why = unwritable_reason(out)
    if why is not None:
        instead = writable_instead(out)
        fix = f"{key}={instead} (a directory this user can write)" if instead else f"{key} to a directory you can write"
        print(f"error: {key} = {out}: the job directory cannot be created or written: {why}; set {fix}",
              file=sys.stderr)
        sys.exit(exits.REFUSED)
    free = free_bytes(out)
    if free is not None and free < LOW_SPACE_BYTES:
        print(f"error: {no_space_message(out, f'cannot write the job directory ({key})')}", file=sys.stderr)
        sys.exit(exits.FAILED)


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the directory ``path`` cannot be created and written, naming the directory at fault (``path`` or its
    nearest existing ancestor): not a directory, not writable by this user, or on a read-only file system
    (found by creating and removing a file there, since root ignores permission bits); None where it can, or
    where only space is missing (:func:`check_output_space` says so)."""
    import errno
    import tempfile

    from pipeline_recipes.core.disk import NO_SPACE_ERRNOS

    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        if err.errno in NO_SPACE_ERRNOS:
            return None
        if err.errno == errno.EROFS:
            return f"{existing} is on a read-only file system"
        if err.errno in (errno.EACCES, errno.EPERM):
            return f"{existing} is not writable by this user (permission denied)"
        return f"{existing} cannot be written ({err.strerror or err})"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user (its permissions)"
    return None


def writable_instead(path: str | os.PathLike[str]) -> Path | None:
    """A directory of the same name that can be created and written (under ``outputs/`` of the working
    directory, else the temporary directory, with the same relative path there), or None."""
    import tempfile

    given = Path(path)
    name = given.name or "job"
    relative = given if not given.is_absolute() and ".." not in given.parts else Path(name)
    for candidate in (Path.cwd() / "outputs" / name, Path(tempfile.gettempdir()) / relative):
        if unwritable_reason(candidate) is None:
            return candidate
    return None


def _unknown_key(argv: list[str]) -> tuple[str | None, DictConfig | None]:
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with contextlib.redirect_stderr(io.StringIO()):
        args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info is not None or args.shell_completion:
        return None, None
    base, sweeps = _probe(OverridesParser.create().parse_overrides(args.overrides))
    cfg, message = _compose_or_explain(args, base)
    if cfg is None:
        return message, None
    composed = cfg
    groups = set(OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {})
    for index, values in sweeps:  # an option of a swept config group decides which keys exist
        if base[index][1].key_or_group not in groups:
            continue
        for value in values[1:]:
            probe = [*base[:index], (f"{base[index][1].get_key_element()}={value}", base[index][1]), *base[index + 1:]]
            cfg, message = _compose_or_explain(args, probe)
            if cfg is None:
                return message, None
    return None, composed


def _compose_or_explain(args: Any, probe: list[tuple[str, Any]]) -> tuple[DictConfig | None, str | None]:
    """The composed config, or None and the message for the first override of a key it lacks; any
    other composition error is raised."""
    from hydra.errors import ConfigCompositionException, MissingConfigException

    from pipeline_recipes.core.errors import did_you_mean

    lines = [line for line, _ in probe]
    try:
        return _compose(args, lines), None
    except MissingConfigException as err:  # an option of a config group that has no such file
        group, _, value = str(err.missing_cfg_file or "").rpartition("/")
        options = sorted(err.options or ())
        if not group or not options:
            raise
        close = did_you_mean(value, options)
        return None, (f"{group}={value}: config group '{group}' has no option {value!r}; choose one of "
                      f"{', '.join(options)}" + (f"; did you mean {group}={close}?" if close else ""))
    except ConfigCompositionException as err:
        failed = [(line, o) for line, o in probe if str(err).startswith(f"Could not override '{o.key_or_group}'.")]
        if not failed:
            raise
    line, override = failed[0]
    cfg = _compose(args, [x for x in lines if x != line])
    return None, unknown_key_message(cfg, override.key_or_group, override.input_line)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    from pipeline_recipes.recipe.launch.main import run

    return run(cfg)


if __name__ == "__main__":
    check_launcher_plugin(sys.argv[1:])
    composed = check_setting_keys(sys.argv[1:])
    check_output_space(composed, sys.argv[1:])
    sys.argv[1:] = resolve_auto_strategy(sys.argv[1:])
    main()
