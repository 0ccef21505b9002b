"""CUDA graphs for pipeline stages (``strategy.cuda_graphs``): each repeated block's forward and backward
captured once per micro-batch slot and replayed, so that a small micro-batch costs a few graph launches
instead of a few hundred kernel launches.

CUDA graphs (Gray, "Getting Started with CUDA Graphs", NVIDIA Technical Blog, 2019; in PyTorch
``torch.cuda.CUDAGraph``) replay a recorded sequence of kernels on the addresses they were recorded on. What
is captured is each repeated block this rank holds
(:func:`~pipeline_recipes.strategies.compute.compile.compile_target`: the transformer layer, compiled or not,
``model.compile``), with :func:`torch.cuda.make_graphed_callables`: one autograd node whose
forward replays the block's forward graph and whose backward replays its backward graph (input and weight
gradients). The embedding, the head with the loss, the masks and every message stay eager, so nothing
captured depends on a step's loss normalisers, learning rate or communication; dropout draws from the
generator's graph-safe offsets, fresh on every replay.

Why ``make_graphed_callables`` per slot and not ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees):
a pipeline stage runs several micro-batches' forwards before their backwards (GPipe all N, 1F1B up to D − s
on stage s: PipeDream-Flush, Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021).
Graph trees start a new generation at the next compiled call once *one* backward has run
(``CUDAGraphTreeManager.can_start_new_generation``: "Instead we wait for a single backward invocation"), which
frees the outputs of the forwards still waiting for theirs: 1F1B's forward after its first backward would
invalidate the micro-batches in flight. A graphed callable instead overwrites its static outputs and saved
activations on every replay, so each (stage, slot) gets its own copy of the stage's graphs in its own memory
pool, and a slot is reused only after the backward of the micro-batch that held it. The slots a stage needs
are the most micro-batches it holds at once, read off the schedule's action list (:func:`slots_needed`).

What cannot be captured is refused before launch
(:func:`~pipeline_recipes.strategies.compute.cuda_graph_rules.cuda_graphs_error`, and CUDA devices by
:func:`pipeline_recipes.recipe.check.settings.cuda_graphs_device_error`):
CPU runs, asynchronous schedules (their weight versions swap parameter storage), recomputation (a no-grad
forward replayed later under the saved RNG state), split backwards (``W`` would find its weight gradients
already computed inside the captured backward: Zero Bubble Pipeline Parallelism, Qi et al. 2024, §2) and
halved backwards (half-micro-batches of another shape). At run time a micro-batch whose shapes differ from
the captured ones is refused with both shapes (:class:`ShapeChanged`). Autocast must run with
``cache_enabled=False`` (Lightning's ``bf16-mixed`` does), as ``make_graphed_callables`` requires.

The first training step of a shape runs eagerly and records each block's call; the graphs are captured at
the start of the next step, before any message of that step is posted (capturing synchronises the device,
which would wait for a posted receive).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from pipeline_recipes.strategies.compute.compile import compile_target
from pipeline_recipes.strategies.compute.deferred_weights import is_deferring
from pipeline_recipes.strategies.schedules import Schedule
from pipeline_recipes.strategies.schedules.simulate import slots_needed

WARMUP_ITERS = 3  # make_graphed_callables' warm-up passes before capture (its default)
SHAPE_FIX = ("keep every micro-batch of one shape: pad to a fixed model.seq_len and set data.drop_last=true, "
             "or set strategy.cuda_graphs=false")


class ShapeChanged(RuntimeError):
    """A micro-batch reached a captured block with shapes other than those its graphs were captured for."""


def _is_graph_value(value: Any) -> bool:
    """A tensor, or a tuple of tensors (rotary embeddings): what a graph takes as an input."""
    if isinstance(value, Tensor):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(isinstance(v, Tensor) for v in value)


def _shape_of(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (tuple(value.shape), str(value.dtype).removeprefix("torch."), value.requires_grad)
    return tuple(_shape_of(v) for v in value)


def _constant(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass(frozen=True)
class CallPlan:
    """One call of a block: which arguments go into the graph (``graph_keys``: positional indices and keyword
    names, in order) and which stay constants of the graph (None masks, flags); ``signature``: what must match
    for a replay (their shapes, dtypes, ``requires_grad``, the constants and the autocast state)."""

    positional: int
    graph_keys: tuple[int | str, ...]
    constants: tuple[tuple[int | str, Any], ...]
    signature: tuple

    @classmethod
    def of(cls, args: tuple, kwargs: Mapping[str, Any], device: torch.device) -> tuple[CallPlan, tuple]:
        """The plan of ``block(*args, **kwargs)`` and the values it passes to the graph."""
        items = [*enumerate(args), *kwargs.items()]
        graph = [(k, v) for k, v in items if _is_graph_value(v)]
        constants = tuple((k, v) for k, v in items if not _is_graph_value(v))
        kind = device.type
        autocast = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        signature = (tuple((k, _shape_of(v)) for k, v in graph), tuple((k, _constant(v)) for k, v in constants),
                     str(autocast))
        return cls(len(args), tuple(k for k, _ in graph), constants, signature), tuple(v for _, v in graph)

    def describe(self) -> str:
        graph, _, autocast = self.signature
        parts = [f"{k if isinstance(k, str) else 'input' if k == 0 else f'argument {k}'}: {_words(s)}"
                 for k, s in graph]
        return ", ".join(parts) + (f" (autocast {autocast.removeprefix('torch.')})" if autocast != "None" else "")


def _words(shape: Any) -> str:
    if not (len(shape) == 3 and isinstance(shape[1], str)):  # a tuple of tensors
        return "(" + ", ".join(_words(s) for s in shape) + ")"
    dims, dtype, _ = shape
    return f"{dtype}[{'×'.join(map(str, dims))}]"


class _Call(nn.Module):
    """``block(*args, **kwargs)`` rebuilt from the graph's inputs and the plan's constants: the module
    :func:`torch.cuda.make_graphed_callables` captures (its parameters are the block's)."""

    def __init__(self, block: nn.Module, call: Callable[..., Any], plan: CallPlan) -> None:
        super().__init__()
        self.block = block
        self._call, self._plan = call, plan

    def forward(self, *values: Any) -> Any:
        slots: dict[int | str, Any] = dict(self._plan.constants)
        slots.update(zip(self._plan.graph_keys, values))
        args = [slots.pop(i) for i in range(self._plan.positional)]
        return self._call(self.block, *args, **slots)


@dataclass
class BlockGraphs:
    """One block's graphs: the call recorded in the first (eager) training step, then one graphed copy per
    slot of its stage; ``busy[k]``: slot ``k`` holds a micro-batch whose backward has not run."""

    block: nn.Module
    stage: int
    call: Callable[..., Any]  # the block class's own __call__ (compiled where model.compile compiled it)
    plan: CallPlan | None = None
    sample: tuple | None = None  # the recorded call's values (detached copies), until captured
    slots: list[Callable[..., Any]] = field(default_factory=list)
    busy: list[bool] = field(default_factory=list)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if not (block.training and torch.is_grad_enabled()):  # evaluation, shape probes: eager
            return self.call(block, *args, **kwargs)
        device = next(block.parameters()).device
        plan, values = CallPlan.of(args, kwargs, device)
        if self.plan is None:  # the first training call: recorded, run eagerly
            self.plan = plan
            self.sample = tuple(_detached_copy(v) for v in values)
            return self.call(block, *args, **kwargs)
        if plan.signature != self.plan.signature:
            raise ShapeChanged(f"strategy.cuda_graphs = true: a micro-batch reached stage {self.stage}'s "
                               f"{type(block).__name__} with {plan.describe()}, but its CUDA graphs are for "
                               f"{self.plan.describe()}; a captured graph replays one shape only. {SHAPE_FIX}")
        if not self.slots:  # recorded in this step: captured at the next one
            return self.call(block, *args, **kwargs)
        slot = next((k for k, busy in enumerate(self.busy) if not busy), None)
        if slot is None:
            raise RuntimeError(f"stage {self.stage}: more micro-batches in flight than the {len(self.slots)} "
                               "CUDA graph slots its schedule needs (strategy.cuda_graphs)")
        for value in values:  # the stage's input: its gradient must outlive the slot's next replay
            if isinstance(value, Tensor) and value.requires_grad and value.grad_fn is None:
                value.register_hook(torch.clone)
        out = self.slots[slot](*values)
        node = next((t.grad_fn for t in torch.utils._pytree.tree_leaves(out)
                     if isinstance(t, Tensor) and t.grad_fn is not None), None)
        if node is not None:  # no graph to free in a forward without gradients
            self.busy[slot] = True
            node.register_hook(lambda *_: self._free(slot))
        return out

    def _free(self, slot: int) -> None:
        self.busy[slot] = False


def _detached_copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return tuple(_detached_copy(v) for v in value)


def _dispatch(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    graphs = self.__dict__.get("_stage_graphs")
    if graphs is None:  # switched off (StageGraphs.switch)
        return type(self).base_call(self, *args, **kwargs)
    return graphs(*args, **kwargs)


_GRAPHED_CLASSES: dict[type, type] = {}


def _graphed_class(cls: type) -> type:
    """``cls`` with its calls routed through the block's :class:`BlockGraphs` (parameters, names and
    ``state_dict`` keys stay those of ``cls``)."""
    if cls not in _GRAPHED_CLASSES:
        _GRAPHED_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _dispatch, "base_call": cls.__call__,
                                                            "__module__": cls.__module__,
                                                            "__qualname__": cls.__qualname__})
    return _GRAPHED_CLASSES[cls]


@contextmanager
def thread_local_capture() -> Iterator[None]:
    """Captures inside it forbid unsafe CUDA calls in this thread only (``capture_error_mode="thread_local"``,
    as CUDA graph trees capture): under the default ``global`` mode a data loader's pin-memory thread
    allocating pinned memory during a capture would make it fail. ``make_graphed_callables`` builds its
    ``torch.cuda.graph`` contexts without the argument, so the default is set around it."""
    graph = torch.cuda.graph

    def thread_local(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("capture_error_mode", "thread_local")
        return graph(*args, **kwargs)

    torch.cuda.graph = thread_local
    try:
        yield
    finally:
        torch.cuda.graph = graph


class StageGraphs:
    """The CUDA graphs of this rank's repeated blocks (see the module docstring): :meth:`before_step` at the
    start of every synchronous training step captures what the previous step recorded."""

    def __init__(self, stage_layers: Mapping[int, Sequence[nn.Module]], layers: Sequence[nn.Module],
                 blocks: Iterable[int], worker: int, report: Callable[[str], None] | None = None) -> None:
        """``layers``: the model's pipeline layers; ``blocks``: the indices of its repeated blocks (listed before
        a pipeline drops the other ranks' layers, :func:`~pipeline_recipes.strategies.compute.compile.repeated_blocks`);
        ``report``: where the line saying what was captured goes."""
        wanted = {id(layers[i]) for i in blocks}
        self.worker, self.report = worker, report
        self.blocks: list[BlockGraphs] = []
        for stage in sorted(stage_layers):
            for layer in stage_layers[stage]:
                if id(layer) not in wanted or not any(True for _ in layer.parameters()):
                    continue
                target = compile_target(layer)
                if any(is_deferring(m) for m in target.modules()):
                    raise ValueError(f"stage {stage} defers its weight gradients to W (a split backward): its "
                                     "blocks cannot be captured; set strategy.cuda_graphs=false")
                base = type(target)
                if base in _GRAPHED_CLASSES.values():  # routed already (another StageGraphs on the same blocks)
                    base = base.__mro__[1]
                self.blocks.append(BlockGraphs(target, stage, base.__call__))
                target.__class__ = _graphed_class(base)
        self.captured: dict[int, int] = {}  # stage → slots captured
        self.switch(True)

    def switch(self, on: bool) -> None:
        """Route the blocks' calls through these graphs (``on``), or straight to the blocks (a benchmark's eager
        rows share the block modules)."""
        for graphs in self.blocks:
            if on:
                graphs.block.__dict__["_stage_graphs"] = graphs
            else:
                graphs.block.__dict__.pop("_stage_graphs", None)

    @contextmanager
    def switched_on(self) -> Iterator[None]:
        self.switch(True)
        try:
            yield
        finally:
            self.switch(False)

    def parameters(self) -> list[nn.Parameter]:
        return [p for g in self.blocks for p in g.block.parameters() if p.requires_grad]

    def before_step(self, schedule: Schedule) -> None:
        """A synchronous step starts with no graph pending: every slot is free. Blocks recorded in the last
        step are captured now, outside any communication, ``slots_needed`` copies per stage. Every trained
        parameter of a captured block gets a ``.grad`` to accumulate into (a gradient taken over as ``.grad``
        would be a graph's output buffer, overwritten by the next replay)."""
        for graphs in self.blocks:
            graphs.busy = [False] * len(graphs.slots)
        pending = [g for g in self.blocks if g.sample is not None]
        if pending:
            self._capture(pending, slots_needed(schedule, self.worker))
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _capture(self, pending: list[BlockGraphs], slots: Mapping[int, int]) -> None:
        by_stage: dict[int, list[BlockGraphs]] = {}
        for graphs in pending:
            by_stage.setdefault(graphs.stage, []).append(graphs)
        for stage, group in by_stage.items():
            for _ in range(slots.get(stage, 0)):  # one memory pool per slot: its blocks' forwards, then backwards
                calls = tuple(_Call(g.block, g.call, g.plan) for g in group)
                samples = tuple(tuple(_detached_copy(v) for v in g.sample) for g in group)
                with thread_local_capture():
                    graphed = torch.cuda.make_graphed_callables(calls, samples, num_warmup_iters=WARMUP_ITERS,
                                                                allow_unused_input=True)
                for g, call in zip(group, graphed):
                    g.slots.append(call)
                    g.busy.append(False)
            for g in group:
                g.sample = None
            self.captured[stage] = slots.get(stage, 0)
        if self.report is not None:
            self.report(self.describe())

    def describe(self) -> str:
        """One line: what was captured on this rank."""
        if not self.captured:
            return (f"strategy.cuda_graphs: {len(self.blocks)} repeated block{'s' if len(self.blocks) != 1 else ''} "
                    "on this rank, captured at the second training step (the first records their calls)")
        stages = "; ".join(f"stage {s}: {sum(g.stage == s for g in self.blocks)} blocks × {n} slot"
                           f"{'s' if n != 1 else ''}" for s, n in sorted(self.captured.items()))
        plan = next(g.plan for g in self.blocks if g.plan is not None)
        return (f"strategy.cuda_graphs: forward and backward of each repeated block captured per micro-batch slot "
                f"({stages}) for {plan.describe()}")


__all__ = ["BlockGraphs", "CallPlan", "ShapeChanged", "StageGraphs", "slots_needed"]
