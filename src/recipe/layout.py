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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"layout: {self.strategy}  W={self.W} replicas × D={self.D} stages = {self.world_size} processes; "
            f"B={self.B} × N={self.N} micro-batches × W={self.W} = global batch {self.global_batch_size}"
            + (f"; {self.pipelines} pipelines" if self.pipelines > 1 else "")
        )


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}; set {name}=1 or more")
    return value


def resolve_layout(strategy: dict[str, Any], trainer: dict[str, Any], global_batch_size: int, num_layers: int) -> Layout:
    """Derive W and N and check every rule of the pipeline layout."""
    name = str(strategy.get("name", "gpipe"))
    devices = trainer.get("devices", 1)
    if devices == "auto" or devices == -1:
        raise ConfigError("trainer.devices must be a number for pipeline runs (W·D must be known before launch)")
    world = _positive("trainer.devices", devices) * _positive("trainer.num_nodes", trainer.get("num_nodes", 1))
    D = _positive("strategy.D", strategy.get("D"))
    B = _positive("strategy.micro_batch_size", strategy.get("micro_batch_size"))
    _positive("data.global_batch_size", global_batch_size)
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
    if D > num_layers:
        raise ConfigError(f"strategy.D = {D} stages but the model has only {num_layers} pipeline layers; use D ≤ {num_layers}")
    if global_batch_size % (W * B):
        raise ConfigError(
            f"data.global_batch_size = {global_batch_size} is not divisible by W·B = {W}·{B} = {W * B}; "
            f"use a multiple of {W * B} (N = global_batch_size / (W·B) micro-batches per step)"
        )
    pipelines = 1
    if name == "chimera":
        if D % 2:
            raise ConfigError(f"chimera needs an even strategy.D (two pipelines merge without conflict), got {D}; use D = {D + 1} or {max(D - 1, 2)}")
        pipelines = strategy.get("pipelines") or 2
        valid = [2 * f for f in range(1, D // 2 + 1) if (D // 2) % f == 0]
        if pipelines not in valid:
            raise ConfigError(f"strategy.pipelines = {pipelines} must be 2f for a divisor f of D/2 = {D // 2}; choose one of {valid}")
    return Layout(name, world, W, D, B, global_batch_size // (W * B), global_batch_size, pipelines)
