"""A cluster the planner plans for without running on it: the ``conf/cluster/`` Hydra group, validated.

Chimera §3.4 predicts a layout from per-stage compute times and the α–β constants of the network; on a machine that
is not this one those come from a description instead of a measurement: devices per node, device and host memory,
peak FLOP/s per precision, the intra- and inter-node links (bandwidth and latency: the α–β model's ``1/β`` and
``α``), the all-reduce algorithm (:mod:`pipeline_recipes.planner.network` turns them into times) and what a
device loses to memory the estimate does not count: ``reserved_memory`` outside torch's allocator and the caching
allocator's ``allocator_overhead``.

``cluster=local`` (the default) describes nothing: ``measure`` is true and the planner profiles this machine as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline_recipes.core.errors import ConfigError

from .costs import AlphaBeta, parse_bytes
from .model_costs import CommCosts
from .network import Network

ALLREDUCE_ALGORITHMS = ("rabenseifner", "ring", "hierarchical")
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


def _refuse(key: str, value: Any, rule: str, fix: str) -> ConfigError:
    return ConfigError(f"cluster.{key}={value!r}: {rule}. Fix: {fix}")


def _positive(key: str, value: Any, fix: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _refuse(key, value, "must be a positive number", fix) from None
    if not math.isfinite(number) or number <= 0:
        raise _refuse(key, value, "must be a positive number", fix)
    return number


def _size(key: str, value: Any) -> int:
    fix = f"give a size such as 16GiB or 80GB in conf/cluster/<name>.yaml or cluster.{key}=16GiB"
    try:
        nbytes = parse_bytes(value)
    except (TypeError, ValueError):
        raise _refuse(key, value, "must be a memory size", fix) from None
    if nbytes <= 0:
        raise _refuse(key, value, "must be a positive memory size", fix)
    return nbytes


@dataclass(frozen=True)
class Link:
    """One kind of link between two devices: ``bandwidth_GBps`` (10⁹ bytes/s, per device and direction when every
    device sends at once) and ``latency_us``; as the α–β model of Chimera §3.4, ``α = latency``, ``β = 1/bandwidth``."""

    bandwidth_GBps: float
    latency_us: float

    @property
    def alpha_beta(self) -> AlphaBeta:
        return AlphaBeta(self.latency_us * 1e-6, 1.0 / (self.bandwidth_GBps * 1e9))

    @classmethod
    def from_config(cls, key: str, data: Any) -> Link:
        if not isinstance(data, Mapping):
            raise _refuse(key, data, "must be a mapping with bandwidth_GBps and latency_us",
                          f"write cluster.{key}: {{bandwidth_GBps: 50.0, latency_us: 8.0}}")
        unknown = set(data) - {"bandwidth_GBps", "latency_us"}
        if unknown:
            raise _refuse(key, dict(data), f"has unknown keys {sorted(unknown)}", "keep only bandwidth_GBps and latency_us")
        bandwidth = _positive(f"{key}.bandwidth_GBps", data.get("bandwidth_GBps"),
                              f"set cluster.{key}.bandwidth_GBps to the link's GB/s per device (e.g. 50.0)")
        latency = data.get("latency_us")
        try:
            latency_us = float(latency)
        except (TypeError, ValueError):
            raise _refuse(f"{key}.latency_us", latency, "must be a number of microseconds >= 0",
                          f"set cluster.{key}.latency_us (e.g. 8.0)") from None
        if not math.isfinite(latency_us) or latency_us < 0:
            raise _refuse(f"{key}.latency_us", latency, "must be a number of microseconds >= 0",
                          f"set cluster.{key}.latency_us (e.g. 8.0)")
        return cls(bandwidth, latency_us)


@dataclass(frozen=True)
class ClusterSpec:
    """A validated ``conf/cluster/<name>.yaml`` (see the module docstring). A ``measure`` cluster has no figures."""

    name: str
    measure: bool
    device: str = ""
    devices_per_node: int = 1
    device_memory: int = 0
    host_memory: int = 0
    peak_tflops: Mapping[str, float] = field(default_factory=dict)
    intra_node: Link | None = None
    inter_node: Link | None = None
    allreduce: str = "rabenseifner"
    cost_table: str | None = None
    reserved_memory: int = 0  # bytes per device outside torch's allocator (CUDA context, library handles)
    allocator_overhead: float = 0.0  # the caching allocator's reserve beyond the estimated tensors, as a fraction

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s of one device at ``precision``; fp32 where the device has no such unit."""
        tflops = self.peak_tflops.get(precision, self.peak_tflops.get("fp32", 0.0))
        return tflops * 1e12

    def network(self) -> Network:
        """The links and the all-reduce algorithm (:mod:`pipeline_recipes.planner.network`)."""
        if self.measure or self.intra_node is None or self.inter_node is None:
            raise ValueError(f"cluster {self.name} is measured, not described: it has no network figures")
        return Network(self.devices_per_node, self.intra_node.alpha_beta, self.inter_node.alpha_beta, self.allreduce)

    def comm_costs(self) -> CommCosts:
        """The planner's communication constants on this cluster: the network's links, no runtime overheads (the
        executor's per-action cost was measured on CPU ranks only)."""
        inter = self.network().inter
        return CommCosts(p2p=inter, allreduce=inter, measured=False, network=self.network())

    def nodes(self, devices: int) -> int:
        return -(-devices // self.devices_per_node)

    @classmethod
    def from_config(cls, cfg: Any) -> ClusterSpec:
        """Validate the composed ``cfg.cluster`` (a DictConfig or a mapping); a bad value raises
        :class:`~pipeline_recipes.core.errors.ConfigError` naming the key, the value, the rule and the fix."""
        data = _as_dict(cfg)
        name = str(data.get("name") or "")
        if not name:
            raise _refuse("name", data.get("name"), "must be set", "give the cluster a name (its yaml file's)")
        algorithm = data.get("allreduce", "rabenseifner")
        if algorithm not in ALLREDUCE_ALGORITHMS:
            raise _refuse("allreduce", algorithm, f"must be one of {', '.join(ALLREDUCE_ALGORITHMS)}",
                          "pick the collective library's algorithm (NCCL across nodes: hierarchical)")
        measure = data.get("measure", False)
        if not isinstance(measure, bool):
            raise _refuse("measure", measure, "must be true or false", "true only for cluster=local")
        if measure:
            return cls(name, True, allreduce=algorithm)
        per_node = data.get("devices_per_node")
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise _refuse("devices_per_node", per_node, "must be a whole number >= 1", "set cluster.devices_per_node=8")
        peaks = data.get("peak_tflops")
        if not isinstance(peaks, Mapping) or not peaks:
            raise _refuse("peak_tflops", peaks, f"must map precisions ({', '.join(PRECISIONS)}) to TFLOP/s",
                          "write cluster.peak_tflops: {fp32: 67.0, bf16: 989.4}")
        unknown = sorted(set(peaks) - set(PRECISIONS))
        if unknown:
            raise _refuse("peak_tflops", dict(peaks), f"must name only known precisions ({', '.join(PRECISIONS)}), not {unknown}",
                          "name each unit by one of the known precisions")
        if "fp32" not in peaks:
            raise _refuse("peak_tflops", dict(peaks), "must include fp32 (the fallback of every other precision)",
                          "add cluster.peak_tflops.fp32")
        tflops = {k: _positive(f"peak_tflops.{k}", v, f"set cluster.peak_tflops.{k} to the datasheet's dense TFLOP/s")
                  for k, v in peaks.items()}
        table = data.get("cost_table")
        memory = _size("device_memory", data.get("device_memory"))
        reserved = _size("reserved_memory", data["reserved_memory"]) if data.get("reserved_memory") else 0
        if reserved >= memory:
            raise _refuse("reserved_memory", data.get("reserved_memory"),
                          f"must be less than device_memory ({data.get('device_memory')})",
                          "give what one process's CUDA context holds, e.g. 512MiB")
        overhead = data.get("allocator_overhead", 0.0)
        if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 <= overhead < 1:
            raise _refuse("allocator_overhead", overhead, "must be a fraction in [0, 1)",
                          "set cluster.allocator_overhead=0.09 (the caching allocator's reserve beyond the tensors)")
        return cls(name, False, str(data.get("device") or name), per_node, memory,
                   _size("host_memory", data.get("host_memory")), tflops,
                   Link.from_config("intra_node", data.get("intra_node")),
                   Link.from_config("inter_node", data.get("inter_node")), algorithm,
                   str(table) if table else None, reserved, float(overhead))


def _as_dict(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {"name": "local", "measure": True}
    if not isinstance(cfg, Mapping):
        try:
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        except ValueError as err:
            raise ConfigError(f"cluster: cannot read the description ({err}). Fix: pick one of conf/cluster/") from None
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"cluster={cfg!r}: must be a mapping. Fix: pick one of conf/cluster/ (cluster=dgx-h100)")
    return dict(cfg)
