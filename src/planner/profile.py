"""Short profiling runs on the local device: per-layer time and memory at two micro-batch sizes.

Identical layers (same class and parameter shapes, :func:`layer_signature`: the transformer blocks)
cost the same, so only one layer per group runs (:class:`DistinctLayers`) and every member of the
group gets its costs: a 64-block model profiles an embedding, a block and a head. For each batch
size ``B`` in ``batch_sizes`` (two by default, CAPTURE §III-A2), the way
:class:`pipeline_recipes.strategies.runtime.executor.StageExecutor` runs a stage, the profiler measures:

* in a memory pass, from one forward + backward of each of those layers: the bytes autograd keeps
  for the backward alone (CAPTURE's M_i, :class:`pipeline_recipes.strategies.runtime.recompute.SavedBytes`), the peak
  allocation above them while forward and backward run (the transient: ``torch.cuda.max_memory_allocated``
  on GPUs, the profiler's CPU memory events otherwise) and the size of its output (the activation
  sent to the next stage); and, from one forward per pair of neighbouring groups (embedding → block,
  block → block, block → head), the bytes a layer adds after its predecessor (M_a = PM(l−1, l) −
  PM(l−1), §III-A1);
* the forward (under the executor's saved-tensor accounting), backward and graph-free forward (a
  recomputed stage's first pass) times: the lower quartile of the samples of round-robin rounds over
  all layers and batch sizes (so a burst of background load hits every layer and size alike and
  moves the fitted line's level, not its slope; a lower quantile, as load only slows samples down):
  at least ``MIN_ROUNDS``, at most ``reps`` within ``TIMING_SECONDS``, and more while a cheap model
  has not spent ``MIN_SECONDS`` per size;
* once, an AdamW step.

The model is built on the meta device and materialised (:mod:`pipeline_recipes.models.materialize`): whole, or, for a
model whose training state is large (:func:`layers_mode`), only the layers that run, so profiling
never needs the whole model in one process.

Every quantity is fitted with a line in ``B`` (:func:`pipeline_recipes.planner.costs.fit_line`). Communication
constants come from :mod:`pipeline_recipes.planner.comm_profile`; :func:`load_or_profile` caches both as JSON keyed by the
model config and the device (Chimera §3.4: "measured using micro benchmarks").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function

from pipeline_recipes.datamodules.synthetic import SyntheticBertDataset, SyntheticGPT2Dataset
from pipeline_recipes.models import build_model, preset
from pipeline_recipes.models.families import data_format
from pipeline_recipes.core.pipeline_model import call_layer, loss_counts, micro_batch_loss, run_layers
from pipeline_recipes.strategies.runtime.recompute import SavedBytes, parameter_storages

from .costs import AlphaBeta, fit_line, quantile
from .model_costs import CommCosts, LayerCosts, ModelCosts
from .parallel import available_cores

DEFAULT_CACHE = Path(os.environ.get("PIPELINE_RECIPES_CACHE", Path.home() / ".cache" / "pipeline-recipes")) / "planner"
PROFILE_VERSION = 5
MIN_SAMPLES = 24  # with MIN_SECONDS: a cheap model runs up to 20 × this many rounds until MIN_SECONDS have passed
MIN_SECONDS = 1.5  # per batch size: the timed rounds last at least this long × the sizes (spread over time)
PROFILE_QUANTILE = 0.25  # of the samples: background load only ever slows a sample down
PROGRESS_SECONDS = 10.0  # at most one progress line this often within the timed rounds
PROFILE_BATCH_SIZES = (1, 2)  # costs are fitted with a line in B through these (time, bytes: linear in B)
OPTIMIZER_STEPS = 3  # timed AdamW steps per distinct layer (the median; an AdamW step varies little)
MIN_ROUNDS = 1  # timed rounds before the time budget may stop them (a 1.4 B model's round lasts minutes)
TIMING_SECONDS = 30.0  # the timed rounds' budget: no round starts (after MIN_ROUNDS) that would end past it


def model_config_dict(model_cfg: Any) -> dict[str, Any]:
    """A plain dict of a model config (Hydra ``DictConfig``, mapping or preset name)."""
    if isinstance(model_cfg, str):
        return preset(model_cfg)
    if isinstance(model_cfg, DictConfig):
        return dict(OmegaConf.to_container(model_cfg, resolve=True))  # type: ignore[arg-type]
    return {str(k): v for k, v in dict(model_cfg).items()}


def device_description(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.machine()}:{platform.processor() or 'cpu'}:{available_cores()}cores:{threads}threads"


def cache_key(model_cfg: Mapping[str, Any], device: str, settings: Mapping[str, Any]) -> str:
    blob = json.dumps({"model": model_cfg, "device": device, "torch": torch.__version__, "v": PROFILE_VERSION,
                       **settings}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def make_batch(model: nn.Module, size: int, seed: int = 0) -> dict[str, Tensor]:
    """A synthetic mini-batch of ``size`` samples shaped like the training data of ``model`` (its family's data
    format, :func:`~pipeline_recipes.models.families.data_format`)."""
    vocab, seq = int(model.config.vocab_size), int(model.seq_len)
    if data_format(getattr(model, "family", "")) == "bert":
        data = SyntheticBertDataset(size, seq, vocab, seed=seed)
    else:
        data = SyntheticGPT2Dataset(size, seq, vocab, seed=seed)
    items = [data[i] for i in range(size)]
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unique(params: Iterator[nn.Parameter]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def layer_signature(layer: nn.Module, index: int, count: int) -> tuple:
    """Layers with equal signatures cost the same: type and parameter shapes (first/last kept apart)."""
    position = "first" if index == 0 else "last" if index == count - 1 else "middle"
    return (position, type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()))


def _identical_layers(layers: Sequence[nn.Module]) -> list[list[int]]:
    """Indices of the layers with equal :func:`layer_signature`, group by group."""
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault(layer_signature(layer, i, len(layers)), []).append(i)
    return list(groups.values())


class _LayerRunner:
    """Forward/backward of a group of consecutive layers as the executor runs a stage."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.layers = model.pipeline_layers()
        self.storages = parameter_storages(model.parameters())

    def loss(self, out: Any, batch: Mapping[str, Any]) -> Tensor:
        totals = {k: float(v) for k, v in loss_counts(self.model, batch).items()}
        return micro_batch_loss(self.model, out, batch, totals)

    def forward(self, first: int, last: int, x: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Any, int, bool]:
        """Run layers ``first..last``; return (input, output, saved bytes, whether the input is saved)."""
        return self.forward_seq(range(first, last + 1), x, batch)

    def forward_seq(self, indices: Sequence[int], x: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Any, int, bool]:
        """As :meth:`forward` for the layers ``indices`` one after the other (a layer may stand in for an
        identical one: ``[first block, head]`` measures the head after the last block)."""
        first, last = indices[0], indices[-1]
        inp = x.detach().requires_grad_(True) if first > 0 else x
        saved = SavedBytes(self.storages)
        with saved.track():
            out = run_layers([self.layers[k] for k in indices], inp, batch)
            if last == len(self.layers) - 1:
                out = self.loss(out, batch)
        saved.add(out)
        input_saved = first > 0 and (inp.data_ptr(), inp.numel()) in saved._seen
        if first == 0:
            input_saved = any(k[0] == x.data_ptr() for k in saved._seen)
        return inp, out, saved.nbytes, input_saved

    def forward_nograd(self, index: int, x: Tensor, batch: Mapping[str, Any]) -> Tensor:
        """Layer ``index`` without a graph, as a recomputed stage first runs it."""
        with torch.no_grad():
            out = run_layers(self.layers[index : index + 1], x, batch)
            return self.loss(out, batch) if index == len(self.layers) - 1 else out

    def forward_nograd_out(self, index: int, x: Tensor, batch: Mapping[str, Any]) -> Tensor:
        """Layer ``index``'s output without a graph (the next layer's input; no loss)."""
        with torch.no_grad():
            return call_layer(self.layers[index], x, batch)

    def backward(self, out: Tensor, grad: Tensor | None) -> None:
        if grad is None:
            out.backward()
        else:
            torch.autograd.backward(out, grad)


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """The process's error stream (file descriptor 2, where the profiler's C++ side writes its
    ``USDT … profiler_start/stop`` notes) sent to ``/dev/null`` for a moment, then restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _quiet_memory_profiler() -> Iterator[Any]:
    """torch's profiler with CPU memory events, started and stopped without its notes on stderr (the
    planner's own progress lines in between still show)."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_to_devnull():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _stderr_to_devnull():
            prof.__exit__(None, None, None)


def _peak_in_ranges(prof: Any, names: Sequence[str]) -> dict[str, int]:
    """Per annotated range, the peak of net CPU allocations inside it (profiler memory events)."""
    events = prof.profiler.kineto_results.events()
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in names}
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks = {}
    for name in names:
        start, end = ranges.get(name, (0, -1))
        live = peak = 0
        for t, delta in mem:
            if start <= t <= end:
                live += delta
                peak = max(peak, live)
        peaks[name] = peak
    return peaks


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class DistinctLayers:
    """The layers the profiler runs. Identical layers (:func:`layer_signature`) cost the same, so each
    group runs on its first member only; the bytes a layer adds after its predecessor (M_a) depend
    only on the two layers' groups, so each pair of neighbouring groups is measured once, on the
    groups' first members (the second member follows the first when a group follows itself)."""

    groups: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]  # per layer: the index of its group

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> DistinctLayers:
        groups = tuple(tuple(members) for members in _identical_layers(layers))
        group_of = [0] * len(layers)
        for g, members in enumerate(groups):
            for i in members:
                group_of[i] = g
        return cls(groups, tuple(group_of))

    def first(self, i: int) -> int:
        """The member of layer ``i``'s group that is run in its place."""
        return self.groups[self.group_of[i]][0]

    @property
    def timed(self) -> list[int]:
        """Layers that run alone: one per group, in model order."""
        return sorted(members[0] for members in self.groups)

    @property
    def pairs(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(group of i-1, group of i)`` -> the two layers that stand for ``i-1, i``."""
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for i in range(1, len(self.group_of)):
            key = (self.group_of[i - 1], self.group_of[i])
            if key not in out:
                prev, cur = self.groups[key[0]], self.groups[key[1]]
                out[key] = (prev[0], cur[1] if key[0] == key[1] else cur[0])
        return out

    def spread(self, values: Mapping[int, Any]) -> list[Any]:
        """Per layer, the value of its group's first member."""
        return [values[self.first(i)] for i in range(len(self.group_of))]


class _Progress:
    """Progress lines with an estimate of the time left; ``force=False`` lines at most every ``PROGRESS_SECONDS``."""

    def __init__(self, log: Callable[[str], None] | None) -> None:
        self.log, self.start, self.last = log, time.perf_counter(), float("-inf")

    def say(self, message: str, left_s: float | None = None, *, force: bool = True) -> None:
        now = time.perf_counter()
        if self.log is None or (not force and now - self.last < PROGRESS_SECONDS):
            return
        self.last = now
        eta = f", about {left_s:.0f} s left" if left_s is not None else ""
        self.log(f"profile: {message} ({now - self.start:.0f} s{eta})")


@contextlib.contextmanager
def _layer_grads(layer: nn.Module) -> Iterator[None]:
    """Inside: the layer's parameter gradients exist, so a backward accumulates into them as in every
    training step after the first; outside, they are dropped, so one layer's gradients exist at a time."""
    params = [p for p in _unique(layer.parameters()) if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        yield
    finally:
        for p in params:
            p.grad = None


@dataclass
class _SizeRun:
    """One batch size's inputs and output gradients of the layers that run alone (``None`` for the
    others), result rows of every layer (copied within a group), and the seconds of each timed
    layer's forward + backward in the memory pass (for the time estimate)."""

    batch: dict[str, Tensor]
    inputs: list[Tensor | None]
    grads: list[Tensor | None]
    rows: list[dict[str, float]]
    seconds: dict[int, float]


def _prepare_size(runner: _LayerRunner, batch: dict[str, Tensor], distinct: DistinctLayers | None = None,
                  memory: bool = False) -> _SizeRun:
    """The memory pass at one batch size: each timed layer's input (the graph-free output of the
    first member of its predecessor's group), output gradient, stored, output and (``memory``)
    transient bytes from one forward + backward, then M_a from one forward per pair of groups.

    The transient is the peak allocation above the stored bytes while the layer runs forward and
    backward with its input and output gradient pre-allocated and its parameters' gradients present
    (as in every step after the first): ``torch.cuda.max_memory_allocated`` on GPUs, the profiler's
    CPU memory events otherwise."""
    model, layers = runner.model, runner.layers
    n = len(layers)
    distinct = distinct or DistinctLayers.of(layers)
    timed = distinct.timed
    rows: dict[int, dict[str, float]] = {}
    inputs: list[Tensor | None] = [None] * n
    grads: list[Tensor | None] = [None] * n
    seconds: dict[int, float] = {}
    peaks: dict[int, float] = {}
    cpu_memory = memory and runner.device.type != "cuda"
    names = {i: f"planner::layer{i}" for i in timed}
    with contextlib.ExitStack() as stack:
        if cpu_memory:
            prof = stack.enter_context(_quiet_memory_profiler())
        outputs: dict[int, Tensor] = {}

        def output_of(k: int) -> Tensor:  # graph-free, computed once: the next input and the gradient's shape
            if k not in outputs:
                outputs[k] = runner.forward_nograd_out(k, inputs[k], batch)  # type: ignore[arg-type]
            return outputs[k]

        for i in timed:
            x = model.pipeline_input(batch) if i == 0 else output_of(distinct.first(i - 1))
            inputs[i] = x
            if i < n - 1:
                grads[i] = torch.randn_like(output_of(i))
            with _layer_grads(layers[i]):
                rows[i], seconds[i], peaks[i] = _alone(runner, i, x, batch, grads[i], names[i],
                                                       memory and not cpu_memory)
    if cpu_memory:
        in_ranges = _peak_in_ranges(prof, list(names.values()))
        peaks = {i: float(in_ranges[names[i]]) for i in timed}
    for i in timed:
        rows[i]["transient"] = max(0.0, peaks[i] - (rows[i]["stored_alone"] - rows[i]["in_saved"])) if memory else 0.0
    added = {key: runner.forward_seq([a, b], inputs[a], batch)[2] - rows[a]["stored_alone"]  # type: ignore[arg-type]
             for key, (a, b) in distinct.pairs.items()}
    full = []
    for i in range(n):
        row = dict(rows[distinct.first(i)])
        if i > 0:
            row["stored_added"] = float(added[distinct.group_of[i - 1], distinct.group_of[i]])
        full.append(row)
    return _SizeRun(batch, inputs, grads, full, seconds)


def _alone(runner: _LayerRunner, i: int, x: Tensor, batch: Mapping[str, Any], grad: Tensor | None, name: str,
           cuda_peak: bool) -> tuple[dict[str, float], float, float]:
    """One forward + backward of layer ``i`` alone: its row (no M_a, no transient yet), the seconds it
    took and, with ``cuda_peak``, the peak allocation above what was allocated before."""
    device = runner.device
    base = 0
    if cuda_peak:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with record_function(name):
        inp, out, alone, input_saved = runner.forward(i, i, x, batch)
        out_bytes = 0.0 if i == len(runner.layers) - 1 else float(out.numel() * out.element_size())
        in_bytes = float(inp.numel() * inp.element_size()) if input_saved else 0.0
        runner.backward(out, grad)
        del inp, out
    _sync(device)
    seconds = time.perf_counter() - start
    peak = float(torch.cuda.max_memory_allocated(device) - base) if cuda_peak else 0.0
    row = {"stored_alone": float(alone), "stored_added": float(alone), "out_bytes": out_bytes, "in_saved": in_bytes,
           "transient": 0.0}
    return row, seconds, peak


def _time_layers(runner: _LayerRunner, runs: Sequence[_SizeRun], reps: int, warmup: int,
                 progress: _Progress | None = None, budget_s: float | None = None) -> None:
    """Timed forward, backward and graph-free forward of one layer per group of identical layers at
    every batch size, into each run's rows (every member of the group gets the values).

    Rounds over all (size, layer) pairs: ``warmup + reps`` of them, then more (up to 20 ×
    ``MIN_SAMPLES``) until ``MIN_SECONDS`` per size have passed, so a cheap model's quantiles rest
    on many samples; with ``budget_s``, no round starts after ``MIN_ROUNDS`` that would end past
    ``budget_s`` seconds, so an expensive model costs a few rounds. Sizes share the rounds, so a slow
    spell of a shared machine moves every size alike (the fitted line's level), not one size (its
    slope). ``progress``: a line at most every ``PROGRESS_SECONDS`` with the estimated time left."""
    device, layers = runner.device, runner.layers
    distinct = DistinctLayers.of(layers)
    timed = distinct.timed
    samples = {(k, key): {i: [] for i in timed} for k in range(len(runs)) for key in ("fwd", "bwd", "fwd_nograd")}
    start, r, min_seconds = time.perf_counter(), 0, MIN_SECONDS * len(runs)
    need, least, cap = warmup + reps, warmup + min(reps, MIN_ROUNDS), warmup + 20 * max(reps, MIN_SAMPLES)

    def spread() -> bool:
        return time.perf_counter() - start >= min_seconds

    while r < need or (not spread() and r < cap):
        elapsed = time.perf_counter() - start
        if budget_s is not None and 0 < r and r >= least and elapsed * (r + 1) / r > budget_s:
            break
        for i in timed:
            with _layer_grads(layers[i]):
                for k, run in enumerate(runs):
                    holder: dict[str, Any] = {}

                    def fwd(i: int = i, run: _SizeRun = run) -> None:
                        holder["io"] = runner.forward(i, i, run.inputs[i], run.batch)

                    t_f = _timed(fwd, device)
                    t_b = _timed(lambda i=i, run=run: runner.backward(holder["io"][1], run.grads[i]), device)
                    holder.clear()
                    t_n = _timed(lambda i=i, run=run: runner.forward_nograd(i, run.inputs[i], run.batch), device)
                    if r >= warmup:
                        for key, t in (("fwd", t_f), ("bwd", t_b), ("fwd_nograd", t_n)):
                            samples[k, key][i].append(t)
        r += 1
        if progress is not None:
            per_round = (time.perf_counter() - start) / r
            left = max(0, need - r)
            if budget_s is not None:
                left = min(left, max(0, least - r, int((budget_s - per_round * r) // per_round)))
            progress.say(f"timing round {r}", left * per_round, force=False)
    for (k, key), per_layer in samples.items():
        values = distinct.spread({i: quantile(per_layer[i], PROFILE_QUANTILE) for i in timed})
        for row, value in zip(runs[k].rows, values):
            row[key] = value


def _expected_rounds(reps: int, warmup: int, round_s: float, budget_s: float | None) -> int:
    """How many rounds :func:`_time_layers` will run at ``round_s`` seconds a round (for the estimate)."""
    if budget_s is None:
        return warmup + reps
    return max(warmup + min(reps, MIN_ROUNDS), min(warmup + reps, int(budget_s // max(round_s, 1e-9))))


def _optimizer_times(layers: Sequence[nn.Module], reps: int) -> list[float]:
    """Seconds of one AdamW step over each layer's parameters: the median of ``reps`` steps, timed on
    one layer per group of identical layers, one layer after the other (so only one layer's gradients
    and AdamW state exist at a time)."""
    distinct = DistinctLayers.of(layers)
    times: dict[int, float] = {}
    for i in distinct.timed:
        params = [p for p in _unique(layers[i].parameters()) if p.requires_grad]
        if not params:
            times[i] = 0.0
            continue
        with _layer_grads(layers[i]):
            opt = torch.optim.AdamW(params, lr=0.0)
            opt.step()  # creates the states
            samples = []
            for _ in range(reps):
                start = time.perf_counter()
                opt.step()
                samples.append(time.perf_counter() - start)
            times[i] = statistics.median(samples)
            del opt
    return distinct.spread(times)


LAYER_MODES = ("auto", "all", "distinct")
DISTINCT_FRACTION = 0.25  # "auto": profile distinct layers when training the whole model would need more
DISTINCT_BYTES = 2**30  # ... or more than this (only the distinct layers run: the others need no weights)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def layers_mode(model_cfg: Any, device: str | torch.device = "cpu", layers: str = "auto") -> str:
    """``"all"`` (every layer gets its own weights) or ``"distinct"`` (one or two weight copies per group
    of identical layers, see :func:`profile_model`); ``"auto"`` picks ``"distinct"`` when the model's fp32
    training state (weights, gradients, two AdamW moments: 16 bytes a parameter) would exceed
    ``DISTINCT_FRACTION`` of the device's memory or ``DISTINCT_BYTES``, so no process ever needs a model
    that does not fit, and a large model's profile builds a few layers, not the model."""
    if layers not in LAYER_MODES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_MODES)}, got {layers!r}")
    if layers != "auto":
        return layers

    params = build_model(model_config_dict(model_cfg), device="meta").num_parameters()
    limit = min(DISTINCT_FRACTION * _device_memory(torch.device(device)), DISTINCT_BYTES)
    return "distinct" if 16 * params > limit else "all"


def _alias_identical_layers(model: nn.Module, device: torch.device) -> None:
    """Materialise the first two layers of every group of identical layers (two, so that a block after a
    block is measured as in the model) and let the others run the second one's weights."""
    layers = model.pipeline_layers()
    groups = _identical_layers(layers)
    model.materialize(sorted(i for members in groups for i in members[:2]), device)
    for members in groups:
        for i in members[2:]:
            layers[i] = layers[members[1]]


def profile_model(model_cfg: Any, *, batch_sizes: Sequence[int] = PROFILE_BATCH_SIZES, reps: int = 5, warmup: int = 0,
                  device: str | torch.device = "cpu", threads: int | None = 1, memory: bool = True,
                  seed: int = 0, layers: str = "auto", log: Callable[[str], None] | None = None,
                  budget_s: float | None = TIMING_SECONDS) -> ModelCosts:
    """Profile the model's pipeline layers at ``batch_sizes`` (see the module docstring).

    ``threads``: intra-op threads while profiling; the CPU runtime gives each rank one thread.
    ``layers`` (:func:`layers_mode`): with ``"distinct"`` the model is built on the meta device and only
    the first two of each group of identical layers (transformer blocks) are materialised; the others
    reuse those weights (identical layers cost the same, and :func:`profile_pipeline` runs only those
    two), so the profile of a model larger than one device never holds the whole model.
    ``log``: progress lines with the estimated time left.
    """
    cfg = model_config_dict(model_cfg)
    dev = torch.device(device)
    mode = layers_mode(cfg, dev, layers)
    with _threads(threads if dev.type == "cpu" else None), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(cfg, device="meta")
        if mode == "distinct":
            _alias_identical_layers(model, dev)
        else:
            model.materialize(None, dev)
        return profile_pipeline(model, lambda size: make_batch(model, size, seed), str(cfg.get("name", "model")),
                                batch_sizes=batch_sizes, reps=reps, warmup=warmup, device=dev, threads=threads,
                                memory=memory, log=log, budget_s=budget_s)


def profile_pipeline(model: nn.Module, batch_of: Callable[[int], dict[str, Tensor]], name: str, *,
                     batch_sizes: Sequence[int] = PROFILE_BATCH_SIZES, reps: int = 5, warmup: int = 0,
                     device: torch.device = torch.device("cpu"), threads: int | None = 1, memory: bool = True,
                     shares_cores: bool = True, log: Callable[[str], None] | None = None,
                     budget_s: float | None = TIMING_SECONDS) -> ModelCosts:
    """Profile any :class:`~pipeline_recipes.core.pipeline_model.PipelineModel` (already on ``device``) on the
    mini-batches ``batch_of(size)``. Only the layers of :class:`DistinctLayers` run (one per group of
    identical layers, and the pairs of neighbouring groups); every layer gets its group's costs.

    ``warmup``: untimed rounds before the timed ones (the memory pass has already run every timed
    layer forward and backward at every size); ``reps`` and ``budget_s``: see :func:`_time_layers`.
    ``shares_cores=False`` for stages that use no CPU while they run
    (:class:`pipeline_recipes.strategies.harness.emulated.EmulatedPipeline`): CPU ranks then never stretch each other.
    ``log``: progress lines with the estimated time left."""
    sizes = sorted({int(b) for b in batch_sizes})
    if len(sizes) < 2 or sizes[0] < 1:
        raise ValueError(f"profile at two or more distinct positive micro-batch sizes, got {list(batch_sizes)}")
    if reps < 1 or warmup < 0 or (budget_s is not None and budget_s < 0):
        raise ValueError(f"profile with reps >= 1, warmup >= 0 and budget_s >= 0 (or None: no budget), "
                         f"got reps={reps}, warmup={warmup}, budget_s={budget_s}")
    progress = _Progress(log)
    with _threads(threads if device.type == "cpu" else None):
        model.train()
        runner = _LayerRunner(model, device)
        layers = model.pipeline_layers()
        names = model.layer_names() if hasattr(model, "layer_names") else [f"layer.{i}" for i in range(len(layers))]
        distinct = DistinctLayers.of(layers)
        progress.say(f"{len(distinct.groups)} distinct of {len(layers)} layers, timed once each: "
                     + ", ".join(names[i] for i in distinct.timed))
        runs: list[_SizeRun] = []
        pass_s = 0.0
        for size in sizes:
            start = time.perf_counter()
            runs.append(_prepare_size(runner, {k: v.to(device) for k, v in batch_of(size).items()}, distinct, memory))
            pass_s += time.perf_counter() - start
            # costs grow about linearly in B; a round runs forward, backward (about two forwards) and a
            # graph-free forward of each timed layer at each size
            scale = sum(sizes) / sum(sizes[: len(runs)])
            round_s = sum(t for run in runs for t in run.seconds.values()) * scale * 4 / 3
            rounds = _expected_rounds(reps, warmup, round_s, budget_s)
            left = pass_s * (scale - 1) + max(rounds * round_s, MIN_SECONDS * len(sizes))
            progress.say(f"memory pass at B={size} done" + ("" if scale > 1 else
                         f"; timing about {rounds} rounds of about {round_s:.1f} s"), left)
        _time_layers(runner, runs, reps, warmup, progress, budget_s)
        per_size = [run.rows for run in runs]
        del runs
        opt_times = _optimizer_times(layers, OPTIMIZER_STEPS)
    out = []
    for i, layer in enumerate(layers):
        params = _unique(layer.parameters())

        def fit(key: str, i: int = i) -> Any:
            return fit_line(sizes, [rows[i][key] for rows in per_size])

        out.append(LayerCosts(names[i], sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
                              fit("fwd"), fit("bwd"), opt_times[i], fit("stored_alone"), fit("stored_added"),
                              fit("transient"), fit("out_bytes"), fit("fwd_nograd")))
    tied = _tied(model)
    layer_costs = model.layer_costs("layers") if hasattr(model, "layer_costs") else [1.0] * len(layers)
    raw = {str(s): rows for s, rows in zip(sizes, per_size)}
    cores = available_cores() if device.type == "cpu" and shares_cores else 0
    progress.say("done")
    return ModelCosts(name, device_description(device, threads or torch.get_num_threads()),
                      tuple(out), tied, CommCosts(), "profile", cores,
                      tuple(sizes), {"layer_costs": list(layer_costs), "raw": raw, "reps": reps})


def _tied(model: nn.Module) -> tuple[tuple[int, int, int], ...]:
    groups = model.tied_parameters() if hasattr(model, "tied_parameters") else []
    layers = model.pipeline_layers()
    out = []
    for group in groups:
        idx = sorted({i for i, _ in group})
        if len(idx) >= 2:
            p = layers[group[0][0]].get_parameter(group[0][1])
            out.append((idx[0], idx[-1], int(p.numel() * p.element_size())))
    return tuple(out)


def load_or_profile(model_cfg: Any, *, cache_dir: str | Path | None = None, refresh: bool = False,
                    comm: str = "measure", batch_sizes: Sequence[int] = PROFILE_BATCH_SIZES, reps: int = 5,
                    device: str = "cpu", threads: int | None = 1, log: Callable[[str], None] | None = None,
                    layers: str = "auto", budget_s: float | None = TIMING_SECONDS) -> ModelCosts:
    """The cached profile of this model on this device, profiling (and caching) it when missing.

    ``comm``: ``"measure"`` (2-process gloo micro-benchmarks, cached per device), ``"default"``
    (built-in constants, no processes) or ``"none"`` (free communication); ``layers``: see
    :func:`profile_model`; ``budget_s``: the timed rounds' budget (:func:`_time_layers`); ``log``:
    progress lines with the estimated time left.
    """
    if comm not in ("measure", "default", "none"):
        raise ValueError(f"comm must be measure, default or none, got {comm!r}")
    cfg = model_config_dict(model_cfg)
    cfg.pop("_target_", None)
    dev = torch.device(device)
    desc = device_description(dev, threads or torch.get_num_threads())
    settings: dict[str, Any] = {"batch_sizes": sorted(set(batch_sizes)), "reps": reps, "budget_s": budget_s}
    mode = layers_mode(cfg, dev, layers)
    if mode != "all":
        settings["layers"] = mode
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"profile-{cfg.get('name', 'model')}-{cache_key(cfg, desc, settings)}.json"
    if path.exists() and not refresh:
        costs = ModelCosts.from_json(json.loads(path.read_text()))
        if log:
            log(f"profile: cached {path}")
    else:
        if log:
            log(f"profile: measuring {cfg.get('name', 'model')} on {desc} at B = {settings['batch_sizes']} ...")
        costs = profile_model(cfg, batch_sizes=batch_sizes, reps=reps, device=dev, threads=threads, layers=mode,
                              log=log, budget_s=budget_s)
        path.write_text(json.dumps(costs.to_json(), indent=1))
        if log:
            log(f"profile: saved {path}")
    if comm == "none":
        return costs.with_comm(CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0)))
    if comm == "default":
        return costs.with_comm(CommCosts())
    from .comm_profile import load_or_measure_comm  # local: spawns worlds (the runtime, torch._dynamo ≥1 s); the pre-flight never measures

    return costs.with_comm(load_or_measure_comm(root, desc, refresh=refresh, log=log))
