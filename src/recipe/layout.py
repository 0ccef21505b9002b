"""The run's layout (Chimera Table 1: W, D, B, N, B̂), derived once and checked before launch.

Every rule names the settings, their values and a fix, so a bad combination stops with one
message before any process starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class ConfigError(ValueError):
    """An invalid combination of settings, explained."""


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
            f"layout: {self.label}  W={self.W} replicas × D={self.D} stages = {self.world_size} processes; "
            f"B={self.B} × N={self.N} micro-batches × W={self.W} = global batch {self.global_batch_size}"
            + (f"; {self.pipelines} pipelines" if self.pipelines > 1 else "")
            + (f"; concat=auto → {self.concat}" if self.concat_auto else "")
        )


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
                          "(or pick a pipeline strategy: gpipe, dapple, gems, chimera, pipedream_2bw, pipedream)")
    if name == "single" and world != 1:
        raise ConfigError(f"strategy=single runs one process but trainer.devices × trainer.num_nodes = {world}; "
                          "set trainer.devices=1 trainer.num_nodes=1 (or use strategy=ddp)")
    if global_batch_size % world:
        raise ConfigError(f"data.global_batch_size = {global_batch_size} is not divisible by the W = {world} "
                          f"replicas of strategy={name}; use a multiple of {world}")
    return Layout(name, world, world, 1, global_batch_size // world, 1, global_batch_size, 1)


def resolve_layout(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int) -> Layout:
    """Derive W and N and check every rule of the pipeline layout."""
    name = str(strategy.get("name", "gpipe"))
    _check_trainer_keys(trainer)
    devices = trainer.get("devices", 1)
    if devices == "auto" or devices == -1:
        raise ConfigError("trainer.devices must be a number for pipeline runs (W·D must be known before launch)")
    world = _positive("trainer.devices", devices) * _positive("trainer.num_nodes", trainer.get("num_nodes", 1))
    D = _positive("strategy.D", strategy.get("D"))
    _positive("data.global_batch_size", global_batch_size)
    if name in BASELINES:
        return _baseline_layout(name, world, D, global_batch_size)
    one_per_update = name == "pipedream" and strategy.get("micro_batch_size") is None  # B = B̂ / W: N = 1
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
        if global_batch_size % W:
            raise ConfigError(f"data.global_batch_size = {global_batch_size} is not divisible by the W = {W} replicas; "
                              f"use a multiple of {W} (strategy=pipedream takes B = global batch / W, N = 1)")
        B = global_batch_size // W
    if D > num_layers:
        raise ConfigError(f"strategy.D = {D} stages but the model has only {num_layers} pipeline layers; use D ≤ {num_layers}")
    if global_batch_size % (W * B):
        raise ConfigError(
            f"data.global_batch_size = {global_batch_size} is not divisible by W·B = {W}·{B} = {W * B}; "
            f"use a multiple of {W * B} (N = global_batch_size / (W·B) micro-batches per step)"
        )
    if name in ("pipedream_2bw", "pipedream") and (strategy.get("grad_sync", "end"), strategy.get("recompute", "none")) \
            != ("end", "none"):
        raise ConfigError(f"strategy={name} stashes weight versions per step and runs with strategy.grad_sync=end and "
                          f"strategy.recompute=none, got {strategy.get('grad_sync')} and {strategy.get('recompute')}; "
                          "drop those overrides")
    pipelines = 2 if name == "gems" else 1
    if name == "gems" and D % 2:
        raise ConfigError(f"gems needs an even strategy.D (each worker holds one stage of each of its two replicas), "
                          f"got {D}; use D = {D + 1} or {max(D - 1, 2)}")
    if name == "chimera":
        if D % 2:
            raise ConfigError(f"chimera needs an even strategy.D (two pipelines merge without conflict), got {D}; use D = {D + 1} or {max(D - 1, 2)}")
        pipelines = strategy.get("pipelines") or 2
        valid = [2 * f for f in range(1, D // 2 + 1) if (D // 2) % f == 0]
        if pipelines not in valid:
            raise ConfigError(f"strategy.pipelines = {pipelines} must be 2f for a divisor f of D/2 = {D // 2}; choose one of {valid}")
    N = global_batch_size // (W * B)
    requested = str(strategy.get("concat") or "direct") if name == "chimera" else "direct"
    concat = _resolve_concat(name, D, N, B, pipelines, requested)
    _check_schedule(name, D, N, B, pipelines, concat)
    return Layout(name, world, W, D, B, N, global_batch_size, pipelines, _variant(strategy, name, pipelines, concat),
                  concat, requested == "auto")


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


def _resolve_concat(name: str, D: int, N: int, B: int, pipelines: int, concat: str) -> str:
    """``strategy.concat=auto``: the method :func:`strategies.schedules.best_concat` picks for this layout,
    the same the workers' engines pick."""
    from pipeline_recipes.strategies.schedules import AUTO_CONCAT, CONCAT_METHODS, resolve_concat

    if concat not in (*CONCAT_METHODS, AUTO_CONCAT):
        raise ConfigError(f"strategy.concat = {concat!r} is not a concatenation method (Chimera §3.5); use one of "
                          f"{', '.join((*CONCAT_METHODS, AUTO_CONCAT))}")
    return resolve_concat(name, D, N, pipelines, B, concat)


def _check_schedule(name: str, D: int, N: int, B: int, pipelines: int, concat: str) -> None:
    """Build (and validate) the schedule the workers will run, so a bad combination stops here."""
    from pipeline_recipes.strategies.schedules import build_schedule, validate

    try:
        schedule = validate(build_schedule(name, D, N, pipelines if name == "chimera" else None,
                                           concat if name == "chimera" else "direct"))
    except ValueError as err:
        extra = f", concat = {concat}" if name == "chimera" else ""
        raise ConfigError(f"strategy={name} with D = {D}, N = {N} micro-batches{extra}: {err}") from err
    halved = any(a.half is not None for acts in schedule.workers for a in acts)
    if halved and B % 2:
        raise ConfigError(f"concat = backward_halving splits micro-batches in two halves, but strategy.micro_batch_size "
                          f"= {B} is odd; use an even micro_batch_size (e.g. {B + 1}) or concat = direct")


def _variant(strategy: dict[str, Any], name: str, pipelines: int, concat: str = "direct") -> str:
    parts = []
    if name == "chimera":
        if concat != "direct":
            parts.append(concat)
        if pipelines != 2:
            parts.append(f"{pipelines}pipes")
    if strategy.get("grad_sync", "end") != "end":
        parts.append(f"sync_{strategy['grad_sync']}")
    if strategy.get("recompute", "none") != "none":
        parts.append(f"recompute_{strategy['recompute']}")
    return "+".join(parts)


def check_model(model: dict[str, Any], data: dict[str, Any]) -> None:
    """Shapes the model cannot take: a sequence longer than its position table."""
    positions = model.get("n_positions", model.get("max_position_embeddings"))
    seq_len = data.get("seq_len", model.get("seq_len"))
    if positions is not None and seq_len is not None and int(seq_len) > int(positions):
        key = "model.n_positions" if "n_positions" in model else "model.max_position_embeddings"
        raise ConfigError(f"sequence length {seq_len} (model.seq_len / data.seq_len) exceeds the model's {positions} "
                          f"positions ({key}); set model.seq_len ≤ {positions} or raise {key}")


def check_devices(trainer: dict[str, Any], available_gpus: int | None) -> None:
    """More GPUs per node than this node has (CPU processes are not limited)."""
    if trainer.get("accelerator") in ("gpu", "cuda") and available_gpus is not None:
        devices = int(trainer.get("devices", 1))
        if devices > available_gpus == 0:
            raise ConfigError(f"trainer.devices = {devices} GPUs but this node has no GPU; use trainer=cpu")
        if devices > available_gpus:
            raise ConfigError(f"trainer.devices = {devices} GPUs per node but this node has {available_gpus}; "
                              f"set trainer.devices ≤ {available_gpus} (and trainer.num_nodes for more nodes), "
                              "or trainer=cpu")
