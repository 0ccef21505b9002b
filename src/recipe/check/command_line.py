"""``train.py``'s command line: what is checked before Hydra composes the job's config, and what Hydra's own
composition refused, said the project's way.

Hydra composes the config once (``@hydra.main``). Two things must be settled before that
(:func:`before_compose`): ``hydra/launcher=slurm`` needs its plugin (Hydra would fail on launch with "Unknown plugin
class"), and ``strategy=auto`` is replaced by the planner's layout. Where Hydra's composition or its first write
fails, :func:`run_app` says why in one line instead of Hydra's advice or traceback (:func:`explain`):

* a key that no config of the command line has (``model.n_layr=4``): the key it resembles, exit status 2;
* an option of a config group that has no such file (``strategy=dappel``): the options and the closest, exit 2;
* a job directory that cannot be created or written (``hydra.run.dir``, or ``hydra.sweep.dir`` with ``-m``): why,
  and a directory that can (exit 2), or that its disk is full (exit 1).

Only that explanation composes the config again, through Hydra's public compose API. Everything else before
launch is :func:`pipeline_recipes.recipe.check.command.check_command`, on the config Hydra composed.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline_recipes.core import exits
from pipeline_recipes.core.disk import NO_SPACE_ERRNOS, no_space, no_space_message
from pipeline_recipes.core.errors import did_you_mean

AUTO = "strategy=auto"
MULTIRUN_FLAGS = ("-m", "--multirun")
SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")  # conf/hydra/launcher/slurm.yaml and the plugin's
INSPECTING = ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help")  # Hydra shows, runs nothing


def before_compose(argv: list[str], conf_dir: Path) -> list[str]:
    """The command line as Hydra is to compose it: the launcher's plugin checked (and registered), then
    ``strategy=auto`` replaced by the planner's layout."""
    check_launcher_plugin(argv)
    return resolve_auto_strategy(argv, conf_dir)


def resolve_auto_strategy(argv: list[str], conf_dir: Path) -> list[str]:
    """``strategy=auto``: the planner profiles the model (cached), predicts every layout of the configured
    devices and global batch (Chimera §3.4) and puts its best one in place."""
    if AUTO not in argv:
        return argv
    if any(flag in argv for flag in MULTIRUN_FLAGS):
        print("error: strategy=auto picks one layout; it cannot be part of a -m sweep", file=sys.stderr)
        sys.exit(exits.REFUSED)
    from pipeline_recipes.recipe.check.auto import auto_overrides  # local: the planner and torch, for auto only

    config_overrides = [a for a in argv if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
    others = [a for a in argv if a not in config_overrides]
    return others + auto_overrides(config_overrides, conf_dir, log=print)


def check_launcher_plugin(argv: list[str]) -> None:
    """``hydra/launcher=slurm`` needs Hydra's submitit plugin and Hydra's multirun mode; with both, the preset's
    launcher (:mod:`hydra_plugins.pipeline_recipes_slurm.launcher`) is registered with Hydra."""
    chosen = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "hydra/launcher"]
    if not chosen or chosen[-1] not in SUBMITIT_LAUNCHERS or any(a in INSPECTING for a in argv):
        return  # --cfg hydra shows it without a run
    if not any(flag in argv for flag in MULTIRUN_FLAGS):  # Hydra uses a launcher in multirun mode only
        print(f"error: hydra/launcher={chosen[-1]} submits jobs in Hydra's multirun mode only; add -m (one job is a "
              "sweep of one), otherwise the job would run here", file=sys.stderr)
        sys.exit(exits.REFUSED)
    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        print(f"error: hydra/launcher={chosen[-1]} needs Hydra's submitit launcher plugin, which is not installed; "
              'pip install -e ".[slurm]" (hydra-submitit-launcher)', file=sys.stderr)
        sys.exit(exits.REFUSED)
    from hydra.core.plugins import Plugins
    from hydra_plugins.pipeline_recipes_slurm.launcher import SlurmLauncher

    Plugins.instance().register(SlurmLauncher)  # an editable install's hydra_plugins package is not scanned by Hydra


def run_app(app: Callable[[], Any], argv: list[str], conf_dir: Path) -> None:
    """Run Hydra's app ``app`` (``@hydra.main``); a composition or job-directory error it raises is said in one
    line with its exit status (:func:`explain`), any other error as Hydra says it. Hydra's own report is turned
    off (``HYDRA_FULL_ERROR``) so that the error reaches here."""
    asked_full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except (HydraException, OmegaConfBaseException, OSError) as err:
        explained = explain(err, argv, conf_dir)
        if explained is None:
            if asked_full or not isinstance(err, (HydraException, OmegaConfBaseException)):
                raise
            print(str(err), file=sys.stderr)  # Hydra's compact report of its own errors
            if isinstance(err.__cause__, OmegaConfBaseException):
                print(str(err.__cause__), file=sys.stderr)
            sys.exit(exits.FAILED)
        message, code = explained
        print(f"error: {message}", file=sys.stderr)
        sys.exit(code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # Hydra's parser already accepted the command line
        raise ValueError(message)


def parse_command_line(argv: Sequence[str]) -> argparse.Namespace:
    """``train.py``'s arguments as Hydra reads them: its config options, ``-m`` and the overrides."""
    parser = _Parser(add_help=False)
    for short, long in (("-cp", "--config-path"), ("-cn", "--config-name"), ("-cd", "--config-dir"),
                        ("-c", "--cfg"), ("-p", "--package"), ("-sc", "--shell-completion")):
        parser.add_argument(short, long)
    parser.add_argument("-i", "--info", nargs="?", const="all")
    for short, long in (("-m", "--multirun"), ("-h", "--help"), ("-r", "--run"), ("", "--hydra-help"),
                        ("", "--resolve"), ("", "--version")):
        parser.add_argument(*[a for a in (short, long) if a], action="store_true")
    parser.add_argument("--experimental-rerun")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(list(argv))


def explain(err: BaseException, argv: Sequence[str], conf_dir: Path) -> tuple[str, int] | None:
    """The one line and exit status for what Hydra refused (see the module docstring), or None where it is
    none of those. Composes the command's config again (each sweep at its first value, then each option of a
    swept config group) to find the key or option at fault."""
    try:
        args = parse_command_line(argv)
    except ValueError:
        return None
    base, sweeps = _probe(OverridesParser.create().parse_overrides(args.overrides))
    if isinstance(err, OSError) and not isinstance(err, HydraException):  # Hydra's missing config is an OSError too
        return _job_dir_refusal(err, args, base, conf_dir)
    try:
        cfg, message = _compose_or_explain(args, base, conf_dir)
        if cfg is None:
            return message, exits.REFUSED
        groups = set(OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {})
        for index, values in sweeps:  # an option of a swept config group decides which keys exist
            if base[index][1].key_or_group not in groups:
                continue
            for value in values[1:]:
                probe = [*base[:index], (f"{base[index][1].get_key_element()}={value}", base[index][1]),
                         *base[index + 1:]]
                cfg, message = _compose_or_explain(args, probe, conf_dir)
                if cfg is None:
                    return message, exits.REFUSED
    except (HydraException, OmegaConfBaseException):
        return None
    return None


def compose_command(args: argparse.Namespace, overrides: list[str], conf_dir: Path) -> DictConfig:
    """The config of ``overrides`` with its ``hydra`` node, composed as ``train.py`` composes it (its config
    directory, or ``--config-dir`` with the project's ``conf/`` after it, and ``--config-name``)."""
    primary = Path(args.config_dir) if args.config_dir else conf_dir.parent / (args.config_path or conf_dir.name)
    extra = [f"hydra.searchpath=[file://{conf_dir.resolve()}]"] if args.config_dir else []
    GlobalHydra.instance().clear()  # Hydra's app that failed left its instance
    with initialize_config_dir(config_dir=str(primary.resolve()), version_base="1.3", job_name="train"):
        return compose(args.config_name or "config", overrides=[*extra, *overrides], return_hydra_config=True)


def _probe(overrides: list[Any]) -> tuple[list[tuple[str, Any]], list[tuple[int, list[str]]]]:
    """The overrides to compose, as (line to compose, the override), each sweep at its first value, and the
    sweeps (index, values)."""
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


def _compose_or_explain(args: argparse.Namespace, probe: list[tuple[str, Any]],
                        conf_dir: Path) -> tuple[DictConfig | None, str | None]:
    """The composed config, or None and the message for the first override of a key it lacks or of a group
    option that does not exist; any other composition error is raised."""
    lines = [line for line, _ in probe]
    try:
        return compose_command(args, lines, conf_dir), None
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
    cfg = compose_command(args, [x for x in lines if x != line], conf_dir)
    return None, unknown_key_message(cfg, override.key_or_group, override.input_line)


def unknown_key_message(cfg: DictConfig, key: str, line: str) -> str | None:
    """The project's message for an override of a key the composed ``cfg`` lacks, or None (no key is
    missing, or its parent is not a mapping: Hydra's own message then)."""
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
        where = f"a top-level setting of {OmegaConf.select(cfg, 'hydra.job.config_name', default='config')}.yaml"
    elif group is not None:
        where = f"a setting of {group}={choices[group]}" + (f" (under {parent})" if parent != group else "")
    else:
        where = f"a setting of {parent}"
    known = [str(k) for k in node.keys() if not str(k).startswith("_") and (parent or str(k) != "hydra")]
    close = did_you_mean(part, known)
    hint = f"did you mean {close!r}?" if close else f"its keys are {', '.join(known)}"
    return f"{key} is not {where}; {hint} (to add a new key on purpose, write +{line})"


def _job_dir_refusal(err: OSError, args: argparse.Namespace, base: list[tuple[str, Any]],
                     conf_dir: Path) -> tuple[str, int] | None:
    """Hydra could not create or write the job directory: why, and a directory that can be written (exit 2),
    or that its disk is full (exit 1). None where the error is not about that directory."""
    key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    try:
        out = OmegaConf.select(compose_command(args, [line for line, _ in base], conf_dir), key)
    except Exception:  # noqa: BLE001 - an interpolation only Hydra's run resolves: nothing to add to its error
        return None
    if not out or not _names_path(err, Path(out)):
        return None
    why = unwritable_reason(out)
    if why is None:
        if no_space(err, out):
            return no_space_message(out, f"cannot write the job directory ({key})"), exits.FAILED
        return None
    instead = writable_instead(out)
    fix = f"{key}={instead} (a directory this user can write)" if instead else f"{key} to a directory you can write"
    return f"{key} = {out}: the job directory cannot be created or written: {why}; set {fix}", exits.REFUSED


def _names_path(err: OSError, out: Path) -> bool:
    """Whether ``err`` may be about ``out``: it names ``out``, a directory above it or a file in it, or no file
    (a write that failed for want of space names none)."""
    named = [Path(str(f)).absolute() for f in (err.filename, err.filename2) if f]
    out = out.absolute()
    return not named or any(p == out or out in p.parents or p in out.parents for p in named)


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the directory ``path`` cannot be created and written, naming the directory at fault (``path`` or its
    nearest existing ancestor): not a directory, not writable by this user, or on a read-only file system
    (found by creating and removing a file there, since root ignores permission bits); None where it can, or
    where only space is missing."""
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
    given = Path(path)
    name = given.name or "job"
    relative = given if not given.is_absolute() and ".." not in given.parts else Path(name)
    for candidate in (Path.cwd() / "outputs" / name, Path(tempfile.gettempdir()) / relative):
        if unwritable_reason(candidate) is None:
            return candidate
    return None
