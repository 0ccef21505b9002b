"""The run's layout (Chimera Table 1: W, D, B, N, B̂), derived once and checked before launch: the
:class:`~pipeline_recipes.core.layout.Layout` every worker then reads.

Every rule names the settings, their values and a fix, so a bad combination stops with one
message before any process starts. Each setting's own values are a schema (:func:`settings_schema`, checked
by :func:`check_settings` before anything else): the settings whose values are a fixed set, in
:func:`fixed_settings` (a near miss gets "did you mean", :func:`did_you_mean`, also used for misspelled keys
by ``train.py``), and the numbers (steps, intervals, sizes, timeouts, the seed), each with its type, range
and special values, in :func:`numeric_settings`.

The fixes are data (:mod:`pipeline_recipes.core.fixes`): a refusal proposes candidate overrides and
:func:`resolve_layout` keeps those with which it passes itself; the launcher keeps those that pass every check
of the command (:func:`pipeline_recipes.recipe.check.command.check_command`). So a proposal here is only a candidate:
every rule is written once, in its check, and decides about the values the others propose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pipeline_recipes.strategies.compute.cuda_graph_rules import cuda_graphs_error
from pipeline_recipes.strategies.schedules import (
    AUTO_CONCAT, CONCAT_METHODS, CONFIG, DEFAULT_SCHEDULE, LayoutRefusal, ScheduleError, ScheduleSpec, derive_layout,
    get_spec, names,
)
from pipeline_recipes.strategies.schedules.rules import (
    DEFAULT_GRAD_SYNC, DEFAULT_RECOMPUTE, GRAD_SYNC_MODES, RECOMPUTE_MODES, Refusal,
)

from pipeline_recipes.core.errors import did_you_mean
from pipeline_recipes.core.layout import BASELINES, Layout
from pipeline_recipes.core.node import GPU_NAMES
from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S, STOP_TIMEOUT_S
from pipeline_recipes.core.fixes import (
    ConfigError, Fix, Proposal, fixes_of, override_text, override_value, values, vet,
)
from pipeline_recipes.models.families import candidate_keys, config_key

__all__ = ["BASELINES", "ConfigError", "FixedSetting", "Layout", "NumericSetting", "SettingRule", "check_devices",
           "check_drain_timeout", "check_fixed_settings", "check_model", "check_settings", "cuda_graphs_device_error",
           "fixed_settings", "layers_key", "num_layers", "numeric_settings", "refuses", "resolve_layout",
           "setting_rule", "settings_schema"]


NONFINITE_LOSS = ("stop", "skip")  # strategies.lightning.PipelineModule
CHECKPOINT_KEEP = ("latest", "all")  # recipe.job.checkpoint_callbacks
SYNTHETIC_STRUCTURES = ("bigram", "uniform")  # datamodules.synthetic.STRUCTURES


class SettingRule:
    """A rule of the schema (:func:`settings_schema`): the values one setting (``key``) takes. ``refusal``
    gives the :class:`ConfigError` of a value it refuses (the key, the value, the rule, candidate fixes), or None."""

    key: str

    def refusal(self, value: Any) -> ConfigError | None:
        raise NotImplementedError

    def error(self, value: Any) -> str | None:
        """The message for ``value`` (the key, the value, the rule, the fix), or None."""
        refusal = self.refusal(value)
        return None if refusal is None else str(refusal)


@dataclass(frozen=True)
class FixedSetting(SettingRule):
    """A setting whose values are a fixed set: its key, the values, what it chooses; ``nullable``: null
    (the default) is allowed too."""

    key: str
    values: tuple[str, ...]
    meaning: str
    nullable: bool = False

    def refusal(self, value: Any) -> ConfigError | None:
        """The refusal of ``value`` (the key, the value, the allowed values; the near miss first among the
        fixes), or None."""
        if (value is None and self.nullable) or (isinstance(value, str) and value in self.values):
            return None
        allowed = ", ".join(self.values) + (" or null" if self.nullable else "")
        close = did_you_mean(value, self.values)
        guess = [values(self.key, [close], keep=1, lead=f"did you mean {close!r}?")] if close else []
        return ConfigError(f"{self.key} = {value!r} is not one of {allowed} ({self.meaning})",
                           [*guess, values(self.key, (*self.values, *([None] if self.nullable else ())), keep=1)])


@dataclass(frozen=True)
class BoolSetting(SettingRule):
    """A setting that is true or false: its key and what it chooses."""

    key: str
    meaning: str

    def refusal(self, value: Any) -> ConfigError | None:
        if isinstance(value, bool):
            return None
        return ConfigError(f"{self.key} = {value!r} is not true or false ({self.meaning})",
                           [values(self.key, [True, False], keep=1)])


Number = int | float


def _special(value: Any, special: Any) -> bool:
    """``value`` is the special value ``special`` (null, or a number of the same type: ``true`` is not 1)."""
    return value is special if special is None else type(value) is type(special) and value == special


@dataclass(frozen=True)
class NumericSetting(SettingRule):
    """A setting whose value is a number: its key, ``kind`` (``int``; ``float`` takes an int too, a bool is
    neither), the least value (``minimum``, excluded where ``positive``), the greatest (``maximum``, or none),
    what it sets (``meaning``), its unit in words (``unit``: "of seconds"), a valid value proposed where the given
    one is not a number at all (``example``); ``fraction``: an integer setting that also takes a share in
    [0.0, 1.0] (Lightning's ``limit_val_batches``); ``specials``: other values it takes, each with what it means
    (``(-1, "no limit")``, ``(None, "never")``: null is refused unless named here). NaN and infinities are
    refused."""

    key: str
    kind: type
    minimum: Number
    meaning: str
    example: Number
    positive: bool = False
    maximum: Number | None = None
    unit: str = ""
    fraction: bool = False
    specials: tuple[tuple[Any, str], ...] = ()

    def accepts(self, value: Any) -> bool:
        if any(_special(value, special) for special, _ in self.specials):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if isinstance(value, float) and self.kind is int:
            return self.fraction and 0.0 <= value <= 1.0
        above = value > self.minimum if self.positive else value >= self.minimum
        return above and (self.maximum is None or value <= self.maximum)

    def rule(self) -> str:
        """The values it takes in words: ``an integer ≥ 1, or -1 for no limit``."""
        noun = ("an integer" if self.kind is int else "a number") + (f" {self.unit}" if self.unit else "")
        if self.maximum is not None:
            text = f"{noun} in [{self.minimum}, {self.maximum}]"
        elif self.positive and self.minimum == 0:
            text = "a positive " + noun.split(" ", 1)[1]
        else:
            text = f"{noun} {'>' if self.positive else '≥'} {self.minimum}"
        if self.fraction:
            text += ", or a share of them in [0.0, 1.0]"
        return text + "".join(f", or {override_text(special)} for {meaning}" for special, meaning in self.specials)

    def refusal(self, value: Any) -> ConfigError | None:
        """The refusal of ``value`` (the key, the value, the rule, what the setting is); its fixes: the value
        made valid (a number written as text, the integer of a whole float, the opposite of a negative one, the
        nearest bound) else :attr:`example`, and the first special value."""
        if self.accepts(value):
            return None
        shown = repr(value) if isinstance(value, str) else override_text(value)
        return ConfigError(f"{self.key} = {shown}: {self.meaning} must be {self.rule()}",
                           [values(self.key, self._near(value), keep=1),
                            values(self.key, [special for special, _ in self.specials], keep=1)])

    def _near(self, value: Any) -> list[Any]:
        """Valid values near ``value``, the likeliest first, then :attr:`example`."""
        out: list[Any] = []
        if isinstance(value, str):
            value = _number(value.strip())
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            if isinstance(value, float) and value.is_integer() and self.kind is int:
                value = int(value)
            out += [value, -value]
            if self.maximum is not None and value > self.maximum:
                out.append(self.maximum)
            if self.fraction and isinstance(value, float) and value > 1:
                out.append(1.0)
            if not self.positive and value < self.minimum:
                out.append(self.minimum)
        out.append(self.example)
        return [v for v in dict.fromkeys(out) if self.accepts(v)]


def _number(text: str) -> Number | None:
    """The number ``text`` writes (``"8"``, ``"1e3"``), or None."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None


SECONDS = "of seconds"
UNLIMITED = (-1, "no limit")


def numeric_settings() -> tuple[NumericSetting, ...]:
    """Every numeric setting of the config (the recipe's and the Lightning ``Trainer``'s that the config
    sets), its type, range and special values, checked before launch. The layout's sizes (``trainer.devices``,
    ``strategy.D``, ``strategy.micro_batch_size``, ``data.global_batch_size``, ...) are the layout's rules
    (:func:`resolve_layout`), ``trainer.peak_tflops`` and ``model.loss_chunk_tokens`` their own checks."""
    return (
        NumericSetting("seed", int, 0, "the seed of every rank's RNGs (Lightning's seed_everything)", 0,
                       maximum=2**32 - 1),
        NumericSetting("trainer.max_steps", int, 1, "the optimizer steps to train (Lightning's max_steps)", 40,
                       specials=((-1, "no limit (trainer.max_epochs decides)"),)),
        NumericSetting("trainer.max_epochs", int, 1, "the epochs to train at most (Lightning's max_epochs)", 1,
                       specials=(UNLIMITED, (None, "Lightning's default (1000 epochs unless trainer.max_steps "
                                                   "ends the run first)"))),
        NumericSetting("trainer.log_every_n_steps", int, 0, "the steps between logged rows and progress lines (0: "
                       "never)", 5, specials=((None, "Lightning's default of 50"),)),
        NumericSetting("trainer.limit_val_batches", int, 0, "the validation batches per validation run", 0,
                       fraction=True, specials=((None, "all of them"),)),
        NumericSetting("trainer.gradient_clip_val", float, 0, "the largest gradient norm (0: no clipping)", 1.0,
                       specials=((None, "no clipping"),)),
        NumericSetting("checkpoint.every_n_steps", int, 1, "the training steps between two checkpoints", 100,
                       specials=((None, "never"),)),
        NumericSetting("stop_timeout_s", float, 0, "the time the ranks get to reach a step boundary and save "
                       "after a stop signal", STOP_TIMEOUT_S, positive=True, unit=SECONDS),
        NumericSetting("nonfinite_loss_patience", int, 0, "the non-finite losses in a row that "
                       "nonfinite_loss=skip skips before the run ends as diverged", 3),
        NumericSetting("strategy.timeout_s", float, 0, "the time a p2p wait or collective waits before it gives up",
                       COLLECTIVE_TIMEOUT_S, positive=True, unit=SECONDS),
        NumericSetting("metrics.window_size", int, 1, "the steps of one throughput window", 3),
        NumericSetting("metrics.warmup_steps", int, 0, "the first windows and steps left out of the medians of "
                       "results.json", 1),
        NumericSetting("metrics.progress_interval_s", float, 0, "the least time between two progress lines", 1.0,
                       unit=SECONDS),
        NumericSetting("logger.drain_timeout_s", float, 0, "the longest wait for queued W&B rows", 300,
                       positive=True, unit=SECONDS),
        NumericSetting("scheduler.warmup_steps", int, 0, "the optimizer steps of the learning rate's linear "
                       "warm-up", 10),
        NumericSetting("scheduler.min_lr_ratio", float, 0, "the final learning rate as a share of optim.lr", 0.1,
                       maximum=1),
        NumericSetting("scheduler.total_steps", int, 1, "the optimizer steps the learning rate decays over", 100,
                       specials=((None, "trainer.max_steps"),)),
        NumericSetting("optim.lr", float, 0, "the learning rate", 0.001),
        NumericSetting("optim.weight_decay", float, 0, "the weight decay", 0.0),
        NumericSetting("optim.momentum", float, 0, "SGD's momentum", 0.9),
    )


def bool_settings() -> tuple[BoolSetting, ...]:
    """Every true-or-false setting of the recipe's own, checked before launch (the strategy's are the layout's)."""
    return (BoolSetting("checkpoint.async_save", "whether checkpoints are written in the background while training "
                        "goes on"),)


def settings_schema() -> tuple[SettingRule, ...]:
    """Every rule of one setting's own values: :func:`fixed_settings`, :func:`bool_settings` and
    :func:`numeric_settings`, each key once."""
    return (*fixed_settings(), *bool_settings(), *numeric_settings())


def setting_rule(key: str) -> SettingRule:
    """The schema's rule of ``key``."""
    return next(rule for rule in settings_schema() if rule.key == key)


def fixed_settings() -> tuple[FixedSetting, ...]:
    """Every setting of the config whose values are a fixed set, checked before launch (the runtime checks
    them again). The schedule's name and ``strategy.concat`` are the schedule registry's rules, checked
    with the layout (:func:`resolve_layout`)."""
    return (
        FixedSetting("strategy.grad_sync", GRAD_SYNC_MODES, "when stage gradients are all-reduced, Chimera §3.2"),
        FixedSetting("strategy.recompute", RECOMPUTE_MODES, "which stage forwards the backward recomputes, GPipe §2.3"),
        FixedSetting("nonfinite_loss", NONFINITE_LOSS, "what a NaN/inf training loss does"),
        FixedSetting("checkpoint.keep", CHECKPOINT_KEEP, "which checkpoints stay on disk"),
        FixedSetting("data.structure", SYNTHETIC_STRUCTURES, "how synthetic tokens are drawn"),
    )


_ABSENT = object()


def _lookup(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _check_rules(config: Mapping[str, Any], rules: Sequence[SettingRule]) -> None:
    for rule in rules:
        value = _lookup(config, rule.key)
        if value is not _ABSENT and (refusal := rule.refusal(value)) is not None:
            raise refusal


def check_fixed_settings(config: Mapping[str, Any]) -> None:
    """Refuse a value outside its fixed set (``strategy.grad_sync=eagr``) for every key of
    :func:`fixed_settings` that ``config`` (the whole config, or ``{"strategy": ...}``) has."""
    _check_rules(config, fixed_settings())


def check_settings(config: Mapping[str, Any]) -> None:
    """Refuse a value its rule of :func:`settings_schema` refuses (``strategy.grad_sync=eagr``,
    ``trainer.max_steps=-5``, ``checkpoint.every_n_steps=abc``) for every key of the schema that ``config`` (the
    whole config) has: the first check before launch (:func:`pipeline_recipes.recipe.check.command.check_command`)."""
    _check_rules(config, settings_schema())


def _positive(name: str, value: Any, up_to: int = 16) -> int:
    """``value`` when it is a positive integer; a refusal proposing the least of 1…``up_to`` that passes."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", [values(name, range(1, up_to + 1), keep=1)])
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_proposals(global_batch_size: int, step: int) -> list[Proposal]:
    """The multiples of ``step`` nearest to ``global_batch_size``: the largest below it and the least above
    it that pass (a window of 16 each way)."""
    q = global_batch_size // step
    below = [k * step for k in range(q, max(q - 16, 0), -1) if k * step != global_batch_size]
    above = [k * step for k in range(q + 1, q + 17)]
    return [values("data.global_batch_size", below, keep=1), values("data.global_batch_size", above, keep=1)]


def _baseline_layout(name: str, world: int, D: int, global_batch_size: int, precision: str | None) -> Layout:
    """``ddp``: W = world size replicas of the whole model; ``single``: one process. Both take the
    replica's whole mini-batch in one pass (B = B̂/W, N = 1); ``strategy.micro_batch_size`` is unused."""
    if D != 1:
        raise ConfigError(f"strategy={name} has no pipeline stages but strategy.D = {D}",
                          [values("strategy.D", [1]), values("strategy", names(), keep=3)])
    if name == "single" and world != 1:
        raise ConfigError(f"strategy=single runs one process but trainer.devices × trainer.num_nodes = {world}",
                          [fixes_of({"trainer.devices": 1, "trainer.num_nodes": 1}), values("strategy", ["ddp"])])
    if global_batch_size % world:
        raise ConfigError(f"data.global_batch_size = {global_batch_size} is not divisible by the W = {world} "
                          f"replicas of strategy={name}, so it must be a multiple of {world}",
                          _batch_proposals(global_batch_size, world))
    return Layout(name, world, world, 1, global_batch_size // world, 1, global_batch_size, 1, precision=precision)


def _check_baseline_shard(name: str, shard: Any) -> None:
    """A baseline shards no optimizer state: ``single`` holds the only copy; ``ddp`` is Lightning's DDP with a whole
    optimizer per replica, whose sharded form here is a pipeline of one stage (``strategy=dapple strategy.D=1``)."""
    if shard is False or shard is None:
        return
    if name == "single":
        raise ConfigError(f"strategy.shard_optimizer = {str(shard).lower()} but strategy=single runs one process, which holds the "
                          "only copy of the optimizer state: there is nothing to shard",
                          [values("strategy.shard_optimizer", [False])])
    raise ConfigError(f"strategy.shard_optimizer = {str(shard).lower()} but strategy=ddp keeps a whole optimizer per replica "
                      "(Lightning's DDP); W data-parallel replicas with their optimizer state sharded are a pipeline "
                      "of one stage",
                      [fixes_of({"strategy": "dapple", "strategy.D": 1, "strategy.shard_optimizer": True}),
                       values("strategy.shard_optimizer", [False])])


def _schedule_spec(strategy: dict[str, Any]) -> tuple[str, Any]:
    """The strategy's name and, for a pipeline, its registry spec
    (:mod:`pipeline_recipes.strategies.schedules.registry`)."""
    schedule, name = strategy.get("schedule"), strategy.get("name")
    if schedule is not None and name is not None and schedule != name:
        raise ConfigError(f"strategy.schedule = {schedule} but strategy.name = {name}: strategy.name follows the "
                          "schedule, which strategy=NAME chooses",
                          [values("strategy", [name]), values("strategy.schedule", [name]),
                           values("strategy.name", [schedule])])
    key = "strategy.schedule" if schedule is not None else "strategy.name"
    name = str(schedule or name or DEFAULT_SCHEDULE)
    if name in BASELINES:
        return name, None
    try:
        return name, get_spec(name)
    except ScheduleError as err:
        close = did_you_mean(name, (*names(aliases=True), *BASELINES))
        guess = [values(key, [close], lead=f"did you mean {close!r}?"), values("strategy", [close])] if close else []
        raise ConfigError(f"strategy {name!r} is neither a pipeline schedule ({', '.join(names())}) nor a "
                          f"baseline ({', '.join(BASELINES)}); choose one of them with strategy=NAME",
                          [*guess, values("strategy", (*names(), *BASELINES), keep=3)]) from err


EXTRA_LAYERS = 2  # pipeline layers besides a model's blocks: the embedding and the head


def num_layers(model: Mapping[str, Any]) -> int:
    """Pipeline layers of a model config: its blocks (the key its family registers,
    :func:`~pipeline_recipes.models.families.config_key`) plus the embedding and the head."""
    key = config_key(model, "layers_key")
    if key is None:
        raise ConfigError(f"the model config (model.family = {model.get('family')!r}) sets no number of blocks: "
                          f"none of {', '.join(f'model.{k}' for k in candidate_keys(model, 'layers_key'))}")
    return int(model[key]) + EXTRA_LAYERS


def layers_key(model: Mapping[str, Any]) -> str | None:
    """The override that sets a model config's blocks (``model.n_layer``), or None."""
    key = config_key(model, "layers_key")
    return None if key is None else f"model.{key}"


def resolve_layout(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int, *,
                   layers_key: str | None = None, vet_fixes: bool = True) -> Layout:
    """The layout of a config's settings: the config's own checks (its keys, the processes, the baselines), then a
    pipeline's layout derived and checked by :func:`pipeline_recipes.strategies.schedules.derive_layout` (the one
    derivation of W, B, N and S; the schedule's rules come from its registry spec), whose refusal becomes a
    :class:`~pipeline_recipes.core.fixes.ConfigError` with candidate fixes of the config. A refusal keeps the fixes
    with which this function passes (``vet_fixes``; the launcher checks them against the whole command instead, :mod:`pipeline_recipes.recipe.check.command`); ``layers_key``: the
    model's setting of its blocks (``model.n_layer``), so that a refusal may propose more of them."""
    try:
        return _resolve(strategy, trainer, global_batch_size, num_layers, layers_key)
    except ConfigError as err:
        if not vet_fixes:
            raise
        passes = partial(_passes_with, strategy, trainer, global_batch_size, num_layers, layers_key)
        raise vet(err, passes) from err.__cause__


def _passes_with(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int,
                 layers_key: str | None, fix: Fix) -> ValueError | None:
    """The layout's refusal with ``fix`` applied (None: it passes); a fix of anything else (another strategy
    config, a model setting) is not judged here and does not pass."""
    applied = _applied(strategy, trainer, global_batch_size, num_layers, layers_key, fix, literal=True)
    if applied is None:
        return ValueError(f"{fix} sets something other than the layout")
    return _refusal(*applied, layers_key)


def refuses(inputs: tuple[dict[str, Any], dict[str, Any], int, int, str | None], fix: Fix) -> ConfigError | None:
    """The refusal by the layout's rules of ``inputs`` (:func:`resolve_layout`'s arguments, the trainer
    concrete) with ``fix`` applied, so that the whole command with it fails too; None where they pass or the fix
    changes something the layout cannot tell from these (the strategy's name, another config group, another
    setting)."""
    strategy, trainer, global_batch_size, num_layers, key = inputs
    applied = _applied(strategy, trainer, global_batch_size, num_layers, key, fix, literal=False)
    return None if applied is None else _refusal(*applied, key)


def _refusal(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int,
             layers_key: str | None) -> ConfigError | None:
    try:
        _resolve(strategy, trainer, global_batch_size, num_layers, layers_key)
    except ConfigError as err:
        return err
    return None


def _applied(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int,
             layers_key: str | None, fix: Fix, literal: bool) -> tuple | None:
    """The layout's settings with ``fix`` applied, or None where it sets something else (``literal``: every
    setting is set as given, as a caller of :func:`resolve_layout` would; otherwise, on a config's settings,
    ``strategy.name`` and ``strategy.schedule`` are not judged, since the name follows the schedule, nor
    ``trainer.accelerator``, which decides what ``trainer.devices=auto`` means)."""
    strategy, trainer = dict(strategy), dict(trainer)
    for key, text in fix.items():
        value = override_value(text)
        group, _, leaf = key.partition(".")
        if group == "strategy" and leaf and (literal or leaf not in ("schedule", "name")):
            strategy[leaf] = value
        elif group == "trainer" and leaf and (literal or leaf != "accelerator"):
            trainer[leaf] = value
        elif key == "data.global_batch_size":
            global_batch_size = value
        elif key == layers_key and isinstance(value, int):
            num_layers = value + EXTRA_LAYERS
        else:
            return None
    return strategy, trainer, global_batch_size, num_layers


def _resolve(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int,
             layers_key: str | None) -> Layout:
    name, spec = _schedule_spec(strategy)
    check_fixed_settings({"strategy": strategy})
    _check_trainer_keys(trainer)
    devices = trainer.get("devices", 1)
    if devices == "auto" or devices == -1:
        raise ConfigError("trainer.devices must be a number for pipeline runs (W·D must be known before launch)",
                          [values("trainer.devices", range(1, 17), keep=1)])
    world = _positive("trainer.devices", devices) * _positive("trainer.num_nodes", trainer.get("num_nodes", 1))
    D = _positive("strategy.D", strategy.get("D"))
    _positive("data.global_batch_size", global_batch_size, up_to=64)
    if spec is None:
        _check_baseline_shard(name, strategy.get("shard_optimizer", False))
        return _baseline_layout(name, world, D, global_batch_size, trainer.get("precision"))
    fixed_n = spec.fixed_micro_batches
    B = None if fixed_n is not None and strategy.get("micro_batch_size") is None else _positive(
        "strategy.micro_batch_size", strategy.get("micro_batch_size"))
    cuda_graphs, recompute = strategy.get("cuda_graphs", False), strategy.get("recompute", DEFAULT_RECOMPUTE)
    graph_rules = (lambda _: cuda_graphs_device_error(cuda_graphs, trainer.get("accelerator")),
                   partial(cuda_graphs_error, cuda_graphs, spec, recompute))
    try:
        return derive_layout(spec, world, D, global_batch_size, B=B, W=strategy.get("W"),
                             pipelines=strategy.get("pipelines"), concat=strategy.get("concat"),
                             chunks=strategy.get("chunks"), grad_sync=strategy.get("grad_sync", DEFAULT_GRAD_SYNC),
                             recompute=recompute, cuda_graphs=cuda_graphs, num_layers=num_layers,
                             precision=trainer.get("precision"), shard_optimizer=strategy.get("shard_optimizer", False),
                             schedule_rules=graph_rules, naming=CONFIG)
    except LayoutRefusal as err:
        around = _Around(spec, strategy, trainer, world, D, err.W, err.B, global_batch_size, num_layers, layers_key)
        raise _with_fixes(err, around, fixed_n) from err.__cause__


def _with_fixes(err: LayoutRefusal, around: _Around, fixed_n: int | None) -> ConfigError:
    """The launcher's refusal of a layout that :func:`~pipeline_recipes.strategies.schedules.derive_layout` refused:
    its message with candidate fixes of the config for the kind of setting that may fix it."""
    world, D, W = around.world, around.D, around.W
    if err.kind == "rule":
        return around.refused(err.problem)
    if err.kind == "schedule":
        return ConfigError(str(err.problem))
    if err.kind == "halving":
        even = [b for b in _divisors(around.global_batch_size // W) if b % 2 == 0]
        return around.error(err.problem, [values("strategy.micro_batch_size", even),
                                          values("strategy.concat", ["direct", "forward_doubling"])])
    proposals = {
        "stages": around.stages,
        "replicas": lambda: [values("strategy.W", [None, world // D]),
                             values("strategy.D", [world // W] if world % W == 0 else [])],
        "fixed_batch": lambda: _batch_proposals(around.global_batch_size, W * (fixed_n or 1)),
        "layers": lambda: around.stages() + (around.changing("chunks") if around.spec.chunks.choosable else []),
        "batch": around.micro_batches,
    }[err.kind]()
    return around.error(err.problem, proposals)


KIND_KEYS = {"stages": "strategy.D", "pipelines": "strategy.pipelines", "concat": "strategy.concat",
             "chunks": "strategy.chunks", "grad_sync": "strategy.grad_sync", "recompute": "strategy.recompute",
             "cuda_graphs": "strategy.cuda_graphs", "accelerator": "trainer.accelerator",
             "shard_optimizer": "strategy.shard_optimizer"}
"""The config's key of each setting a rule's refusal may name (:class:`~pipeline_recipes.strategies.schedules.rules.Refusal`)."""
# what an asynchronous schedule or CUDA graphs run with
DEFAULTS = {"grad_sync": DEFAULT_GRAD_SYNC, "recompute": DEFAULT_RECOMPUTE}


@dataclass(frozen=True)
class _Around:
    """The settings around a refusal of the layout, and the candidate fixes they suggest: values of the refused
    setting near the given one (:meth:`stages`, :meth:`micro_batches`, :meth:`changing`), or, where none works,
    other devices, more layers or another schedule (:meth:`elsewhere`). Candidates only: the checks decide."""

    spec: ScheduleSpec
    strategy: Mapping[str, Any]
    trainer: Mapping[str, Any]
    world: int
    D: int
    W: int
    B: int
    global_batch_size: int
    num_layers: int
    layers_key: str | None

    def error(self, problem: str, proposals: Sequence[Proposal]) -> ConfigError:
        return ConfigError(problem, proposals, alternatives=self.elsewhere)

    def refused(self, message: str) -> ConfigError:
        """The error of a rule's message: its problem with candidates for the settings it names (a rule that
        returns a plain message keeps its own words)."""
        if not hasattr(message, "changes"):
            return ConfigError(str(message))
        out: list[Proposal] = []
        if message.guess is not None and message.changes:
            out.append(values(KIND_KEYS[message.changes[0]], [message.guess], keep=1,
                              lead=f"did you mean {message.guess!r}?"))
        defaults = {KIND_KEYS[k]: v for k, v in DEFAULTS.items()
                    if k in message.changes and self.strategy.get(k, v) != v}
        if defaults:
            out.append(fixes_of(defaults))
        for kind in message.changes:
            out += self.changing(kind)
        if message.schedules:
            out.append(values("strategy", message.schedules, keep=3))
        return self.error(message.problem, out)

    def stages(self) -> list[Proposal]:
        """Every other divisor of the processes as D."""
        return [values("strategy.D", [d for d in _divisors(self.world) if d != self.D])]

    def micro_batches(self) -> list[Proposal]:
        """N through the batch: the nearest global batches, every micro-batch size that divides the replica's
        batch (and none, where the schedule fixes N), every other D."""
        out = _batch_proposals(self.global_batch_size, self.W * self.B)
        if self.global_batch_size % self.W == 0:
            out.append(values("strategy.micro_batch_size",
                              [b for b in _divisors(self.global_batch_size // self.W) if b != self.B]))
        if self.spec.fixed_micro_batches is not None:
            out.append(values("strategy.micro_batch_size", [None]))
        return out + self.stages()

    def changing(self, kind: str) -> list[Proposal]:
        """Other values of one setting of the schedule (named as :data:`KIND_KEYS`), or null where the schedule
        has no choice of it."""
        if kind == "micro_batches":
            return self.micro_batches()
        key = KIND_KEYS.get(kind)
        if key is None or kind in DEFAULTS:
            return []
        if kind == "stages":
            return self.stages()
        current = self.strategy.get(key.split(".", 1)[1])
        choices: Sequence[Any] = {
            "pipelines": range(1, 2 * self.D + 1) if self.spec.pipelines.choices is not None else
            [self.spec.pipelines.default],
            "concat": (*CONCAT_METHODS, AUTO_CONCAT) if self.spec.concat else (),
            "chunks": range(1, 2 * max(self.spec.chunks.default, current if isinstance(current, int) else 1) + 1)
            if self.spec.chunks.choosable else (),
            "cuda_graphs": [False],
            "shard_optimizer": [False],
            "accelerator": ["gpu", "auto"],
        }[kind]
        fixed = {"pipelines": self.spec.pipelines.choices is None, "concat": not self.spec.concat,
                 "chunks": not self.spec.chunks.choosable}
        nulls = [values(key, [None], keep=1)] if fixed.get(kind) else []
        return [*nulls, values(key, [c for c in choices if c != current])]

    def elsewhere(self) -> list[Proposal]:
        """Where no value of the refused setting works: other devices (with D as it is, then with another D),
        more of the model's blocks, another schedule."""
        devices = int(self.trainer.get("devices", 1)) if isinstance(self.trainer.get("devices"), int) else 1
        nodes = self.world // max(devices, 1)
        near = sorted((d for d in range(1, max(2 * devices, 8) + 1) if d != devices), key=lambda d: (abs(d - devices), d))
        out = [values("trainer.devices", near, keep=1),
               Proposal(tuple({"trainer.devices": str(d), "strategy.D": str(k)} for d in near
                              for k in sorted(_divisors(d * nodes), key=lambda k: (abs(k - self.D), k))
                              if k != self.D), keep=2)]
        if self.layers_key is not None:
            blocks = self.num_layers - EXTRA_LAYERS
            out.append(values(self.layers_key, range(blocks + 1, blocks + 17), keep=1))
        name = self.spec.name
        return out + [values("strategy", [n for n in (*names(), *BASELINES) if n != name], keep=2)]


def _check_trainer_keys(trainer: dict[str, Any]) -> None:
    """``trainer.*`` keys the recipe cannot take: a Trainer strategy (the ``strategy`` group derives the
    layout) and a peak that is not positive."""
    if trainer.get("strategy") is not None:
        raise ConfigError(f"trainer.strategy = {trainer['strategy']!r} would bypass the layout; the strategy group "
                          "chooses the strategy instead (strategy=gpipe, strategy=ddp, ...)",
                          [values("trainer.strategy", [None])])
    peak = trainer.get("peak_tflops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        raise ConfigError(f"trainer.peak_tflops = {peak!r} must be a positive number (the device's peak TFLOP/s, "
                          "for MFU) or null (looked up from the GPU's name)", [values("trainer.peak_tflops", [None])])


def cuda_graphs_device_error(value: Any, accelerator: Any) -> str | None:
    """``strategy.cuda_graphs = true`` needs CUDA devices (``trainer.accelerator`` None or auto: not known yet,
    checked again once the launcher resolved it)."""
    if value is not True or accelerator in (None, "auto", *GPU_NAMES):
        return None
    return Refusal(f"strategy.cuda_graphs = true but trainer.accelerator = {accelerator}: CUDA graphs need CUDA "
                   "devices (trainer=auto finds them where the node has CUDA)", "run on GPUs (trainer=gpu, or "
                   "trainer=auto on a node with CUDA) or set strategy.cuda_graphs=false", ("cuda_graphs", "accelerator"))


def check_model(model: dict[str, Any], data: dict[str, Any]) -> None:
    """Shapes the model cannot take: a sequence longer than its position table; a loss chunk that is
    not a positive number of tokens."""
    chunk = model.get("loss_chunk_tokens")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ConfigError(f"model.loss_chunk_tokens = {chunk!r}: the tokens whose logits the LM loss computes at a "
                          "time must be a positive integer, or null for the whole micro-batch at once",
                          [values("model.loss_chunk_tokens", [4096, None])])
    positions_key = config_key(model, "positions_key")
    positions = None if positions_key is None else model[positions_key]
    seq_len = data.get("seq_len", model.get("seq_len"))
    if positions is not None and seq_len is not None and int(seq_len) > int(positions):
        key = f"model.{positions_key}"
        raise ConfigError(f"sequence length {seq_len} (model.seq_len / data.seq_len) exceeds the model's {positions} "
                          f"positions ({key}): model.seq_len must be ≤ {positions}, or {key} ≥ {seq_len}",
                          [values("model.seq_len", [positions]), values("data.seq_len", [positions]),
                           values(key, [seq_len])])


def check_devices(trainer: dict[str, Any], available_gpus: int | None, strategy: Mapping[str, Any] | None = None) -> None:
    """More GPUs per node than this node has (CPU processes are not limited; ``available_gpus`` None:
    not checked, e.g. under ``trainer=auto``, whose processes share the GPUs then). ``strategy``: its D and W,
    which the fewer processes proposed come with."""
    if trainer.get("accelerator") in GPU_NAMES and available_gpus is not None:
        devices = int(trainer.get("devices", 1))
        if devices > available_gpus == 0:
            raise ConfigError(f"trainer.devices = {devices} GPUs but this node has no GPU",
                              [values("trainer", ["cpu"]), values("trainer.accelerator", ["cpu"])])
        if devices > available_gpus:
            gpus = f"{available_gpus} GPU{'s' if available_gpus > 1 else ''}"
            fewer = range(available_gpus, 0, -1)
            nodes = int(trainer.get("num_nodes", 1) or 1)
            D, W = (strategy or {}).get("D"), (strategy or {}).get("W")
            depths = [(g, d) for g in fewer for d in sorted(_divisors(g * nodes),
                                                            key=lambda d: (abs(d - D) if isinstance(D, int) else 0, d))]
            raise ConfigError(
                f"trainer.accelerator = {trainer['accelerator']} with trainer.devices = {devices} processes per node, "
                f"but this node has {gpus} (one GPU per process): run at most {available_gpus} per node (strategy.D × "
                f"strategy.W to match, trainer.num_nodes for more nodes), or let the {devices} processes share the "
                f"{gpus} over gloo (trainer.accelerator=auto; fine for trying schedules, not for speed)",
                [values("trainer.devices", fewer, keep=1),
                 fixes_of(*({"trainer.devices": g, "strategy.D": d, **({"strategy.W": None} if W else {})}
                            for g, d in depths), keep=2),
                 values("trainer", ["auto"]), values("trainer.accelerator", ["auto"])])


def check_drain_timeout(drain_timeout_s: Any) -> float:
    """``logger.drain_timeout_s`` (:class:`pipeline_recipes.recipe.worker.background_logger.BackgroundWandbLogger`) as its
    rule of :func:`numeric_settings` has it (a positive number of seconds), in seconds."""
    if (refusal := setting_rule("logger.drain_timeout_s").refusal(drain_timeout_s)) is not None:
        raise refusal
    return float(drain_timeout_s)
