"""Short profiling runs on the local device: per-layer time and memory at two micro-batch sizes.

For each batch size ``B`` in ``batch_sizes`` (two by default, CAPTURE §III-A2) and each pipeline
layer, the profiler measures, the way :class:`strategies.executor.StageExecutor` runs a stage:

* the forward (under the executor's saved-tensor accounting), backward and graph-free forward (a
  recomputed stage's first pass) times: the lower quartile of at least ``reps`` rounds over all
  layers and batch sizes, spread over at least ``MIN_SECONDS`` per size (round-robin, so a burst of
  background load hits every layer and size alike and moves the fitted line's level, not its slope;
  a lower quantile, as load only slows samples down); identical layers
  (transformer blocks) pool their samples, the others run extra rounds, so every quantile rests on
  at least ``MIN_SAMPLES`` samples;
* the bytes autograd keeps for the backward, alone (CAPTURE's M_i) and after the previous layer
  (M_a = PM(l−1, l) − PM(l−1), §III-A1), with :class:`strategies.recompute.SavedBytes`;
* the peak allocation above those bytes while forward and backward run (the transient), from the
  allocator: ``torch.cuda.max_memory_allocated`` on GPUs, the profiler's CPU memory events otherwise;
* the size of its output (the activation sent to the next stage) and, once, an AdamW step.

The model is built on the meta device and materialised (:mod:`models.materialize`): whole, or, for a
model whose training state would not fit comfortably, only two copies per group of identical layers
(:func:`layers_mode`), so profiling never needs the whole model in one process.

Every quantity is fitted with a line in ``B`` (:func:`planner.costs.fit_line`). Communication
constants come from :mod:`planner.comm`; :func:`load_or_profile` caches both as JSON keyed by the
model config and the device (Chimera §3.4: "measured using micro benchmarks").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .costs import fit_line, quantile
from .model_costs import CommCosts, LayerCosts, ModelCosts

DEFAULT_CACHE = Path(os.environ.get("PIPELINE_RECIPES_CACHE", Path.home() / ".cache" / "pipeline-recipes")) / "planner"
PROFILE_VERSION = 4
MIN_SAMPLES = 24  # timed samples per group of identical layers and batch size
MIN_SECONDS = 1.5  # per batch size: the timed rounds last at least this long × the sizes (spread over time)
PROFILE_QUANTILE = 0.25  # of the samples: background load only ever slows a sample down


def model_config_dict(model_cfg: Any) -> dict[str, Any]:
    """A plain dict of a model config (Hydra ``DictConfig``, mapping or preset name)."""
    if isinstance(model_cfg, str):
        from pipeline_recipes.models import preset

        return preset(model_cfg)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(model_cfg, DictConfig):
            return dict(OmegaConf.to_container(model_cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover
        pass
    return {str(k): v for k, v in dict(model_cfg).items()}


def device_description(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.machine()}:{platform.processor() or 'cpu'}:{available_cores()}cores:{threads}threads"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cache_key(model_cfg: Mapping[str, Any], device: str, settings: Mapping[str, Any]) -> str:
    blob = json.dumps({"model": model_cfg, "device": device, "torch": torch.__version__, "v": PROFILE_VERSION,
                       **settings}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def make_batch(model: nn.Module, size: int, seed: int = 0) -> dict[str, Tensor]:
    """A synthetic mini-batch of ``size`` samples shaped like the training data of ``model``."""
    from pipeline_recipes.datamodules.synthetic import SyntheticBertDataset, SyntheticGPT2Dataset

    vocab, seq = int(model.config.vocab_size), int(model.seq_len)
    if getattr(model, "family", "") == "bert":
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
        from pipeline_recipes.strategies.recompute import parameter_storages

        self.model, self.device = model, device
        self.layers = model.pipeline_layers()
        self.storages = parameter_storages(model.parameters())

    def loss(self, out: Any, batch: Mapping[str, Any]) -> Tensor:
        try:
            from pipeline_recipes.strategies.executor import loss_counts, micro_batch_loss

            totals = {k: float(v) for k, v in loss_counts(self.model, batch).items()}
            return micro_batch_loss(self.model, out, batch, totals)
        except ImportError:  # pragma: no cover - runtime API moved
            return self.model.pipeline_loss(out, batch)

    def forward(self, first: int, last: int, x: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Any, int, bool]:
        """Run layers ``first..last``; return (input, output, saved bytes, whether the input is saved)."""
        from pipeline_recipes.strategies.pipeline_model import run_layers
        from pipeline_recipes.strategies.recompute import SavedBytes

        inp = x.detach().requires_grad_(True) if first > 0 else x
        saved = SavedBytes(self.storages)
        with saved.track():
            out = run_layers(self.layers[first : last + 1], inp, batch)
            if last == len(self.layers) - 1:
                out = self.loss(out, batch)
        saved.add(out)
        input_saved = first > 0 and (inp.data_ptr(), inp.numel()) in saved._seen
        if first == 0:
            input_saved = any(k[0] == x.data_ptr() for k in saved._seen)
        return inp, out, saved.nbytes, input_saved

    def forward_nograd(self, index: int, x: Tensor, batch: Mapping[str, Any]) -> Tensor:
        """Layer ``index`` without a graph, as a recomputed stage first runs it."""
        from pipeline_recipes.strategies.pipeline_model import run_layers

        with torch.no_grad():
            out = run_layers(self.layers[index : index + 1], x, batch)
            return self.loss(out, batch) if index == len(self.layers) - 1 else out

    def backward(self, out: Tensor, grad: Tensor | None) -> None:
        if grad is None:
            out.backward()
        else:
            torch.autograd.backward(out, grad)


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


@dataclass
class _SizeRun:
    """One batch size's inputs to every layer, output gradients, and per-layer result rows."""

    batch: dict[str, Tensor]
    inputs: list[Tensor]
    grads: list[Tensor | None]
    rows: list[dict[str, float]]


def _prepare_size(runner: _LayerRunner, batch: dict[str, Tensor]) -> _SizeRun:
    """Each layer's input, output gradient, stored and output bytes at this batch size."""
    from pipeline_recipes.strategies.pipeline_model import call_layer

    model, layers = runner.model, runner.layers
    n = len(layers)
    rows: list[dict[str, float]] = []
    x = model.pipeline_input(batch)
    prev_x: Tensor | None = None
    inputs: list[Tensor] = []
    grads: list[Tensor | None] = []
    for i in range(n):
        inputs.append(x)
        inp, out, alone, input_saved = runner.forward(i, i, x, batch)
        grad = None if i == n - 1 else torch.randn_like(out)
        grads.append(grad)
        runner.backward(out, grad)
        pair = float(alone)
        if prev_x is not None:
            pair = runner.forward(i - 1, i, prev_x, batch)[2] - rows[-1]["stored_alone"]
        out_bytes = 0.0 if i == n - 1 else float(out.numel() * out.element_size())
        in_bytes = float(inp.numel() * inp.element_size()) if input_saved else 0.0
        del inp, out
        rows.append({"stored_alone": float(alone), "stored_added": pair, "out_bytes": out_bytes,
                     "in_saved": in_bytes, "transient": 0.0})
        with torch.no_grad():
            prev_x, x = x, call_layer(layers[i], x, batch)
    return _SizeRun(batch, inputs, grads, rows)


def _time_layers(runner: _LayerRunner, runs: Sequence[_SizeRun], reps: int, warmup: int) -> None:
    """Timed forward, backward and graph-free forward of every layer at every batch size, into each
    run's rows: rounds over all (size, layer) pairs until each has its samples and ``MIN_SECONDS``
    per size have passed. Sizes share the rounds, so a slow spell of a shared machine moves every
    size alike (the fitted line's level), not one size (its slope)."""
    device, layers = runner.device, runner.layers
    n = len(layers)
    groups = _identical_layers(layers)  # (transformer blocks) pool their samples: robust quantiles
    size_of_group = {i: len(members) for members in groups for i in members}
    # every group gets at least MIN_SAMPLES samples: layers without twins run extra rounds
    rounds = [max(reps, -(-MIN_SAMPLES // size_of_group[i])) for i in range(n)]
    samples = {(k, key): [[] for _ in range(n)] for k in range(len(runs)) for key in ("fwd", "bwd", "fwd_nograd")}
    start, r, min_seconds = time.perf_counter(), 0, MIN_SECONDS * len(runs)

    def spread() -> bool:
        return time.perf_counter() - start >= min_seconds

    # at most 20× the rounds needed: a second-long burst of other users' load moves a few samples, not all
    while r < warmup + max(rounds) or (not spread() and r < warmup + 20 * max(rounds)):
        for i in range(n):
            if r >= warmup + rounds[i] and spread():
                continue
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
    for (k, key), per_layer in samples.items():
        for members in groups:
            value = quantile([t for i in members for t in per_layer[i]], PROFILE_QUANTILE)
            for i in members:
                runs[k].rows[i][key] = value


def _transients(runner: _LayerRunner, inputs: list[Tensor], grads: list[Tensor | None],
                batch: dict[str, Tensor]) -> list[float]:
    """Peak allocation while each layer runs forward + backward alone (its inputs pre-allocated)."""
    n, device = len(inputs), runner.device
    if device.type == "cuda":
        peaks = []
        for i in range(n):
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            _, out, _, _ = runner.forward(i, i, inputs[i], batch)
            runner.backward(out, grads[i])
            del out
            torch.cuda.synchronize(device)
            peaks.append(float(torch.cuda.max_memory_allocated(device) - base))
        return peaks
    from torch.profiler import ProfilerActivity, profile, record_function

    names = [f"planner::layer{i}" for i in range(n)]
    with contextlib.redirect_stderr(open(os.devnull, "w")), profile(activities=[ProfilerActivity.CPU],
                                                                     profile_memory=True) as prof:
        for i in range(n):
            with record_function(names[i]):
                _, out, _, _ = runner.forward(i, i, inputs[i], batch)
                runner.backward(out, grads[i])
                del out
    peaks = _peak_in_ranges(prof, names)
    return [float(peaks[name]) for name in names]


def _optimizer_times(layers: Sequence[nn.Module], reps: int) -> list[float]:
    """Seconds of one AdamW step over each layer's parameters: the median of ``reps`` rounds over all
    layers (round-robin, like the layer times), identical layers pooled."""
    n = len(layers)
    optimizers: list[torch.optim.Optimizer | None] = []
    seen: set[int] = set()
    for layer in layers:  # a layer object listed twice (profile_model's "distinct" layers) is timed once
        params = [p for p in _unique(layer.parameters()) if p.requires_grad] if id(layer) not in seen else []
        seen.add(id(layer))
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizers.append(torch.optim.AdamW(params, lr=0.0) if params else None)
        if params:
            optimizers[-1].step()  # creates the states
    samples: list[list[float]] = [[] for _ in range(n)]
    for _ in range(reps):
        for i, opt in enumerate(optimizers):
            if opt is not None:
                start = time.perf_counter()
                opt.step()
                samples[i].append(time.perf_counter() - start)
    times = [0.0] * n
    for members in _identical_layers(layers):
        pooled = [t for i in members for t in samples[i]]
        for i in members:
            times[i] = statistics.median(pooled) if pooled else 0.0
    return times


LAYER_MODES = ("auto", "all", "distinct")
DISTINCT_FRACTION = 0.25  # "auto": profile distinct layers only when training the whole model would need more


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def layers_mode(model_cfg: Any, device: str | torch.device = "cpu", layers: str = "auto") -> str:
    """``"all"`` (every layer gets its own weights) or ``"distinct"`` (one or two weight copies per group
    of identical layers, see :func:`profile_model`); ``"auto"`` picks ``"distinct"`` when the model's fp32
    training state (weights, gradients, two AdamW moments: 16 bytes a parameter) would exceed
    ``DISTINCT_FRACTION`` of the device's memory, so no process ever needs a model that does not fit."""
    if layers not in LAYER_MODES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_MODES)}, got {layers!r}")
    if layers != "auto":
        return layers
    from pipeline_recipes.models import build_model

    params = build_model(model_config_dict(model_cfg), device="meta").num_parameters()
    return "distinct" if 16 * params > DISTINCT_FRACTION * _device_memory(torch.device(device)) else "all"


def _alias_identical_layers(model: nn.Module, device: torch.device) -> None:
    """Materialise the first two layers of every group of identical layers (two, so that a block after a
    block is measured as in the model) and let the others run the second one's weights."""
    layers = model.pipeline_layers()
    groups = _identical_layers(layers)
    model.materialize(sorted(i for members in groups for i in members[:2]), device)
    for members in groups:
        for i in members[2:]:
            layers[i] = layers[members[1]]


def profile_model(model_cfg: Any, *, batch_sizes: Sequence[int] = (1, 4), reps: int = 5, warmup: int = 1,
                  device: str | torch.device = "cpu", threads: int | None = 1, memory: bool = True,
                  seed: int = 0, layers: str = "auto") -> ModelCosts:
    """Profile every pipeline layer of the model at ``batch_sizes`` (see the module docstring).

    ``threads``: intra-op threads while profiling; the CPU runtime gives each rank one thread.
    ``layers`` (:func:`layers_mode`): with ``"distinct"`` the model is built on the meta device and only
    the first two of each group of identical layers (transformer blocks) are materialised; the others
    reuse those weights (identical layers cost the same; their samples are pooled anyway), so the
    profile of a model larger than one device never holds the whole model.
    """
    from pipeline_recipes.models import build_model

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
                                memory=memory)


def profile_pipeline(model: nn.Module, batch_of: Callable[[int], dict[str, Tensor]], name: str, *,
                     batch_sizes: Sequence[int] = (1, 4), reps: int = 5, warmup: int = 1,
                     device: torch.device = torch.device("cpu"), threads: int | None = 1, memory: bool = True,
                     shares_cores: bool = True) -> ModelCosts:
    """Profile any :class:`~strategies.pipeline_model.PipelineModel` (already on ``device``) on the
    mini-batches ``batch_of(size)``. ``shares_cores=False`` for stages that use no CPU while they
    run (:class:`strategies.emulated.EmulatedPipeline`): CPU ranks then never stretch each other."""
    sizes = sorted({int(b) for b in batch_sizes})
    if len(sizes) < 2 or sizes[0] < 1:
        raise ValueError(f"profile at two or more distinct positive micro-batch sizes, got {list(batch_sizes)}")
    with _threads(threads if device.type == "cpu" else None):
        model.train()
        runner = _LayerRunner(model, device)
        layers = model.pipeline_layers()
        runs = [_prepare_size(runner, {k: v.to(device) for k, v in batch_of(size).items()}) for size in sizes]
        _time_layers(runner, runs, reps, warmup)
        if memory:
            for run in runs:
                for row, peak in zip(run.rows, _transients(runner, run.inputs, run.grads, run.batch)):
                    row["transient"] = max(0.0, peak - (row["stored_alone"] - row["in_saved"]))
        per_size = [run.rows for run in runs]
        opt_times = _optimizer_times(layers, max(reps, 3))
    out = []
    names = model.layer_names() if hasattr(model, "layer_names") else [f"layer.{i}" for i in range(len(layers))]
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
                    comm: str = "measure", batch_sizes: Sequence[int] = (1, 4), reps: int = 5,
                    device: str = "cpu", threads: int | None = 1, log: Callable[[str], None] | None = None,
                    layers: str = "auto") -> ModelCosts:
    """The cached profile of this model on this device, profiling (and caching) it when missing.

    ``comm``: ``"measure"`` (2-process gloo micro-benchmarks, cached per device), ``"default"``
    (built-in constants, no processes) or ``"none"`` (free communication); ``layers``: see
    :func:`profile_model`.
    """
    if comm not in ("measure", "default", "none"):
        raise ValueError(f"comm must be measure, default or none, got {comm!r}")
    cfg = model_config_dict(model_cfg)
    cfg.pop("_target_", None)
    dev = torch.device(device)
    desc = device_description(dev, threads or torch.get_num_threads())
    settings: dict[str, Any] = {"batch_sizes": sorted(set(batch_sizes)), "reps": reps}
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
        costs = profile_model(cfg, batch_sizes=batch_sizes, reps=reps, device=dev, threads=threads, layers=mode)
        path.write_text(json.dumps(costs.to_json(), indent=1))
        if log:
            log(f"profile: saved {path}")
    if comm == "none":
        from .costs import AlphaBeta

        return costs.with_comm(CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0)))
    if comm == "default":
        return costs.with_comm(CommCosts())
    from .comm import load_or_measure_comm

    return costs.with_comm(load_or_measure_comm(root, desc, refresh=refresh, log=log))
