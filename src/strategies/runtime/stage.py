"""One stage copy on one rank: its layers, the graphs its forwards keep, its weight versions.

The executor (:mod:`pipeline_recipes.strategies.runtime.executor`) decides which stage runs what, in the schedule's order,
and moves messages; a :class:`PipelineStage` only computes. Each forward keeps what its backward
needs under a :data:`GraphKey`: the graph, or with recomputation (GPipe §2.3, re-materialization)
only the input and the RNG state. Backwards come whole (``B``) or split as in Zero Bubble
Pipeline Parallelism (Qi et al. 2024, §2): ``I`` runs the backward with the linear layers' weight
gradients deferred (:mod:`pipeline_recipes.strategies.compute.deferred_weights`) and returns the input gradient; ``W`` later
computes the deferred weight gradients, accumulated in ``.grad``. Asynchronous schedules run
forwards on the step's stashed weight version (:class:`~pipeline_recipes.strategies.runtime.versions.WeightVersions`,
PipeDream's weight stashing).

The activation bytes a forward keeps (the executor's stored-bytes figures) are counted by
saved-tensor hooks on the first forward of each input shape and reused for the next ones: a Python
hook on every saved tensor of every forward cost about 3.5 % of a stage's compute. Forwards on stashed
weight versions are counted every time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipeline_recipes.strategies.compute.deferred_weights import WeightGradientStore, defer_weight_gradients
from pipeline_recipes.core.pipeline_model import Batch, run_layers
from pipeline_recipes.strategies.schedules.effects import GraphKey
from pipeline_recipes.strategies.runtime.recompute import RngState, SavedBytes
from pipeline_recipes.strategies.runtime.versions import WeightVersions

LossFn = Callable[[Tensor, Batch], Tensor]  # the last stage's output → this micro-batch's loss share


@dataclass
class StoredBytes:
    """Activation bytes the rank's stages keep between forwards and their backwards, and the peak."""

    now: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


@dataclass
class _Saved:
    """What a forward keeps for its backward: the graph (``out``), or for recomputation only the
    input and the RNG state to replay it. ``split``: ``I`` ran, and the stage's weight store holds
    what ``W`` computes. The first stage splits its backward too (no input gradient leaves it, but ``I``
    computes the gradients inside it, as the Zero Bubble paper's costs assume)."""

    inp: Tensor | None
    out: Tensor | None
    rng: RngState | None
    nbytes: int
    split: bool = False


def _forward_shapes(inp: Tensor, batch: Batch, loss: LossFn | None, modules: Sequence[nn.Module],
                    parameters: Sequence[nn.Parameter]) -> tuple:
    """The key of a forward's saved-bytes count: the shapes and dtypes of its input and batch,
    whether it computes the loss, the autocast state, the layers' train/eval modes and which
    parameters are trained. A model whose saved tensors depend on the data itself (not its shapes)
    keeps the first forward's count."""
    device = inp.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    batch_shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()) if isinstance(v, Tensor))
    modes = tuple(m.training for m in modules)
    trained = tuple(p.requires_grad for p in parameters)
    return tuple(inp.shape), inp.dtype, batch_shapes, loss is not None, autocast, modes, trained


class PipelineStage:
    """Stage ``index`` of ``stages``: forward, backward, input and weight gradients of its layers."""

    def __init__(self, index: int, stages: int, layers: Sequence[nn.Module], *, recompute: bool = False,
                 versions: WeightVersions | None = None, stored: StoredBytes | None = None,
                 parameter_storages: frozenset[int] = frozenset(), split_backward: bool = False) -> None:
        """``stored`` is shared by the rank's stages; ``parameter_storages`` are the rank's weights (not
        activations); ``split_backward``: the schedule runs this stage's backwards as ``I`` + ``W``."""
        self.index, self.layers = index, list(layers)
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.recompute, self.versions = recompute, versions
        self.stored = stored if stored is not None else StoredBytes()
        self.parameter_storages = parameter_storages
        self.parameters = unique_parameters(self.layers)
        self.weight_store = WeightGradientStore()  # what I defers for W
        if split_backward:  # I walks the stage for the input-side gradients, W computes the weights'
            defer_weight_gradients(self.layers, self.weight_store)
        # what the saved-bytes key reads on every forward, listed once (no module tree walk per forward)
        self._all_modules = [m for layer in self.layers for m in layer.modules()]
        self._all_parameters = [p for layer in self.layers for p in layer.parameters()]
        self._graphs: dict[GraphKey, _Saved] = {}
        self._saved_bytes: dict[tuple, int] = {}  # activation bytes a forward keeps, per input/batch shapes

    @property
    def pending(self) -> list[GraphKey]:
        """Graphs kept for backwards that have not run (all done after a synchronous step)."""
        return sorted(self._graphs, key=str)

    def _run(self, inp: Tensor, batch: Batch, loss: LossFn | None, train: bool) -> Tensor:
        if self.versions is not None and train:
            with self.versions.forward_weights(self.index):  # the loss too: it may read the head's weights
                out = run_layers(self.layers, inp, batch)
                return loss(out, batch) if self.is_last and loss is not None else out
        out = run_layers(self.layers, inp, batch)
        return loss(out, batch) if self.is_last and loss is not None else out

    def forward(self, key: GraphKey, inp: Tensor, batch: Batch, loss: LossFn | None, train: bool) -> Tensor:
        """The stage's output (the last stage: its loss share); in training keeps what the backward needs."""
        if not train:
            return self._run(inp, batch, loss, train)
        if self.recompute:  # keep the input and the RNG state only (GPipe re-materialization)
            rng = RngState.capture(inp.device)
            with torch.no_grad():
                out = self._run(inp, batch, loss, train)
            forget_autocast_casts()
            kept = 0 if self.is_first else inp.numel() * inp.element_size()  # stage 0: the batch itself
            self._keep(key, _Saved(inp, None, rng, kept))
            return out
        if not self.is_first:
            inp = inp.detach().requires_grad_(True)
        shapes = None if self.versions is not None else _forward_shapes(inp, batch, loss, self._all_modules,
                                                                        self._all_parameters)
        nbytes = self._saved_bytes.get(shapes) if shapes is not None else None
        if nbytes is None:
            saved = SavedBytes(self.parameter_storages)
            with saved.track():
                out = self._run(inp, batch, loss, train)
            saved.add(out)
            nbytes = saved.nbytes
            if shapes is not None:
                self._saved_bytes[shapes] = nbytes
        else:  # these shapes were counted once: no saved-tensor hook on every op of every forward
            out = self._run(inp, batch, loss, train)
        self._keep(key, _Saved(None if self.is_first else inp, out, None, nbytes))
        return out

    def _keep(self, key: GraphKey, saved: _Saved) -> None:
        self._graphs[key] = saved
        self.stored.add(saved.nbytes)

    def _graph(self, key: GraphKey, batch: Batch, loss: LossFn | None, keep: bool) -> _Saved:
        """The saved graph of ``key``, re-materialised if it was recomputed; ``keep``: it stays saved
        (``I`` leaves it for ``W``)."""
        saved = self._graphs[key] if keep else self._graphs.pop(key)
        if not keep:
            self.stored.add(-saved.nbytes)
        if saved.rng is not None and saved.out is None and not saved.split:  # same RNG draws
            if not self.is_first:
                saved.inp = saved.inp.detach().requires_grad_(True)
            with saved.rng.replay(), torch.enable_grad():
                saved.out = self._run(saved.inp, batch, loss, True)
        return saved

    def backward(self, key: GraphKey, output_grad: Tensor | None, batch: Batch, loss: LossFn | None) -> Tensor | None:
        """``B``: input and weight gradients in one pass; returns the input gradient (None on the first stage)."""
        saved = self._graph(key, batch, loss, keep=False)
        torch.autograd.backward(saved.out, output_grad)
        return None if saved.inp is None else saved.inp.grad

    def input_gradient(self, key: GraphKey, output_grad: Tensor | None, batch: Batch,
                       loss: LossFn | None) -> Tensor | None:
        """``I``: the backward with the weight gradients the store defers kept for ``W``; returns the
        input gradient at once."""
        saved = self._graph(key, batch, loss, keep=True)
        with self.weight_store.deferring(key):
            torch.autograd.backward(saved.out, output_grad)
        saved.out, saved.split = None, True
        return None if saved.inp is None else saved.inp.grad

    def weight_gradient(self, key: GraphKey, batch: Batch, loss: LossFn | None) -> None:
        """``W``: the weight gradients ``I`` deferred, accumulated into ``.grad``."""
        self._graph(key, batch, loss, keep=False)
        self.weight_store.run(key)


def forget_autocast_casts() -> None:
    """Drop autocast's cached weight casts after a no-grad forward: made without autograd history,
    a later forward with gradients would reuse them and its weights would get no gradient
    (pytorch/pytorch#112583 on older torch). Autocast clears the cache itself when its region ends."""
    if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        torch.clear_autocast_cache()


def unique_parameters(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters of ``layers``, each once (a tied weight held by two layers counts once)."""
    seen: dict[int, nn.Parameter] = {}
    for layer in layers:
        for p in layer.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())
