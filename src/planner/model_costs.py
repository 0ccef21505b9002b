"""What the planner knows about a model on a device: per-layer costs and the communication constants.

A :class:`ModelCosts` is either *profiled* (:mod:`pipeline_recipes.planner.profile`: measured times and bytes on the
local device, cached as JSON) or *estimated* (:mod:`pipeline_recipes.planner.estimate`: parameter counts and the bytes
autograd would save, from a fake-tensor pass, no time) for the memory pre-flight.

Per layer, everything that depends on the micro-batch size ``B`` is a :class:`~pipeline_recipes.planner.costs.LinearFit`
through two profiled sizes (CAPTURE §III-A2, §III-B2):

* ``fwd``/``bwd``: seconds of the layer's forward / backward on one micro-batch; ``fwd_nograd``: the
  forward without building a graph, as a recomputed stage first runs it (zero: not profiled, the
  planner then charges ``fwd``);
* ``stored_alone`` (CAPTURE's M_i): bytes the layer keeps for its backward when it is alone on a
  stage, its output included; ``stored_added`` (M_a): the bytes it adds when it follows the previous
  layer on the same stage, so a stage of layers ``i..j`` keeps ``M_i(i) + Σ_{k=i+1..j} M_a(k)``
  (CAPTURE §III-B1);
* ``transient``: the extra peak above the stored bytes while the layer runs forward and backward
  (activation gradients, temporaries);
* ``out_bytes``: the activation it sends to the next stage (Chimera §3.4's message size ``L``).

``cast_bytes``: under mixed precision, autocast's cached half-precision copies of the layer's weights,
made once per autocast region (a training step) and kept by every graph until its backward: bytes
per rank and step, not per micro-batch ("Mixed Precision Training", Micikevicius et al., §3.1).

Model states (weights, gradients and AdamW's two moments) follow from ``param_bytes``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .costs import ZERO, AlphaBeta, LinearFit, rabenseifner
from .network import Network

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, fp32, per parameter


@dataclass(frozen=True)
class LayerCosts:
    name: str
    params: int  # distinct parameters of the layer (a tied weight counts in every layer holding it)
    param_bytes: int
    fwd: LinearFit = ZERO
    bwd: LinearFit = ZERO
    opt_s: float = 0.0  # AdamW step over the layer's parameters
    stored_alone: LinearFit = ZERO
    stored_added: LinearFit = ZERO
    transient: LinearFit = ZERO
    out_bytes: LinearFit = ZERO
    fwd_nograd: LinearFit = ZERO
    cast_bytes: int = 0  # autocast's weight copies (see the module docstring)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "params": self.params, "param_bytes": self.param_bytes,
                               "opt_s": self.opt_s, "cast_bytes": self.cast_bytes}
        for key in ("fwd", "bwd", "stored_alone", "stored_added", "transient", "out_bytes", "fwd_nograd"):
            out[key] = getattr(self, key).to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerCosts:
        fits = {k: LinearFit.from_json(data[k]) for k in ("fwd", "bwd", "stored_alone", "stored_added",
                                                           "transient", "out_bytes")}
        if "fwd_nograd" in data:
            fits["fwd_nograd"] = LinearFit.from_json(data["fwd_nograd"])
        return cls(str(data["name"]), int(data["params"]), int(data["param_bytes"]),
                   opt_s=float(data.get("opt_s", 0.0)), cast_bytes=int(data.get("cast_bytes", 0)), **fits)


@dataclass(frozen=True)
class CommCosts:
    """Measured with two gloo processes (:mod:`pipeline_recipes.planner.comm_profile`), or defaults.

    ``p2p``/``allreduce``: α–β constants (Chimera §3.4). ``action_s``: the runtime's own cost per
    scheduled action (executor bookkeeping, message posting) beyond the layers' compute; ``step_s``:
    its fixed cost per step (splitting, loss normalisers, the final loss all-reduce); ``hop_s``: its
    latency per message on the critical path beyond ``p2p`` (posting the send, waking the receiver).
    ``process_bytes``: host memory of one idle worker process (interpreter, torch), counted against
    host RAM on CPU. ``network``: a described cluster's links (:mod:`pipeline_recipes.planner.network`): messages
    and all-reduces then tell intra- from inter-node; ``None``: the measured ``p2p``/``allreduce`` for every pair.
    """

    p2p: AlphaBeta = AlphaBeta(5e-5, 1e-9)
    allreduce: AlphaBeta = AlphaBeta(5e-5, 1e-9)
    action_s: float = 0.0
    step_s: float = 0.0
    process_bytes: int = 0
    measured: bool = False
    hop_s: float = 0.0
    network: Network | None = None

    def p2p_s(self, nbytes: float, D: int) -> float:
        """One stage-boundary message of a ``D``-stage pipeline (at the inter-node link when the pipeline spans nodes)."""
        if self.network is None:
            return self.p2p(nbytes)
        return self.network.p2p(nbytes, self.network.pipeline_crosses_nodes(D))

    def allreduce_s(self, replicas: int, nbytes: float, *, D: int = 1, W: int = 1, copies: int = 1) -> float:
        """A gradient all-reduce over ``replicas`` = ``W·copies`` processes of a ``D``-stage layout (Chimera §3.4)."""
        if self.network is None:
            return rabenseifner(replicas, nbytes, self.allreduce.alpha, self.allreduce.beta)
        return self.network.allreduce(replicas, nbytes, self.network.members_per_node(D, W, copies))

    def to_json(self) -> dict[str, Any]:
        return {"p2p": self.p2p.to_json(), "allreduce": self.allreduce.to_json(), "action_s": self.action_s,
                "step_s": self.step_s, "process_bytes": self.process_bytes, "measured": self.measured,
                "hop_s": self.hop_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CommCosts:
        return cls(AlphaBeta.from_json(data["p2p"]), AlphaBeta.from_json(data["allreduce"]),
                   float(data.get("action_s", 0.0)), float(data.get("step_s", 0.0)),
                   int(data.get("process_bytes", 0)), bool(data.get("measured", False)),
                   float(data.get("hop_s", 0.0)))


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer costs of one model on one device, plus the device's communication constants.

    ``tied``: ``(first layer, last layer, bytes)`` of weights shared by two layers (GPT-2's tied
    embeddings): a rank holding both stores them once; two ranks holding them all-reduce them.
    ``kind``: ``"profile"`` (measured) or ``"estimate"`` (no timings).
    """

    model: str
    device: str
    layers: tuple[LayerCosts, ...]
    tied: tuple[tuple[int, int, int], ...] = ()
    comm: CommCosts = field(default_factory=CommCosts)
    kind: str = "profile"
    cores: int = 0  # CPU cores the ranks share (0: one accelerator per rank, no sharing)
    batch_sizes: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def with_comm(self, comm: CommCosts) -> ModelCosts:
        return replace(self, comm=comm)

    def stage_fwd(self, stage: range, B: float) -> float:
        return sum(self.layers[i].fwd.clamp(B) for i in stage)

    def stage_fwd_nograd(self, stage: range, B: float) -> float:
        """A recomputed stage's first forward (no graph); ``fwd`` where it was not profiled."""
        return sum((layer.fwd_nograd if layer.fwd_nograd != ZERO else layer.fwd).clamp(B)
                   for layer in (self.layers[i] for i in stage))

    def stage_bwd(self, stage: range, B: float) -> float:
        return sum(self.layers[i].bwd.clamp(B) for i in stage)

    def stage_stored(self, stage: range, B: float) -> float:
        """Bytes a stage keeps per micro-batch between forward and backward (CAPTURE §III-B1)."""
        if not len(stage):
            return 0.0
        first = self.layers[stage.start].stored_alone.clamp(B)
        return first + sum(self.layers[i].stored_added.clamp(B) for i in stage[1:])

    def stage_transient(self, stage: range, B: float) -> float:
        return max((self.layers[i].transient.clamp(B) for i in stage), default=0.0)

    def stage_out_bytes(self, stage: range, B: float) -> float:
        return self.layers[stage.stop - 1].out_bytes.clamp(B) if len(stage) else 0.0

    def stage_in_bytes(self, stage: range, B: float) -> float:
        return self.layers[stage.start - 1].out_bytes.clamp(B) if stage.start > 0 else 0.0

    def repeated_layers(self) -> frozenset[int]:
        """The layers with parameters whose kind (the name before its index: ``block.3`` → ``block``)
        occurs more than once: the transformer blocks, which ``model.compile`` and ``strategy.cuda_graphs``
        treat (:func:`pipeline_recipes.strategies.compute.compile.repeated_blocks` finds the same on the modules)."""
        kinds = [layer.name.split(".")[0] for layer in self.layers]
        counts = Counter(k for k, layer in zip(kinds, self.layers) if layer.params)
        return frozenset(i for i, k in enumerate(kinds) if counts[k] > 1 and self.layers[i].params)

    def graph_slot_bytes(self, stage: range, B: float) -> float:
        """One CUDA graph copy of a stage's repeated blocks at micro-batch ``B`` (``strategy.cuda_graphs``):
        its private memory pool keeps what the blocks save for backward, their outputs and their weights'
        gradients (the graphed backward's static outputs) whatever the allocator does elsewhere. On one
        H200 this came to 13.8 GiB predicted against 13.7 GiB measured for ``model=gpt2`` at micro-batch 4
        (BENCHMARKS.md §7)."""
        blocks = self.repeated_layers()
        return sum(self.layers[i].stored_alone.clamp(B) + self.layers[i].out_bytes.clamp(B)
                   + self.layers[i].param_bytes for i in stage if i in blocks)

    def cast_bytes(self, layers: set[int]) -> int:
        """Autocast's weight copies held for ``layers`` in one step."""
        return sum(self.layers[i].cast_bytes for i in layers)

    def stage_params(self, stage: range) -> int:
        return sum(self.layers[i].params for i in stage)

    def stage_param_bytes(self, stage: range) -> int:
        return sum(self.layers[i].param_bytes for i in stage)

    def stage_sync_bytes(self, stage: range) -> int:
        """Bytes of the stage's own gradient all-reduce: its parameters less the tied weights it
        holds (those are all-reduced over the tied group)."""
        return self.stage_param_bytes(stage) - self.tied_bytes(set(stage))

    def shared_bytes(self, layers: set[int]) -> int:
        """Bytes of tied weights counted twice in ``layers`` (both holders present): subtract once."""
        return sum(b for i, j, b in self.tied if i in layers and j in layers)

    def tied_bytes(self, layers: set[int]) -> int:
        """Bytes of tied weights held by any layer in ``layers`` (all-reduced over the tied group)."""
        return sum(b for i, j, b in self.tied if i in layers or j in layers)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "kind": self.kind, "cores": self.cores,
                "batch_sizes": list(self.batch_sizes), "tied": [list(t) for t in self.tied],
                "comm": self.comm.to_json(), "layers": [layer.to_json() for layer in self.layers],
                "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelCosts:
        return cls(str(data["model"]), str(data["device"]), tuple(LayerCosts.from_json(x) for x in data["layers"]),
                   tuple((int(i), int(j), int(b)) for i, j, b in data.get("tied", [])),
                   CommCosts.from_json(data["comm"]) if "comm" in data else CommCosts(),
                   str(data.get("kind", "profile")), int(data.get("cores", 0)),
                   tuple(int(b) for b in data.get("batch_sizes", [])), dict(data.get("meta", {})))


def uniform_costs(num_layers: int, *, t_f: float = 1.0, t_b: float = 2.0, params: int = 1000,
                  stored: float = 1000.0, out: float = 100.0, transient: float = 0.0,
                  comm: CommCosts | None = None, bytes_per_param: int = 4) -> ModelCosts:
    """Synthetic costs: every layer alike, everything proportional to ``B`` (tests, examples)."""
    layer = LayerCosts("layer", params, params * bytes_per_param, LinearFit(0.0, t_f), LinearFit(0.0, t_b), 0.0,
                       LinearFit(0.0, stored), LinearFit(0.0, stored), LinearFit(0.0, transient), LinearFit(0.0, out))
    layers = tuple(replace(layer, name=f"layer.{i}") for i in range(num_layers))
    return ModelCosts("uniform", "synthetic", layers, comm=comm or CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0)))


def layer_names(costs: ModelCosts) -> list[str]:
    return [layer.name for layer in costs.layers]


def stage_of_layers(partition: Sequence[range]) -> dict[int, int]:
    return {i: s for s, stage in enumerate(partition) for i in stage}
