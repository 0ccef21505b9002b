"""Every check of a job before any process starts, from one entry point in one order, and the fixes its refusals
propose.

The order, from ``python train.py`` to the launch:

1. before Hydra composes the config (:func:`~pipeline_recipes.recipe.check.command_line.before_compose`): the
   cluster launcher's plugin, then ``strategy=auto`` replaced by the planner's layout;
2. Hydra's composition, once; what it refuses (a misspelled key or group option, a job directory that cannot be
   written) is said in one line (:func:`~pipeline_recipes.recipe.check.command_line.run_app`);
3. :func:`check_command`, on the composed config, which :func:`pipeline_recipes.recipe.launch.main.run` runs before
   it launches anything (and the tests run in-process): the space left in the job directory, the fixed sets of
   values, the data's files, the accelerator, the layout, the model's shapes, the tokenizer, the GPUs of the
   node, the precision, the logger, the cluster's launcher and the memory pre-flight; then, holding the job
   directory (a requeued job waits there for its previous run), the checkpoint to resume
   (:mod:`~pipeline_recipes.recipe.check.resume`).

A refusal (:class:`~pipeline_recipes.core.fixes.ConfigError`) comes back with the fixes it proposes that pass
every one of these checks: each candidate is applied to the command (:class:`Command`: its overrides, composed as
Hydra composes them) and checked again, so a suggestion never names a value that another rule refuses
(:func:`~pipeline_recipes.core.fixes.vet`). One exception: the fixes of a refusal that comes before the memory
pre-flight are checked without it, which needs torch (a layout error stays a fraction of a second and imports
neither torch nor the data modules); the pre-flight's own fixes are checked by all.
"""

from __future__ import annotations

import copy
import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pipeline_recipes.recipe.check.accelerator import (
    GPU_NAMES, AcceleratorChoice, NodeDevices, check_precision, choose_accelerator, layout_processes, probe_node,
    resolve_loader, with_compile,
)
from pipeline_recipes.recipe.check.launch_mode import Launch, detect_launch
from pipeline_recipes.core.disk import LOW_SPACE_BYTES, free_bytes
from pipeline_recipes.core.fixes import ConfigError, Fix, values, vet
from pipeline_recipes.recipe.check.logger import check_logger
from pipeline_recipes.recipe.check.resume import Resume, resolve_resume
from pipeline_recipes.recipe.check.settings import (
    Layout, check_devices, check_model, check_settings, layers_key, num_layers, refuses,
    resolve_layout,
)

PREFLIGHT_MODES = (True, False, "report")  # preflight=true | false | report


@dataclass
class Checked:
    """What the checks found, filled in as they pass: the launcher names the accelerator once it is chosen,
    also when a later check refuses the job."""

    mode: Any = True  # preflight: true, false or report
    memory: bool = False  # the memory pre-flight has started (every check before it passed)
    choice: AcceleratorChoice | None = None
    layout_inputs: tuple | None = None  # resolve_layout's arguments, once the trainer is concrete
    layout: Layout | None = None
    launch: Launch | None = None
    report: dict[str, Any] | None = None  # preflight=report: the prediction
    resume: Resume | None = None  # the checkpoint to resume, once the job directory is held


@dataclass(frozen=True)
class Command:
    """A job's command line: its overrides (Hydra's task overrides) and how its config is composed from them.
    ``compose`` takes the overrides of config groups (``strategy=chimera``; ``groups`` names the groups) and
    returns that config (None where it cannot); :meth:`config` sets the other overrides on a copy, as Hydra
    does."""

    overrides: tuple[str, ...]
    compose: Callable[[tuple[str, ...]], DictConfig | None]
    groups: frozenset[str]

    def with_fix(self, fix: Mapping[str, str]) -> Command:
        """The command with ``fix``'s overrides in place of those of the same keys (a ``+`` kept), the others
        added at the end."""
        out, done = [], set()
        for line, override in zip(self.overrides, _parse(self.overrides)):
            key = override.key_or_group
            if key in fix and not override.is_delete():
                prefix = "++" if override.is_force_add() else "+" if override.is_add() else ""
                out.append(f"{prefix}{key}={fix[key]}")
                done.add(key)
            else:
                out.append(line)
        out += [f"{key}={value}" for key, value in fix.items() if key not in done]
        return replace(self, overrides=tuple(out))

    def config(self) -> DictConfig | None:
        """The command's config, or None where Hydra would refuse it (an override of a key it lacks, a group
        option that does not exist)."""
        parsed = _parse(self.overrides)
        chosen = tuple(line for line, o in zip(self.overrides, parsed) if o.key_or_group in self.groups)
        try:
            base = self.compose(chosen)
            if base is None:
                return None
            cfg = copy.deepcopy(base)
            set_overrides([o for o in parsed if o.key_or_group not in self.groups], cfg)
        except (HydraException, OmegaConfBaseException):
            return None
        return cfg

    def node(self, key: str) -> dict[str, Any] | None:
        """The resolved node ``key`` of the command's config (its option of the group and the overrides under
        it), composed without copying the rest; None where it cannot tell (an interpolation out of the node).
        Read only: the same dict serves every command with the same choices and overrides of the node."""
        parsed = _parse(self.overrides)
        chosen = tuple(line for line, o in zip(self.overrides, parsed) if o.key_or_group in self.groups)
        lines = tuple(line for line, o in zip(self.overrides, parsed) if o.key_or_group.startswith(f"{key}."))
        return _node(self.compose, chosen, lines, key)

    @classmethod
    def of(cls, cfg: DictConfig) -> Command:
        """A config whose command line is not known: its own settings can change, its config groups cannot."""
        snapshot = copy.deepcopy(cfg)
        groups = frozenset(str(k) for k in cfg if OmegaConf.is_dict(cfg[k]))
        return cls((), lambda chosen: None if chosen else snapshot, groups)


@lru_cache(maxsize=256)
def _unresolved(compose: Callable[[tuple[str, ...]], DictConfig | None], chosen: tuple[str, ...],
                key: str) -> dict[str, Any] | None:
    """Node ``key`` of the config of these group choices, interpolations kept (read only)."""
    base = compose(chosen)
    return None if base is None or key not in base else OmegaConf.to_container(base[key], resolve=False)


@lru_cache(maxsize=16384)
def _node(compose: Callable[[tuple[str, ...]], DictConfig | None], chosen: tuple[str, ...], lines: tuple[str, ...],
          key: str) -> dict[str, Any] | None:
    """:meth:`Command.node`: node ``key`` of these group choices with the override ``lines`` under it set."""
    try:
        base = _unresolved(compose, chosen, key)
        if base is None:
            return None
        part = OmegaConf.create({key: copy.deepcopy(base)})
        OmegaConf.set_struct(part, True)
        set_overrides(_parse(lines), part)
        return OmegaConf.to_container(part[key], resolve=True)
    except (HydraException, OmegaConfBaseException):
        return None


def set_overrides(overrides: list[Any], cfg: DictConfig) -> None:
    """Set Hydra's overrides of settings (not of config groups) on ``cfg`` as Hydra's composition sets them, with
    OmegaConf's public API: ``key=value`` (the key must exist), ``+key=value`` (it must not, unless the value is a
    mapping or list), ``++key=value`` (either way), ``~key`` (removed). A refused one raises ``HydraException``."""
    for override in overrides:
        key, value = override.key_or_group, override.value()
        try:
            if override.is_delete():
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if OmegaConf.select(cfg, key, throw_on_missing=False) is None:
                    raise HydraException(f"Could not delete from config. '{key}' does not exist.")
                with open_dict(cfg):
                    del node[leaf]
            elif override.is_add() and OmegaConf.select(cfg, key, throw_on_missing=False) is not None \
                    and not isinstance(value, (dict, list)):
                raise HydraException(f"Could not append to config. An item is already at '{key}'.")
            else:
                OmegaConf.update(cfg, key, value, merge=True, force_add=override.is_add() or override.is_force_add())
        except OmegaConfBaseException as err:
            raise HydraException(f"Could not override '{key}'.") from err


def _parse(overrides: tuple[str, ...]) -> list[Any]:
    """The overrides as Hydra parses them."""
    return [_parse_one(line) for line in overrides]


@lru_cache(maxsize=4096)
def _parse_one(line: str) -> Any:
    """One override as Hydra parses it (read only: the same object serves every command that has the line)."""
    return OverridesParser.create().parse_override(line)


def hydra_command() -> Command:
    """The running Hydra job's command: its task overrides, composed with Hydra's compose API in the app's
    own search path (each choice of config groups once)."""
    hydra_cfg = HydraConfig.get()
    name = hydra_cfg.job.config_name

    @lru_cache(maxsize=64)
    def composed(chosen: tuple[str, ...]) -> DictConfig:
        return compose(config_name=name, overrides=list(chosen))

    return Command(tuple(hydra_cfg.overrides.task), composed, frozenset(hydra_cfg.runtime.choices))


class NodeProbe:
    """What this node offers, probed once per question (:func:`probe_node`: torch only when CUDA is asked about);
    a given :class:`NodeDevices` answers every question (a test's fake node)."""

    def __init__(self, node: NodeDevices | None = None) -> None:
        self.node = node
        self.probed: dict[bool, NodeDevices] = {}

    def __call__(self, cuda: bool) -> NodeDevices:
        if self.node is not None:
            return self.node
        if cuda not in self.probed:
            self.probed[cuda] = probe_node(cuda=cuda)
        return self.probed[cuda]


def node_gpus(choice: AcceleratorChoice) -> int | None:
    """GPUs of this node when the job runs one process per GPU (probed by the accelerator's choice)."""
    return choice.node.cuda_devices if choice.accelerator in GPU_NAMES and not choice.shared_gpus else None


@dataclass(frozen=True)
class _Options:
    """How :func:`check_command` runs: the node, the environment, whether it prepares data, the memory budget
    (None: the accelerator's), whether a refusal proposes layouts of its own (the pre-flight's search) and
    whether the memory pre-flight runs at all (``preflight`` as set)."""

    nodes: NodeProbe
    env: Mapping[str, str]
    prepare: bool = True
    budget_bytes: int | None = None
    suggest: bool = True
    memory: bool = True
    checked: Checked = field(default_factory=Checked)


def check_command(cfg: DictConfig, found: Checked | None = None, *, command: Command | None = None,
                  node: NodeDevices | NodeProbe | None = None, env: Mapping[str, str] | None = None,
                  prepare: bool = True, budget_bytes: int | None = None, vet_fixes: bool = True,
                  job_dir: Path | None = None, hold: Callable[[], None] | None = None) -> Layout:
    """Check the job of ``cfg`` before launch and return its layout; ``cfg`` becomes the job's config (the
    concrete trainer, the data loader's settings). ``found`` is filled in as the checks pass. A refusal
    raises a :class:`ConfigError` (or the pre-flight's error) whose fixes, each applied to ``command`` (default:
    ``cfg``'s own settings), pass every check here (``vet_fixes``).

    ``node``: what the node offers (default: probed); ``env``: the environment (default ``os.environ``);
    ``prepare``: prepare a real corpus on the node before the pre-flight, as the launcher does; ``budget_bytes``:
    the memory budget of the pre-flight (default: the accelerator's, else measured).

    ``job_dir``: the job's directory, whose disk must have space left (else :class:`JobDirFull`);
    after every other check, global rank 0 calls ``hold`` (taking the directory for this job) and the checkpoint
    to resume is found there (``found.resume``; ``cfg.ckpt_path`` becomes its path, or null)."""
    probe = node if isinstance(node, NodeProbe) else NodeProbe(node)
    options = _Options(probe, os.environ if env is None else env, prepare, budget_bytes,
                       checked=found if found is not None else Checked())
    original = None if command is not None or not vet_fixes else Command.of(cfg)
    if job_dir is not None:
        check_space(job_dir)
    try:
        layout = _checks(cfg, options)
    except ConfigError as err:
        if not vet_fixes:
            raise
        command = command or original
        checked = replace(options.checked,
                          layout_inputs=options.checked.layout_inputs or _layout_inputs(command, options.nodes))
        passes = partial(_passes, command, replace(options, prepare=False, suggest=False, checked=checked,
                                                   memory=options.checked.memory))
        raise vet(err, passes) from err.__cause__
    if job_dir is not None:
        _hold_and_resume(cfg, job_dir, layout, options.checked, hold)
    return layout


class JobDirFull(OSError):
    """The job directory's disk has too little space left for the job's files (errno ``ENOSPC``)."""


def check_space(job_dir: Path) -> None:
    """The job directory's disk has space left for the job's files (:data:`LOW_SPACE_BYTES`)."""
    free = free_bytes(job_dir)
    if free is not None and free < LOW_SPACE_BYTES:
        raise JobDirFull(errno.ENOSPC, os.strerror(errno.ENOSPC), str(job_dir))


def _hold_and_resume(cfg: DictConfig, job_dir: Path, layout: Layout, found: Checked,
                     hold: Callable[[], None] | None) -> None:
    """Hold the job directory (global rank 0), then find and check the checkpoint to resume there."""
    if hold is not None and found.launch is not None and found.launch.is_global_zero:
        hold()  # one job per directory; a requeued job waits for its previous run
    found.resume = resolve_resume(cfg, job_dir, layout.strategy)  # ckpt_path=auto found; complete, fits, same model
    with open_dict(cfg):
        cfg.ckpt_path = found.resume.path  # what the workers resume from (job.yaml), or null


def _layout_inputs(command: Command, probe: NodeProbe) -> tuple | None:
    """The layout's settings of ``command`` (:func:`resolve_layout`'s arguments, the trainer as the accelerator
    makes it concrete) where a check before the layout's refused it; None where they cannot be had."""
    cfg = command.config()
    if cfg is None:
        return None
    try:
        return _inputs(cfg, choose_accelerator(OmegaConf.to_container(cfg.trainer, resolve=True), None, probe).trainer)
    except (ValueError, TypeError):
        return None


def _inputs(cfg: DictConfig, trainer: dict[str, Any]) -> tuple:
    model = OmegaConf.to_container(cfg.model, resolve=True)
    return (OmegaConf.to_container(cfg.strategy, resolve=True), dict(trainer), cfg.data.global_batch_size,
            num_layers(model), layers_key(model))


def _passes(command: Command, options: _Options, fix: Fix) -> ValueError | None:
    """The refusal of ``command`` with ``fix`` applied by any check (the pre-flight too, where it runs); None
    where it passes. A fix that breaks the layout's own rules fails at once (the command's checks include them)."""
    fixed = command.with_fix(fix)
    inputs = options.checked.layout_inputs
    if inputs is not None and (refusal := _breaks_layout(fixed, inputs, fix)) is not None:
        return refusal
    cfg = fixed.config()
    if cfg is None:
        return ValueError(f"{fix} does not compose with {' '.join(command.overrides)}")
    try:
        _checks(cfg, replace(options, checked=Checked()))
    except ValueError as err:
        return err
    except Exception as err:  # a candidate no check foresaw: it does not pass (the refusal is still shown)
        return ValueError(f"{fix}: {type(err).__name__}: {err}")
    return None


def _breaks_layout(command: Command, inputs: tuple, fix: Fix) -> ConfigError | None:
    """The refusal of the fixed ``command`` by the layout's rules, when sure (then it fails every check at once):
    its strategy node, with the other settings of the layout (``inputs``, the trainer as the accelerator made it
    concrete) as ``fix`` sets them; None where they pass or that cannot be told without the whole check."""
    if not any(k in ("strategy", "strategy.schedule", "strategy.name") for k in fix):
        return refuses(inputs, fix)  # the strategy's other settings are set on it as they are
    strategy = command.node("strategy")  # another option of the group: composed (strategy.name follows it)
    if strategy is None:
        return None
    return refuses((strategy, *inputs[1:]), {k: v for k, v in fix.items() if not k.startswith("strategy")})


def _checks(cfg: DictConfig, options: _Options) -> Layout:
    """The checks in the launcher's order (:func:`check_command`)."""
    found = options.checked
    check_settings(cfg)  # the schema (grad_sync=eagr, trainer.max_steps=-5, …): one message, not a rank's traceback
    mode = found.mode = cfg.get("preflight", True)
    if mode not in PREFLIGHT_MODES:
        raise ConfigError(f"preflight = {mode!r}: it is true (predict the peak memory per rank and refuse a layout "
                          "that cannot fit), false (skip it) or report (print the prediction as one JSON line "
                          "and launch nothing)", [values("preflight", PREFLIGHT_MODES)])
    real_data = cfg.data.get("name", "synthetic") != "synthetic"
    if real_data:  # its local files exist (prepared below)
        from pipeline_recipes.datamodules.prepare import check_data, prepare_data  # local: torch ≥1.2 s

        check_data(OmegaConf.to_container(cfg.data, resolve=True))
    trainer_asked = OmegaConf.to_container(cfg.trainer, resolve=True)
    choice = found.choice = choose_accelerator(
        trainer_asked, layout_processes(OmegaConf.to_container(cfg.strategy, resolve=True),
                                        trainer_asked.get("num_nodes", 1)), options.nodes)
    choice = found.choice = with_compile(choice, cfg.model.get("compile"))  # model.compile=atuo: refused here
    trainer_cfg = choice.trainer
    with open_dict(cfg):  # every later reader (pre-flight, workers, W&B config) sees the concrete trainer
        cfg.trainer = trainer_cfg
        cfg.data.update(resolve_loader(cfg.data, choice))  # data.num_workers / pin_memory for this accelerator
    inputs = found.layout_inputs = _inputs(cfg, trainer_cfg)
    layout = found.layout = resolve_layout(*inputs[:4], layers_key=inputs[4], vet_fixes=False)
    check_model(OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.data, resolve=True))
    if cfg.data.get("tokenizer"):  # loads it (transformers): model.vocab_size must cover it
        from pipeline_recipes.datamodules.tokenizer import check_tokenizer_config  # local: torch ≥1.2 s

        check_tokenizer_config(OmegaConf.to_container(cfg.data, resolve=True))
    if mode != "report":  # preflight=report predicts for GPUs this node may lack
        check_devices(trainer_cfg, node_gpus(choice), inputs[0])
    check_precision(layout.strategy, trainer_cfg, OmegaConf.to_container(cfg.optim, resolve=True)
                    if cfg.get("optim") is not None else None)
    check_logger(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") is not None else None)
    found.launch = detect_launch(options.env, int(trainer_cfg["devices"]), int(trainer_cfg.get("num_nodes", 1)))
    if real_data and mode != "report" and options.prepare:  # once on the node, before the ranks
        prepare_data(OmegaConf.to_container(cfg.data, resolve=True))
    if mode and options.memory:  # the checks above answer without importing torch
        found.memory = True
        _memory(cfg, layout, choice, options)
    return layout


def _memory(cfg: DictConfig, layout: Layout, choice: AcceleratorChoice, options: _Options) -> None:
    """The memory pre-flight (``preflight=true``), or the prediction alone (``preflight=report``)."""
    from pipeline_recipes.planner.preflight import predict_layout, preflight  # local: torch ≥1.2 s

    budget = options.budget_bytes if options.budget_bytes is not None else choice.memory_per_rank
    if options.checked.mode == "report":  # estimates on fake tensors: no memory is allocated, no GPU needed
        if options.suggest:
            options.checked.report = predict_layout(OmegaConf.to_container(cfg, resolve=True), layout,
                                                    budget_bytes=budget)
        return
    preflight(OmegaConf.to_container(cfg, resolve=True), layout, budget_bytes=budget,
              **({} if options.suggest else {"max_options": 0}))
