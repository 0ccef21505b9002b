"""The run's layout (Chimera Table 1: W, D, B, N, B̂), derived once and checked before launch.

Every rule names the settings, their values and a fix, so a bad combination stops with one
message before any process starts. Settings whose values are a fixed set are listed once, in
:func:`fixed_settings`, and a near miss gets "did you mean" (:func:`did_you_mean`, also used for
misspelled keys by ``train.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pipeline_recipes.strategies.schedules import (
    CONFIG, ScheduleError, Settings, build_schedule, get_spec, names, resolve_concat,
)
from pipeline_recipes.strategies.cuda_graph_rules import cuda_graphs_error
from pipeline_recipes.strategies.schedules.rules import did_you_mean


class ConfigError(ValueError):
    """An invalid combination of settings, explained."""


class DataError(ConfigError):
    """The job's data cannot be had (no such file, offline with an empty cache, no answer from the hub): the
    message names the setting, the cause and the fixes (last). Defined here, not in
    :mod:`~pipeline_recipes.datamodules`, so that the launcher tells it apart without importing ``datasets`` or
    torch."""


@dataclass(frozen=True)
class Layout:
    strategy: str
    world_size: int
    W: int
    D: int
    B: int
    N: int
    global_batch_size: int
    pipelines: int
    variant: str = ""  # settings beyond the schedule's defaults, e.g. "forward_doubling+eager_opt"
    concat: str = "direct"  # Chimera's N > D method that runs (strategy.concat=auto resolved)
    concat_auto: bool = False  # strategy.concat=auto chose it
    S: int | None = None  # stages the model is split into when a worker holds several (v·D); None: D
    cuda_graphs: bool = False  # strategy.cuda_graphs: repeated blocks replayed as CUDA graphs per micro-batch slot

    @property
    def label(self) -> str:
        """The strategy as compared: its name plus any non-default variant, e.g. ``chimera+4pipes``."""
        return f"{self.strategy}+{self.variant}" if self.variant else self.strategy

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def run_name(self) -> str:
        """The run's name in W&B and in comparisons, e.g. ``chimera-W2-D4-B1``."""
        return f"{self.label}-W{self.W}-D{self.D}-B{self.B}"

    def result_fields(self) -> dict[str, Any]:
        """The layout's keys of ``results.json`` (``strategy`` is the :attr:`label`)."""
        return {"strategy": self.label, "W": self.W, "D": self.D, "B": self.B, "N": self.N,
                "global_batch_size": self.global_batch_size, "world_size": self.world_size}

    def describe(self) -> str:
        return (
            f"layout: {self.label}  W={self.W} replicas × D={self.D} "
            + (f"workers ({self.S} stages) " if self.S not in (None, self.D) else "stages ")
            + f"= {self.world_size} processes; "
            f"B={self.B} × N={self.N} micro-batches × W={self.W} = global batch {self.global_batch_size}"
            + (f"; {self.pipelines} pipelines" if self.pipelines > 1 else "")
            + (f"; concat=auto → {self.concat}" if self.concat_auto else "")
            + ("; CUDA graphs per micro-batch slot (strategy.cuda_graphs=true)" if self.cuda_graphs else "")
        )


GRAD_SYNC = ("end", "eager", "eager_opt")  # strategies.grad_sync.GRAD_SYNC_MODES (that module imports torch)
RECOMPUTE = ("none", "except_last", "always")  # strategies.recompute.RECOMPUTE_MODES
NONFINITE_LOSS = ("stop", "skip")  # strategies.lightning.PipelineModule
CHECKPOINT_KEEP = ("latest", "all")  # recipe.job.checkpoint_callbacks
LOGGER_KINDS = ("wandb", "csv", "none")  # recipe.job.build_loggers
SYNTHETIC_STRUCTURES = ("bigram", "uniform")  # datamodules.synthetic.STRUCTURES


@dataclass(frozen=True)
class FixedSetting:
    """A setting whose values are a fixed set: its key, the values, what it chooses; ``nullable``: null
    (the default) is allowed too."""

    key: str
    values: tuple[str, ...]
    meaning: str
    nullable: bool = False

    def error(self, value: Any) -> str | None:
        """The message for ``value`` (the key, the value, the allowed values, a near miss, the fix), or None."""
        if (value is None and self.nullable) or (isinstance(value, str) and value in self.values):
            return None
        allowed = ", ".join(self.values) + (" or null" if self.nullable else "")
        close = did_you_mean(value, self.values)
        fix = f"did you mean {close!r}? set {self.key}={close}" if close else f"set {self.key} to one of them"
        return f"{self.key} = {value!r} is not one of {allowed} ({self.meaning}); {fix}"


def fixed_settings() -> tuple[FixedSetting, ...]:
    """Every setting of the config whose values are a fixed set, checked before launch (the runtime checks
    them again). The schedule's name and ``strategy.concat`` are the schedule registry's rules, checked
    with the layout (:func:`resolve_layout`)."""
    return (
        FixedSetting("strategy.grad_sync", GRAD_SYNC, "when stage gradients are all-reduced, Chimera §3.2"),
        FixedSetting("strategy.recompute", RECOMPUTE, "which stage forwards the backward recomputes, GPipe §2.3"),
        FixedSetting("nonfinite_loss", NONFINITE_LOSS, "what a NaN/inf training loss does"),
        FixedSetting("checkpoint.keep", CHECKPOINT_KEEP, "which checkpoints stay on disk"),
        FixedSetting("logger.kind", LOGGER_KINDS, "the logger; or choose one with logger=wandb|csv|none"),
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


def check_fixed_settings(config: Mapping[str, Any]) -> None:
    """Refuse a value outside its fixed set (``strategy.grad_sync=eagr``) for every key of
    :func:`fixed_settings` that ``config`` (the whole config, or ``{"strategy": ...}``) has."""
    for setting in fixed_settings():
        value = _lookup(config, setting.key)
        if value is not _ABSENT and (message := setting.error(value)) is not None:
            raise ConfigError(message)


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}; set {name}=1 or more")
    return value


BASELINES = ("ddp", "single")


def _baseline_layout(name: str, world: int, D: int, global_batch_size: int) -> Layout:
    """``ddp``: W = world size replicas of the whole model; ``single``: one process. Both take the
    replica's whole mini-batch in one pass (B = B̂/W, N = 1); ``strategy.micro_batch_size`` is unused."""
    if D != 1:
        raise ConfigError(f"strategy={name} has no pipeline stages but strategy.D = {D}; set strategy.D=1 "
                          f"(or pick a pipeline strategy: {', '.join(names())})")
    if name == "single" and world != 1:
        raise ConfigError(f"strategy=single runs one process but trainer.devices × trainer.num_nodes = {world}; "
                          "set trainer.devices=1 trainer.num_nodes=1 (or use strategy=ddp)")
    if global_batch_size % world:
        raise ConfigError(f"data.global_batch_size = {global_batch_size} is not divisible by the W = {world} "
                          f"replicas of strategy={name}; use a multiple of {world}")
    return Layout(name, world, world, 1, global_batch_size // world, 1, global_batch_size, 1)


def _schedule_spec(strategy: dict[str, Any]) -> tuple[str, Any]:
    """The strategy's name and, for a pipeline, its registry spec
    (:mod:`pipeline_recipes.strategies.schedules.registry`)."""
    schedule, name = strategy.get("schedule"), strategy.get("name")
    if schedule is not None and name is not None and schedule != name:
        raise ConfigError(f"strategy.schedule = {schedule} but strategy.name = {name}: strategy.name follows the "
                          f"schedule; choose the schedule with strategy={name} (or strategy.schedule={name}) instead")
    name = str(schedule or name or "gpipe")
    if name in BASELINES:
        return name, None
    try:
        return name, get_spec(name)
    except ScheduleError as err:
        close = did_you_mean(name, (*names(aliases=True), *BASELINES))
        raise ConfigError(f"strategy {name!r} is neither a pipeline schedule ({', '.join(names())}) nor a "
                          f"baseline ({', '.join(BASELINES)}); choose one of them with strategy=NAME"
                          + (f"; did you mean {close!r}?" if close else "")) from err


def resolve_layout(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int) -> Layout:
    """Derive W and N and check every rule of the pipeline layout (the schedule's own rules come from its
    registry spec)."""
    name, spec = _schedule_spec(strategy)
    check_fixed_settings({"strategy": strategy})
    _check_trainer_keys(trainer)
    devices = trainer.get("devices", 1)
    if devices == "auto" or devices == -1:
        raise ConfigError("trainer.devices must be a number for pipeline runs (W·D must be known before launch)")
    world = _positive("trainer.devices", devices) * _positive("trainer.num_nodes", trainer.get("num_nodes", 1))
    D = _positive("strategy.D", strategy.get("D"))
    _positive("data.global_batch_size", global_batch_size)
    if spec is None:
        return _baseline_layout(name, world, D, global_batch_size)
    fixed_n = spec.fixed_micro_batches
    one_per_update = fixed_n is not None and strategy.get("micro_batch_size") is None  # B = B̂ / (W·N)
    B = 1 if one_per_update else _positive("strategy.micro_batch_size", strategy.get("micro_batch_size"))
    if world % D:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"strategy.D = {D} does not divide the {world} processes (trainer.devices × trainer.num_nodes); "
            f"set strategy.D to one of {divisors}"
        )
    W = strategy.get("W") or world // D
    if W * D != world:
        raise ConfigError(
            f"W·D = {W}·{D} = {W * D} but trainer.devices × trainer.num_nodes = {world}; "
            f"set strategy.W = {world // D} (or leave it null) or strategy.D to a divisor of {world}"
        )
    if one_per_update:
        if global_batch_size % (W * fixed_n):
            raise ConfigError(f"data.global_batch_size = {global_batch_size} is not divisible by W·N = "
                              f"{W}·{fixed_n}; use a multiple of {W * fixed_n} (strategy={name} takes B = global "
                              f"batch / (W·N), N = {fixed_n})")
        B = global_batch_size // (W * fixed_n)
    S = spec.total_stages(D, strategy.get("chunks"))
    if S > num_layers:
        per = S // D
        raise ConfigError(
            f"strategy.D = {D}" + (f" with {per} stages per worker (S = {S})" if per > 1 else " stages")
            + f" but the model has only {num_layers} pipeline layers; use " + (
                f"D ≤ {num_layers // per}" + (", or fewer strategy.chunks" if spec.chunks.choosable else "")
                if per > 1 else f"D ≤ {num_layers}"))
    if global_batch_size % (W * B):
        raise ConfigError(_batch_error(global_batch_size, W, B, world, D, strategy.get("W") is not None))
    N = global_batch_size // (W * B)
    settings = Settings(name, D, N, B, strategy.get("pipelines"), strategy.get("concat"), strategy.get("chunks"),
                        grad_sync=strategy.get("grad_sync", "end"), recompute=strategy.get("recompute", "none"),
                        naming=CONFIG)
    errors = spec.errors(settings)
    if errors:
        raise ConfigError(errors[0])
    pipelines = settings.pipelines or spec.pipelines.default
    requested = str(settings.concat or "direct") if spec.concat else "direct"
    concat = resolve_concat(name, D, N, pipelines, B, requested)
    schedule = _check_schedule(spec, D, N, B, pipelines, concat, settings.chunks)
    cuda_graphs = strategy.get("cuda_graphs", False)
    message = cuda_graphs_device_error(cuda_graphs, trainer.get("accelerator")) or cuda_graphs_error(
        cuda_graphs, spec, strategy.get("recompute", "none"), schedule)
    if message is not None:
        raise ConfigError(message)
    return Layout(name, world, W, D, B, N, global_batch_size, pipelines, _variant(strategy, spec, pipelines, concat),
                  concat, requested == "auto", S if S != D else None, cuda_graphs)


def _batch_error(global_batch_size: int, W: int, B: int, world: int, D: int, w_set: bool) -> str:
    """N = B̂ / (W·B) must be whole: name both settings, where W comes from, and the values that work."""
    step = W * B
    origin = (f"strategy.W = {W}" if w_set else
              f"{W} replicas: trainer.devices × trainer.num_nodes = {world} processes / strategy.D = {D}")
    below, above = global_batch_size // step * step, (global_batch_size // step + 1) * step
    batches = " or ".join(str(v) for v in (below, above) if v > 0)
    head = (f"data.global_batch_size = {global_batch_size} is not divisible by W·B = {W}·{B} = {step} "
            f"(W = {origin}; B = strategy.micro_batch_size = {B}): N = data.global_batch_size / (W·B) "
            f"micro-batches per step must be whole; set data.global_batch_size to a multiple of {step} "
            f"(e.g. {batches})")
    if global_batch_size % W:
        return head + f"; no strategy.micro_batch_size helps while data.global_batch_size is not a multiple of W = {W}"
    per_replica = global_batch_size // W
    sizes = [b for b in range(1, per_replica + 1) if per_replica % b == 0]
    return head + (f", or strategy.micro_batch_size to one of {sizes} (the divisors of data.global_batch_size / W "
                   f"= {per_replica})")


def _check_trainer_keys(trainer: dict[str, Any]) -> None:
    """``trainer.*`` keys the recipe cannot take: a Trainer strategy (the ``strategy`` group derives the
    layout) and a peak that is not positive."""
    if trainer.get("strategy") is not None:
        raise ConfigError(f"trainer.strategy = {trainer['strategy']!r} would bypass the layout; choose the strategy "
                          "with the strategy group instead (strategy=gpipe, strategy=ddp, ...)")
    peak = trainer.get("peak_tflops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        raise ConfigError(f"trainer.peak_tflops = {peak!r} must be a positive number (the device's peak TFLOP/s, "
                          "for MFU) or null (looked up from the GPU's name)")


def _check_schedule(spec: Any, D: int, N: int, B: int, pipelines: int, concat: str, chunks: int | None = None) -> Any:
    """Build (and validate) the schedule the workers will run, so a bad combination stops here; returns it."""
    name = spec.name
    try:
        schedule = build_schedule(name, D, N, pipelines, concat, chunks=chunks, micro_batch_size=B)
    except ValueError as err:
        extra = f", concat = {concat}" if spec.concat else ""
        raise ConfigError(f"strategy={name} with D = {D}, N = {N} micro-batches{extra}: {err}") from err
    halved = any(a.half is not None for acts in schedule.workers for a in acts)
    if halved and B % 2:
        raise ConfigError(f"concat = backward_halving splits micro-batches in two halves, but strategy.micro_batch_size "
                          f"= {B} is odd; use an even micro_batch_size (e.g. {B + 1}) or concat = direct")
    return schedule


GPU_NAMES = ("gpu", "cuda")  # trainer.accelerator values that mean CUDA devices (recipe.accelerator re-exports it)


def cuda_graphs_device_error(value: Any, accelerator: Any) -> str | None:
    """``strategy.cuda_graphs = true`` needs CUDA devices (``trainer.accelerator`` None or auto: not known yet,
    checked again once the launcher resolved it)."""
    if value is not True or accelerator in (None, "auto", *GPU_NAMES):
        return None
    return (f"strategy.cuda_graphs = true but trainer.accelerator = {accelerator}: CUDA graphs need CUDA devices; "
            "run on GPUs (trainer=gpu, or trainer=auto on a node with CUDA) or set strategy.cuda_graphs=false")


def _variant(strategy: dict[str, Any], spec: Any, pipelines: int, concat: str = "direct") -> str:
    """Settings beyond the schedule's defaults: concatenation method, pipelines, gradient sync, recomputation."""
    parts = []
    if spec.concat and concat != "direct":
        parts.append(concat)
    if spec.pipelines.choices is not None and pipelines != spec.pipelines.default:
        parts.append(f"{pipelines}pipes")
    if spec.chunks.choosable and strategy.get("chunks") not in (None, spec.chunks.default):
        parts.append(f"v{strategy['chunks']}")
    if strategy.get("grad_sync", "end") != "end":
        parts.append(f"sync_{strategy['grad_sync']}")
    if strategy.get("recompute", "none") != "none":
        parts.append(f"recompute_{strategy['recompute']}")
    return "+".join(parts)


def check_model(model: dict[str, Any], data: dict[str, Any]) -> None:
    """Shapes the model cannot take: a sequence longer than its position table; a loss chunk that is
    not a positive number of tokens."""
    chunk = model.get("loss_chunk_tokens")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ConfigError(f"model.loss_chunk_tokens = {chunk!r}: the tokens whose logits the LM loss computes at a "
                          "time must be a positive integer (e.g. model.loss_chunk_tokens=4096), or null for the "
                          "whole micro-batch at once")
    positions = model.get("n_positions", model.get("max_position_embeddings"))
    seq_len = data.get("seq_len", model.get("seq_len"))
    if positions is not None and seq_len is not None and int(seq_len) > int(positions):
        key = "model.n_positions" if "n_positions" in model else "model.max_position_embeddings"
        raise ConfigError(f"sequence length {seq_len} (model.seq_len / data.seq_len) exceeds the model's {positions} "
                          f"positions ({key}); set model.seq_len ≤ {positions} or raise {key}")


def check_devices(trainer: dict[str, Any], available_gpus: int | None) -> None:
    """More GPUs per node than this node has (CPU processes are not limited; ``available_gpus`` None:
    not checked, e.g. under ``trainer=auto``, whose processes share the GPUs then)."""
    if trainer.get("accelerator") in GPU_NAMES and available_gpus is not None:
        devices = int(trainer.get("devices", 1))
        if devices > available_gpus == 0:
            raise ConfigError(f"trainer.devices = {devices} GPUs but this node has no GPU; use trainer=cpu")
        if devices > available_gpus:
            gpus = f"{available_gpus} GPU{'s' if available_gpus > 1 else ''}"
            raise ConfigError(
                f"trainer.accelerator = {trainer['accelerator']} with trainer.devices = {devices} processes per node, "
                f"but this node has {gpus} (one GPU per process); either run fewer processes: "
                f"trainer.devices ≤ {available_gpus} with strategy.D (× strategy.W) to match, and trainer.num_nodes "
                f"for more nodes; or use trainer=auto to run the {devices} processes sharing the {gpus} over gloo "
                "(fine for trying schedules, not for speed)")


def check_drain_timeout(drain_timeout_s: Any) -> float:
    """``logger.drain_timeout_s`` (:class:`pipeline_recipes.recipe.background_logger.BackgroundWandbLogger`): a positive
    number of seconds."""
    if isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, (int, float)) or not drain_timeout_s > 0:
        raise ConfigError(f"logger.drain_timeout_s = {drain_timeout_s!r}: the longest wait for queued W&B rows must be "
                          "a positive number of seconds (default 300)")
    return float(drain_timeout_s)
