#!/usr/bin/env python
"""The GPU benchmark: the project's D = 1 stage path against two in-run anchors on one GPU.

    python scripts/bench.py --parts gpu                                         # benchmarks/bench_gpu.json
    python scripts/bench.py --parts gpu --device cpu --tiny --out /tmp/g.json   # smoke run on the CPU

For ``model=gpt2`` (the Chimera paper's 1.39 B GPT-2, Li & Hoefler, SC'21, Table 2) and ``model=llama3-1b``
at 16 samples per step split as micro-batch 16 × 1 and 4 × 4, in one process and one run:

* ``stage``: the project's pipeline engine at D = 1 (one stage, DAPPLE's one-forward-one-backward order,
  i.e. gradient accumulation) on the model as ``conf/model`` builds it: GPT-2's MLP with the one-op tanh
  GELU (``gelu_pytorch_tanh``), the causal mask left to SDPA's ``is_causal``, and the LM loss with
  ``loss_chunk_tokens`` (4096) tokens' logits at a time (:mod:`pipeline_recipes.models.lm_loss`: no fp32
  logits of the whole micro-batch, the head's product done twice). ``eager``; ``compiled``: the same
  path with every repeated block compiled by
  :func:`pipeline_recipes.strategies.compute.compile.compile_blocks`, the function training's ``model.compile``
  calls, with its default backend (inductor). ``eager+cuda_graphs`` and ``compiled+cuda_graphs``: the same
  two with ``strategy.cuda_graphs`` (:mod:`pipeline_recipes.strategies.compute.cuda_graphs`: each repeated block's
  forward and backward replayed as CUDA graphs), at 4 × 4 only (at 16 × 1 the graph pool would hold a second
  copy of a 16-sample micro-batch's activations: status ``not measured ...``), under autocast
  without its weight cache (``make_graphed_callables`` needs that; Lightning's ``bf16-mixed`` runs so), and
  measured in rounds of their own after the other rows (their pools stay allocated while they run); on a
  CPU their status is ``needs CUDA: ...``.
* ``transformers``: the plain loop of ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (the same config and
  weights, so the same GELU; ``sdpa`` attention): forward with ``labels``, i.e. the whole micro-batch's
  logits upcast to fp32 and ``ForCausalLMLoss``, backward of the loss over the micro-batches.
* ``handwritten``: a nanoGPT-style model of the same shape written here (Karpathy's nanoGPT ``model.py``):
  fused QKV projection, ``scaled_dot_product_attention(is_causal=True)``; GPT-2's tanh GELU MLP and
  LayerNorm; for Llama grouped-query attention, rotary position embeddings (Su et al., "RoFormer", §3.4;
  the frequencies of the transformers model, so Llama 3's scaling too), SwiGLU (Shazeer, "GLU Variants
  Improve Transformer", §2) and RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", §4);
  its loss is the stage's chunked one (same ``loss_chunk_tokens``), so the two differ in their blocks
  only. ``eager``; ``compiled``: each block through its own ``torch.compile`` (same backend);
  ``eager+whole_logits`` (4 × 4 only): eager with the loss over the whole micro-batch's logits
  (``loss_chunk_tokens=null``), so ``eager`` ÷ it is the chunked loss's price in time (its head product
  done twice) and its memory what the chunks save.
  ``tests/e2e/test_gpu_check.py`` checks on the CPU that it computes the transformers model's loss and gradients.

Compiling happens in a compiled row's warm-up steps (at least ``COMPILE_WARMUP``, also under ``--tiny``),
never in a timed round: ``models[name]["graphs_compiled_in_timed_rounds"]`` counts TorchDynamo's graphs
compiled during the rounds (0 when so). The compiled stage shares its block modules with the eager stage
and the transformers rows, so its compiled calls are switched on only during its own steps.

Every row trains in bf16 autocast with fp32 weights and one fused AdamW step per mini-batch. The rows
share one set of weights (the hand-written Llama adds its fused QKV matrices) and one optimizer state:
three 1.2–1.4 B models with their AdamW states would not fit one GPU side by side, and sharing changes
no shape and no amount of work. A row's gradients are released after its step.

Measured per row: the step's wall time (the device synchronised before and after, optimizer step
included) in ``rounds`` interleaved rounds after ``warmup`` steps (one step of every row per round, the
order rotating; medians reported), tokens/s, model FLOPs utilisation with the project's FLOP count
(:mod:`pipeline_recipes.recipe.report.flops`: ``6·N + 12·L·d·T`` per token, PaLM's Appendix B; the device's dense bf16 peak),
forward and backward time (CUDA events: the stage path's measured timeline, the anchors' events around
each forward and backward; summed over the micro-batches) and the peak reserved memory of one more
step (``torch.cuda.max_memory_reserved``, the caching allocator emptied and the peaks reset before each
row). A row that runs out of memory is kept with its error as its status, a compiled row where the
compiler cannot run with ``not compiled: `` and the reason. ``--tiny`` (``gpt2-tiny``,
``llama-tiny``; no warm-up but the compiled rows', 2 rounds) is the smoke run of the same code; on a
CPU the times are host times and there is no MFU or memory figure.

JSON: ``{"rows": [...], "models": {name: sizes, FLOPs per token, loss_chunk_tokens,
graphs_compiled_in_timed_rounds}, "settings": {...}, "meta": {...}}``;
a row: ``model``, ``micro_batch`` ("16x1"), ``system``, ``mode``, ``status``, and where it ran ``step_s``,
``tokens_per_s``, ``tflops_per_device``, ``mfu``, ``forward_s``, ``backward_s``, ``peak_reserved_bytes``,
``peak_allocated_bytes``, ``allocated_before_bytes`` (allocated when that step began: the weights and
optimizer state, and anything an earlier row left behind), ``times_s`` (every round). ``python scripts/bench_gpu.py --summary OUT_DIR
tests=RC bench=RC`` writes ``scripts/gpu_check.sh``'s ``summary.json``.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "bench_gpu.json"
MODELS = ("gpt2", "llama3-1b")
TINY_MODELS = ("gpt2-tiny", "llama-tiny")
SAMPLES = 16  # per step
MICRO_BATCHES = ((16, 1), (4, 4))  # (micro-batch size, micro-batches)
SCHEDULE = "dapple"  # at D = 1: forward, backward, forward, backward, ... (gradient accumulation)
STAGE_MODES = ("eager", "compiled", "eager+cuda_graphs", "compiled+cuda_graphs")
NEEDS_CUDA = "needs CUDA: CUDA graphs replay on a GPU only"
NOT_LAUNCH_BOUND = ("not measured at 16 x 1: its CUDA graph pool would keep a second copy of a 16-sample "
                    "micro-batch's activations beside the other rows'")
CUDA_GRAPHS_MAX_MICRO_BATCH = 4  # the graph rows run the small micro-batches only
WHOLE_LOGITS = "eager+whole_logits"  # the hand-written model with the loss over the whole logits
WHOLE_LOGITS_MAX_MICRO_BATCH = 4
WHOLE_LOGITS_TOO_LARGE = ("not measured at 16 x 1: the fp32 logits of a 16-sample micro-batch are what the "
                          "transformers row runs out of memory on")
CUDA_GRAPHS_WARMUP = 3  # warm-up steps of a CUDA graph row at least: records, captures (and compiles), replays
COMPILE_BACKEND = "inductor"  # torch.compile's default, as model.compile uses it
COMPILE_WARMUP = 2  # warm-up steps of a compiled row at least: the first compiles, the second runs the graphs
PRECISION = "bf16-mixed"
LR, WEIGHT_DECAY = 1e-5, 0.1


# -- the hand-written models -------------------------------------------------------------------------


def _affine(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``x @ weight + bias`` with ``weight`` stored (in, out), as GPT-2's checkpoints store it."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[-1])


class HandGPT2Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (pre-LayerNorm, nanoGPT's ``Block``)."""

    def __init__(self, hf_block: nn.Module, config: Any) -> None:
        super().__init__()
        a, m = hf_block.attn, hf_block.mlp
        self.ln_1_w, self.ln_1_b, self.ln_2_w, self.ln_2_b = (hf_block.ln_1.weight, hf_block.ln_1.bias,
                                                              hf_block.ln_2.weight, hf_block.ln_2.bias)
        self.qkv_w, self.qkv_b = a.c_attn.weight, a.c_attn.bias  # one (d, 3d) matrix: fused QKV
        self.proj_w, self.proj_b = a.c_proj.weight, a.c_proj.bias
        self.fc_w, self.fc_b, self.out_w, self.out_b = m.c_fc.weight, m.c_fc.bias, m.c_proj.weight, m.c_proj.bias
        self.heads, self.eps = int(config.n_head), float(config.layer_norm_epsilon)
        self.attn_p, self.resid = float(config.attn_pdrop), nn.Dropout(float(config.resid_pdrop))

    def forward(self, x: Tensor) -> Tensor:
        B, T, d = x.shape
        h = F.layer_norm(x, (d,), self.ln_1_w, self.ln_1_b, self.eps)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2)
                   for t in _affine(h, self.qkv_w, self.qkv_b).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_p if self.training else 0.0)
        x = x + self.resid(_affine(y.transpose(1, 2).reshape(B, T, d), self.proj_w, self.proj_b))
        h = F.layer_norm(x, (d,), self.ln_2_w, self.ln_2_b, self.eps)
        h = F.gelu(_affine(h, self.fc_w, self.fc_b), approximate="tanh")
        return x + self.resid(_affine(h, self.out_w, self.out_b))


class HandGPT2(nn.Module):
    """GPT-2 written out (nanoGPT's ``GPT``) on the parameters of a ``GPT2LMHeadModel``: ``input_ids -> logits``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        t, config = hf.transformer, hf.config
        self.wte, self.wpe, self.lm_head = t.wte.weight, t.wpe.weight, hf.lm_head.weight
        self.ln_f_w, self.ln_f_b, self.eps = t.ln_f.weight, t.ln_f.bias, float(config.layer_norm_epsilon)
        self.drop = nn.Dropout(float(config.embd_pdrop))
        self.blocks = nn.ModuleList(HandGPT2Block(block, config) for block in t.h)

    def hidden(self, input_ids: Tensor, blocks: Sequence[Callable[..., Tensor]] | None = None) -> Tensor:
        """The final LayerNorm's output; ``blocks``: callables to run instead of ``self.blocks`` (compiled ones)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe))
        for block in self.blocks if blocks is None else blocks:
            x = block(x)
        return F.layer_norm(x, (x.shape[-1],), self.ln_f_w, self.ln_f_b, self.eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.linear(self.hidden(input_ids), self.lm_head)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32, cast back before the gain (as Llama's reference code)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` (B, heads, T, hd): the two halves of each head rotated by the position's angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class HandLlamaBlock(nn.Module):
    """``x + attn(rms(x))`` with GQA and RoPE, then ``x + swiglu(rms(x))``."""

    def __init__(self, hf_layer: nn.Module, config: Any) -> None:
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        if a.o_proj.bias is not None or m.gate_proj.bias is not None:
            raise ValueError("the hand-written Llama has no output-projection or MLP biases (attention_bias on "
                             "o_proj, mlp_bias); benchmark a config without them")
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.head_dim = int(a.head_dim)
        with torch.no_grad():  # one (q + 2 kv heads) × d matrix: the only weights this model does not share
            self.qkv_w = nn.Parameter(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            self.qkv_b = nn.Parameter(torch.cat(biases)) if all(b is not None for b in biases) else None
        self.o_w = a.o_proj.weight
        self.gate_w, self.up_w, self.down_w = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
        self.norm_1, self.norm_2 = hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight
        self.eps = float(config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        hd, sizes = self.head_dim, (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                    self.kv_heads * self.head_dim)
        q, k, v = F.linear(_rms_norm(x, self.norm_1, self.eps), self.qkv_w, self.qkv_b).split(sizes, dim=-1)
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, -1), self.o_w)
        h = _rms_norm(x, self.norm_2, self.eps)
        return x + F.linear(F.silu(F.linear(h, self.gate_w)) * F.linear(h, self.up_w), self.down_w)


class HandLlama(nn.Module):
    """Llama written out on the parameters of a ``LlamaForCausalLM``: ``input_ids -> logits``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        base, config = hf.model, hf.config
        self.embed, self.lm_head = base.embed_tokens.weight, hf.lm_head.weight  # one Parameter when tied
        self.norm, self.eps = base.norm.weight, float(config.rms_norm_eps)
        self.register_buffer("inv_freq", base.rotary_emb.inv_freq, persistent=False)
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.blocks = nn.ModuleList(HandLlamaBlock(layer, config) for layer in base.layers)

    def hidden(self, input_ids: Tensor, blocks: Sequence[Callable[..., Tensor]] | None = None) -> Tensor:
        """The final RMSNorm's output; ``blocks``: callables to run instead of ``self.blocks`` (compiled ones)."""
        x = F.embedding(input_ids, self.embed)
        angles = torch.arange(input_ids.shape[1], device=x.device, dtype=torch.float32)[:, None] * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = ((angles.cos() * self.rope_scale).to(x.dtype), (angles.sin() * self.rope_scale).to(x.dtype))
        for block in self.blocks if blocks is None else blocks:
            x = block(x, cos, sin)
        return _rms_norm(x, self.norm, self.eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.linear(self.hidden(input_ids), self.lm_head)


def handwritten_loss(hand: HandGPT2 | HandLlama, input_ids: Tensor, chunk: int | None,
                     blocks: Sequence[Callable[..., Tensor]] | None = None) -> Tensor:
    """The next-token loss of ``hand`` on ``input_ids`` (the mean over the predicted tokens), its head
    projected ``chunk`` tokens at a time as the project's models do (``model.loss_chunk_tokens``:
    :func:`pipeline_recipes.models.lm_loss.linear_cross_entropy`; ``None``: the whole logits)."""
    from pipeline_recipes.core.pipeline_model import IGNORE_INDEX
    from pipeline_recipes.models.causal_lm import shift_labels
    from pipeline_recipes.models.lm_loss import linear_cross_entropy

    targets = shift_labels(input_ids)
    losses = linear_cross_entropy(hand.hidden(input_ids, blocks), hand.lm_head, None, targets, chunk)
    return losses.sum() / (targets != IGNORE_INDEX).sum()


def compiled_blocks(hand: HandGPT2 | HandLlama, backend: str) -> list[Callable[..., Tensor]]:
    """Each block of ``hand`` through ``torch.compile`` (its own wrapper: ``hand`` itself stays eager)."""
    return [torch.compile(block, backend=backend, dynamic=False) for block in hand.blocks]


def handwritten(hf: nn.Module) -> nn.Module:
    """The hand-written twin of a transformers GPT-2 or Llama model, on its weights."""
    kind = hf.config.model_type
    if kind == "gpt2":
        return HandGPT2(hf)
    if kind == "llama":
        return HandLlama(hf)
    raise ValueError(f"no hand-written model for model_type={kind!r}; the GPU benchmark has gpt2 and llama")


# -- rows ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Marks:
    """Points in one step: CUDA events on a GPU (execution, not launch, times), host times on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def seconds(self, i: int, j: int) -> float:
        """From point ``i`` to point ``j`` (after the device finished both)."""
        a, b = self.points[i], self.points[j]
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


Step = Callable[[], Callable[[], tuple[float, float]]]  # runs one step; returns its (forward_s, backward_s) reader


@dataclass
class Row:
    """One system at one micro-batch split; ``step`` is None for a row that does not run."""

    model: str
    micro_batch_size: int
    micro_batches: int
    system: str
    mode: str = "eager"
    step: Step | None = None
    status: str = "ok"
    min_warmup: int = 0  # a compiled row compiles in its warm-up steps, never in a timed round
    times_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    peak_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    allocated_before_bytes: int | None = None  # what was allocated when its memory step began

    @property
    def label(self) -> str:
        return f"{self.model} {self.micro_batch_size}x{self.micro_batches} {self.system}:{self.mode}"


def _loop_step(forward: Callable[[Tensor], Tensor], batches: list[Tensor], optimizer: torch.optim.Optimizer,
               autocast: Callable[[], AbstractContextManager], device: torch.device) -> Step:
    """A plain training step: forward and backward of each micro-batch (the loss averaged over them), then
    the optimizer; events around every forward and backward."""

    def step() -> Callable[[], tuple[float, float]]:
        marks = _Marks(device)
        for ids in batches:
            marks.mark()
            with autocast():
                loss = forward(ids)
            marks.mark()
            (loss / len(batches)).backward()
            marks.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        n = len(batches)
        return lambda: (sum(marks.seconds(3 * i, 3 * i + 1) for i in range(n)),
                        sum(marks.seconds(3 * i + 1, 3 * i + 2) for i in range(n)))

    return step


def _stage_step(engine: Any, batch: dict[str, Tensor], optimizer: torch.optim.Optimizer,
                autocast: Callable[[], AbstractContextManager],
                blocks: Callable[[], AbstractContextManager] = nullcontext) -> Step:
    """The engine's step (inside ``blocks()``: the compiled blocks switched on), then the optimizer;
    forward and backward from the engine's measured timeline."""

    def step() -> Callable[[], tuple[float, float]]:
        with blocks(), autocast():
            engine.train_step(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = engine.last_record

        def read() -> tuple[float, float]:
            boxes = record.timeline
            return (sum(end - start for action, start, end in boxes if action.kind == "F"),
                    sum(end - start for action, start, end in boxes if action.kind != "F"))

        return read

    return step


def compile_stage(model: Any, device: torch.device,
                  backend: str) -> tuple[Callable[[], AbstractContextManager] | None, str]:
    """Compile the repeated blocks of ``model``'s layers as training does
    (:func:`pipeline_recipes.strategies.compute.compile.compile_blocks`), then switch them back to eager: the
    eager stage row and the transformers row run the very same block modules. Returns a context manager
    factory under which the blocks run compiled (None where the compiler cannot run) and the log line.

    ``nn.Module.compile`` stores the compiled call in the module's ``_compiled_call_impl`` (torch ≥ 2.2),
    which ``nn.Module.__call__`` uses when set; switching it keeps the compiled code and its caches."""
    from pipeline_recipes.strategies.compute.compile import compile_blocks, compile_target, repeated_blocks

    layers = model.pipeline_layers()
    indices = repeated_blocks(layers)
    done = compile_blocks(layers, indices, device, backend=backend)
    if done.fallback is not None:
        return None, done.describe()
    targets = [compile_target(layers[i]) for i in indices]
    calls = [target._compiled_call_impl for target in targets]
    if any(call is None for call in calls):
        raise RuntimeError("compile_blocks left a repeated block uncompiled; the compiled stage row cannot run")
    for target in targets:
        target._compiled_call_impl = None

    @contextmanager
    def compiled() -> Iterator[None]:
        for target, call in zip(targets, calls):
            target._compiled_call_impl = call
        try:
            yield
        finally:
            for target in targets:
                target._compiled_call_impl = None

    return compiled, done.describe()


def graph_stage(model: Any, batch: dict[str, Tensor], optimizer: torch.optim.Optimizer, micro_batch_size: int,
                device: torch.device, blocks: Callable[[], AbstractContextManager]) -> tuple[Step | None, str]:
    """The stage row with ``strategy.cuda_graphs``: its own engine whose repeated blocks replay CUDA graphs
    (:mod:`pipeline_recipes.strategies.compute.cuda_graphs`), switched on during its steps only (inside ``blocks()``:
    the compiled blocks for ``compiled+cuda_graphs``), under autocast without its weight cache, as
    ``make_graphed_callables`` requires (Lightning's ``bf16-mixed`` runs so). Its first warm-up step records
    the blocks' calls, the second captures them. None and the reason where it cannot run."""
    from pipeline_recipes.strategies.compute.compile import repeated_blocks
    from pipeline_recipes.strategies.compute.cuda_graphs import StageGraphs
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    if device.type != "cuda":
        return None, NEEDS_CUDA
    if micro_batch_size > CUDA_GRAPHS_MAX_MICRO_BATCH:
        return None, NOT_LAUNCH_BOUND
    samples = next(v.shape[0] for v in batch.values())  # the row's mini-batch: N = samples / B micro-batches
    engine = build_engine(model, derive_layout(SCHEDULE, 1, 1, samples, B=micro_batch_size, cuda_graphs=True), device)
    layers = model.pipeline_layers()
    graphs = StageGraphs(engine.stage_layers, layers, repeated_blocks(layers), 0,
                         report=lambda line: print(f"[gpu bench] {line}", file=sys.stderr, flush=True))
    graphs.switch(False)  # the other rows run the same block modules
    engine.stage_graphs = graphs

    @contextmanager
    def switched_on() -> Iterator[None]:
        with graphs.switched_on(), blocks():
            yield

    def autocast() -> AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)

    return _stage_step(engine, batch, optimizer, autocast, switched_on), "ok"


def _out_of_memory(err: BaseException) -> BaseException | None:
    """The out-of-memory error behind ``err`` (the engine wraps an action's error in a ``StepError``)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, torch.OutOfMemoryError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _run(row: Row, device: torch.device, params: list[nn.Parameter]) -> bool:
    """One timed step of ``row``; False (and the row's status says why) when it ran out of memory."""
    _sync(device)
    start = time.perf_counter()
    try:
        read = row.step()
        _sync(device)
    except Exception as err:  # noqa: BLE001 - out of memory ends the row; anything else is a bug
        oom = _out_of_memory(err)
        if oom is None:
            raise
        row.status = "out of memory: " + str(oom).splitlines()[0]
        row.step = None
        del oom
    else:
        row.times_s.append(time.perf_counter() - start)
        fwd, bwd = read()
        row.forward_s.append(fwd)
        row.backward_s.append(bwd)
        return True
    for p in params:  # outside the handler: the exception's frames hold the failed step's tensors
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return False


def _graphs() -> int:
    """Graphs TorchDynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _measure(rows: list[Row], device: torch.device, params: list[nn.Parameter], warmup: int, rounds: int) -> int:
    """Warm-up steps, then ``rounds`` rounds of one step per row in a rotating order (the machine's drift
    spreads over every row), then, on a GPU, one step per row for its peak memory. Returns the graphs
    compiled during the timed rounds (0: compiling was all done in the warm-up steps)."""
    def running() -> list[Row]:
        return [row for row in rows if row.step is not None]

    for row in running():
        for _ in range(max(warmup, row.min_warmup)):
            if not _run(row, device, params):
                print(f"[gpu bench] {row.label}: {row.status}", file=sys.stderr, flush=True)
                break
        row.times_s, row.forward_s, row.backward_s = [], [], []
    graphs = _graphs()
    for r in range(rounds):
        active = running()
        for row in active[r % len(active):] + active[:r % len(active)] if active else []:
            if not _run(row, device, params):
                print(f"[gpu bench] {row.label}: {row.status}", file=sys.stderr, flush=True)
    graphs = _graphs() - graphs
    if graphs:
        print(f"[gpu bench] {graphs} graphs compiled during the timed rounds: their rows' times include compiling",
              file=sys.stderr, flush=True)
    if device.type != "cuda":
        return graphs
    for row in running():
        times = list(row.times_s), list(row.forward_s), list(row.backward_s)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        row.allocated_before_bytes = int(torch.cuda.memory_allocated(device))
        if _run(row, device, params):
            row.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(device))
            row.peak_allocated_bytes = int(torch.cuda.max_memory_allocated(device))
        row.times_s, row.forward_s, row.backward_s = times  # the memory step is not a timed round
    return graphs


def _model_rows(name: str, device: torch.device, warmup: int, rounds: int,
                backend: str = COMPILE_BACKEND) -> tuple[list[dict], dict[str, Any]]:
    """Every row of one model (see the module docstring), measured together, and the model's sizes;
    ``backend``: ``torch.compile``'s for the compiled rows."""
    from pipeline_recipes.models import build_model
    from pipeline_recipes.models.presets import preset
    from pipeline_recipes.recipe.report.flops import flops_per_token, matmul_parameters, resolve_utilisation, transformer_shape
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    model = build_model(name, init_seed=0, device="meta")
    seq_len, vocab = model.seq_len, int(model.config.vocab_size)
    engines = {(mbs, n): build_engine(model, derive_layout(SCHEDULE, 1, 1, mbs * n, B=mbs), device)
               for mbs, n in MICRO_BATCHES}
    model.train()
    hf = model.reference()  # the transformers model on the same parameters
    hand = handwritten(hf).to(device).train()
    params = list({id(p): p for m in (model, hand) for p in m.parameters() if p.requires_grad}.values())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    flops = flops_per_token(matmul_parameters(hf), *transformer_shape(preset(name)), seq_len)
    utilisation = resolve_utilisation(flops, 1, device, PRECISION)  # one device; its dense bf16 peak
    ids = torch.randint(0, vocab, (SAMPLES, seq_len), generator=torch.Generator().manual_seed(0)).to(device)

    def autocast() -> AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16)

    compiled, line = compile_stage(model, device, backend)
    print(f"[gpu bench] {name}: {line}", file=sys.stderr, flush=True)
    hand_blocks = compiled_blocks(hand, backend) if compiled is not None else None
    not_compiled = f"not compiled: {line}"
    chunk = model.loss_chunk_tokens

    def hand_loss(blocks: list[Callable[..., Tensor]] | None) -> Callable[[Tensor], Tensor]:
        return lambda x: handwritten_loss(hand, x, chunk, blocks)

    rows, graph_rows = [], []
    for mbs, n in MICRO_BATCHES:
        batches = list(ids.split(mbs))
        engine, batch = engines[(mbs, n)], {"input_ids": ids}
        for mode in STAGE_MODES:
            if mode == "eager":
                rows.append(Row(name, mbs, n, "stage", mode, _stage_step(engine, batch, optimizer, autocast)))
            elif mode == "compiled" and compiled is not None:
                rows.append(Row(name, mbs, n, "stage", mode, _stage_step(engine, batch, optimizer, autocast, compiled),
                                min_warmup=COMPILE_WARMUP))
            elif mode == "compiled":
                rows.append(Row(name, mbs, n, "stage", mode, None, not_compiled))
            else:
                blocks = compiled if mode == "compiled+cuda_graphs" else nullcontext
                step, status = (graph_stage(model, batch, optimizer, mbs, device, blocks) if blocks is not None
                                else (None, not_compiled))
                rows.append(Row(name, mbs, n, "stage", mode, step, status, min_warmup=CUDA_GRAPHS_WARMUP))
                graph_rows.append(rows[-1])
        rows.append(Row(name, mbs, n, "transformers", "eager",
                        _loop_step(lambda x: hf(input_ids=x, labels=x).loss, batches, optimizer, autocast, device)))
        rows.append(Row(name, mbs, n, "handwritten", "eager",
                        _loop_step(hand_loss(None), batches, optimizer, autocast, device)))
        rows.append(Row(name, mbs, n, "handwritten", "compiled",
                        _loop_step(hand_loss(hand_blocks), batches, optimizer, autocast, device)
                        if hand_blocks is not None else None,
                        "ok" if hand_blocks is not None else not_compiled, min_warmup=COMPILE_WARMUP))
        whole = mbs <= WHOLE_LOGITS_MAX_MICRO_BATCH
        rows.append(Row(name, mbs, n, "handwritten", WHOLE_LOGITS,
                        _loop_step(lambda x: handwritten_loss(hand, x, None), batches, optimizer, autocast, device)
                        if whole else None, "ok" if whole else WHOLE_LOGITS_TOO_LARGE))
    graphs_in_rounds = _measure([r for r in rows if r not in graph_rows], device, params, warmup, rounds)
    # the CUDA graph rows after the others: their memory pools stay allocated while they are measured
    graphs_in_rounds += _measure(graph_rows, device, params, warmup, rounds)
    for row in graph_rows:
        row.step = None  # the engine, its graphs and their pools go with the closure
    out = []
    for row in rows:
        entry: dict[str, Any] = {"model": name, "micro_batch": f"{row.micro_batch_size}x{row.micro_batches}",
                                 "micro_batch_size": row.micro_batch_size, "micro_batches": row.micro_batches,
                                 "system": row.system, "mode": row.mode, "status": row.status}
        if row.status == "ok" and row.times_s:
            step_s = statistics.median(row.times_s)
            tokens_per_s = SAMPLES * seq_len / step_s
            entry.update({"step_s": step_s, "tokens_per_s": tokens_per_s,
                          "tflops_per_device": utilisation.tflops_per_device(tokens_per_s),
                          "mfu": utilisation.mfu(tokens_per_s),
                          "forward_s": statistics.median(row.forward_s),
                          "backward_s": statistics.median(row.backward_s),
                          "peak_reserved_bytes": row.peak_reserved_bytes,
                          "peak_allocated_bytes": row.peak_allocated_bytes,
                          "allocated_before_bytes": row.allocated_before_bytes,
                          "times_s": row.times_s})
        out.append(entry)
    shared = {id(p) for p in model.parameters()}
    info = {"seq_len": seq_len, "tokens_per_step": SAMPLES * seq_len, "flops_per_token": flops,
            "parameters": model.num_parameters(),
            "handwritten_own_parameters": sum(p.numel() for p in hand.parameters() if id(p) not in shared),
            "loss_chunk_tokens": chunk, "graphs_compiled_in_timed_rounds": graphs_in_rounds}
    return out, info


def _init_world(device: torch.device) -> None:
    """A process group of one rank (the engine's collectives): NCCL on a GPU, gloo on a CPU."""
    import torch.distributed as dist

    from pipeline_recipes.strategies.harness.spawn import free_port

    if dist.is_initialized():
        return
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, device_id=device if cuda else None)


def run(out: Path, *, device: str = "cuda", tiny: bool = False, warmup: int | None = None,
        rounds: int | None = None, command: str = "", machine: dict[str, Any] | None = None,
        compile_backend: str = COMPILE_BACKEND) -> dict[str, Any]:
    """Measure every row, write ``out`` (JSON) after each model, print the table; return the record.
    ``compile_backend``: ``torch.compile``'s backend of the compiled rows (the CPU test's cheaper
    ``aot_eager`` traces the same graphs without generating kernels)."""
    import torch.distributed as dist

    from pipeline_recipes.recipe.report.flops import resolve_utilisation

    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"the GPU benchmark needs CUDA, but torch {torch.__version__} sees no GPU; run "
                               "it on a GPU machine (bash scripts/gpu_check.sh OUT), or --device cpu --tiny for the "
                               "smoke run")
        target = torch.device("cuda", torch.cuda.current_device() if target.index is None else target.index)
        torch.cuda.set_device(target)
    warmup = (0 if tiny else 2) if warmup is None else warmup
    rounds = (2 if tiny else 5) if rounds is None else rounds
    began = time.perf_counter()
    peak = resolve_utilisation(None, 1, target, PRECISION)
    record: dict[str, Any] = {
        "rows": [],
        "models": {},
        "settings": {"models": list(TINY_MODELS if tiny else MODELS), "samples_per_step": SAMPLES,
                     "micro_batches": [f"{m}x{n}" for m, n in MICRO_BATCHES], "stage_schedule": SCHEDULE,
                     "stage_modes": list(STAGE_MODES), "compile_backend": compile_backend, "precision": PRECISION,
                     "optimizer": f"AdamW(fused=True, lr={LR}, weight_decay={WEIGHT_DECAY})",
                     "warmup": warmup, "rounds": rounds, "device": str(target), "tiny": tiny},
        "meta": {**(machine or {}), "command": command, "device_name": torch.cuda.get_device_name(target)
                 if target.type == "cuda" else platform.processor() or platform.machine(),
                 "cuda": torch.version.cuda, "transformers": _version("transformers"),
                 "peak_tflops": peak.peak_tflops, "peak_label": peak.peak_label,
                 "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }
    _init_world(target)
    try:
        for name in record["settings"]["models"]:
            start = time.perf_counter()
            print(f"[gpu bench] {name} ...", file=sys.stderr, flush=True)
            rows, record["models"][name] = _model_rows(name, target, warmup, rounds, compile_backend)
            record["rows"] += rows
            gc.collect()  # the model, its optimizer state and its rows' closures are gone: free their memory
            if target.type == "cuda":
                torch.cuda.empty_cache()
            record["meta"].setdefault("model_wall_s", {})[name] = round(time.perf_counter() - start, 1)
            record["meta"]["wall_s"] = round(time.perf_counter() - began, 1)
            _write(out, record)
    finally:
        dist.destroy_process_group()
    print(markdown_table(record))
    return record


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _write(out: Path, record: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")


def markdown_table(record: dict[str, Any], again: dict[str, Any] | None = None) -> str:
    """The rows as BENCHMARKS.md shows them; with ``again`` (a second run of the same command) its tokens/s
    beside the first's, and each status cut to its first words (the JSON keeps the whole message)."""

    def num(value: Any, scale: float = 1.0, digits: int = 1) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        return f"{value * scale:.{digits}f}"

    def status(r: dict[str, Any]) -> str:
        return "" if r["status"] == "ok" else r["status"].split(":")[0] if again else r["status"]

    second = {} if again is None else {_row_key(r): r for r in again["rows"]}
    head = ("| model | micro-batch | system | mode | tokens/s |" + (" run 2 |" if again else "")
            + " MFU % | step ms | forward ms | backward ms | peak reserved GiB | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in record["rows"]:
        other = second.get(_row_key(r), {})
        lines.append(f"| {r['model']} | {r['micro_batch']} | {r['system']} | {r['mode']} "
                     f"| {num(r.get('tokens_per_s'), 1, 0)} "
                     + (f"| {num(other.get('tokens_per_s'), 1, 0)} " if again else "")
                     + f"| {num(r.get('mfu'), 100)} "
                     f"| {num(r.get('step_s'), 1e3, 0)} | {num(r.get('forward_s'), 1e3, 0)} "
                     f"| {num(r.get('backward_s'), 1e3, 0)} "
                     f"| {num(r.get('peak_reserved_bytes'), 2**-30)} "
                     f"| {status(r)} |")
    return "\n".join(lines)


# -- the targets, read off one or two records -------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One target of the GPU benchmark: a ratio of two rows' figures and the bound it must keep."""

    micro_batch: str
    what: str
    goal: str  # ">= 0.95" or "<= 1.1"

    def met(self, value: float) -> bool:
        bound = float(self.goal.split()[1])
        return value >= bound if self.goal.startswith(">=") else value <= bound


def _row_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """What names a row in a record: model, micro-batch ("4x4"), system and mode."""
    return row["model"], row["micro_batch"], row["system"], row["mode"]


def _row(record: dict[str, Any], model: str, micro_batch: str, system: str, mode: str) -> dict[str, Any] | None:
    """The row so named, if it ran."""
    return next((r for r in record["rows"] if _row_key(r) == (model, micro_batch, system, mode)
                 and r["status"] == "ok"), None)


def fastest_stage_mode(record: dict[str, Any], model: str, micro_batch: str) -> str | None:
    """The stage row with the most tokens/s at this micro-batch (what a user tuning the run would pick)."""
    rows = [r for r in record["rows"] if (r["model"], r["micro_batch"], r["system"], r["status"])
            == (model, micro_batch, "stage", "ok")]
    return max(rows, key=lambda r: r["tokens_per_s"])["mode"] if rows else None


def _ratios(record: dict[str, Any], model: str, fast_mode: str | None) -> dict[Target, float | None]:
    """Each target's value in one record; ``fast_mode``: the 4 x 4 stage row the targets on it read."""

    def ratio(mb: str, a: tuple[str, str], b: tuple[str, str], key: str) -> float | None:
        x, y = _row(record, model, mb, *a), _row(record, model, mb, *b)
        return None if x is None or y is None else x[key] / y[key]

    fast = ("stage", fast_mode or "")
    row = _row(record, model, "4x4", *fast)
    return {
        Target("16x1", "stage eager ÷ hand-written eager, tokens/s", ">= 0.95"):
            ratio("16x1", ("stage", "eager"), ("handwritten", "eager"), "tokens_per_s"),
        Target("16x1", "stage compiled ÷ hand-written compiled, tokens/s", ">= 0.95"):
            ratio("16x1", ("stage", "compiled"), ("handwritten", "compiled"), "tokens_per_s"),
        Target("16x1", "stage eager ÷ hand-written eager, peak reserved", "<= 1.1"):
            ratio("16x1", ("stage", "eager"), ("handwritten", "eager"), "peak_reserved_bytes"),
        Target("4x4", f"stage {fast_mode} ÷ hand-written compiled, tokens/s", ">= 0.95"):
            ratio("4x4", fast, ("handwritten", "compiled"), "tokens_per_s"),
        Target("4x4", f"stage {fast_mode} ÷ stage eager, tokens/s", ">= 1.4"):
            ratio("4x4", fast, ("stage", "eager"), "tokens_per_s"),
        Target("4x4", f"stage {fast_mode}: forward ÷ backward", "<= 0.6"):
            None if row is None or not row.get("backward_s") else row["forward_s"] / row["backward_s"],
    }


def speed_bound(record: dict[str, Any], model: str) -> float | None:
    """The most tokens/s any row of ``model`` reached (any system, mode or micro-batch) ÷ the 4 x 4 eager
    stage's: what a 4 x 4 step could gain if it ran at the record's best efficiency on this GPU, an upper
    bound for the "÷ stage eager" target (not a target itself)."""
    eager = _row(record, model, "4x4", "stage", "eager")
    best = [r["tokens_per_s"] for r in record["rows"] if r["model"] == model and r["status"] == "ok"]
    return None if eager is None or not best else max(best) / eager["tokens_per_s"]


def target_table(record: dict[str, Any], again: dict[str, Any] | None = None) -> str:
    """The targets of every model in ``record`` as a markdown table; with ``again`` (a second run of the
    same command) each value from both runs and the run-to-run spread of the 4 x 4 stage row the targets
    read (|a - b| ÷ the smaller, goal <= 0.05); last, each model's :func:`speed_bound` (goal and met: "-")."""
    head = "| model | micro-batch | target | goal | run 1 |" + (" run 2 |" if again else "") + " met |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    for model in record["models"]:
        fast_mode = fastest_stage_mode(record, model, "4x4")
        first = _ratios(record, model, fast_mode)
        second = _ratios(again, model, fast_mode) if again else {}
        for target, value in first.items():
            values = [value] + ([second.get(target)] if again else [])
            met = all(v is not None and target.met(v) for v in values)
            lines.append(f"| {model} | {target.micro_batch} | {target.what} | {target.goal} | "
                         + " | ".join(cell(v) for v in values) + f" | {'yes' if met else 'no'} |")
        if again:
            a, b = _row(record, model, "4x4", "stage", fast_mode or ""), _row(again, model, "4x4", "stage",
                                                                               fast_mode or "")
            spread = None if a is None or b is None else (abs(a["tokens_per_s"] - b["tokens_per_s"])
                                                          / min(a["tokens_per_s"], b["tokens_per_s"]))
            met = spread is not None and spread <= 0.05
            lines.append(f"| {model} | 4x4 | stage {fast_mode}: run-to-run spread of tokens/s | <= 0.05 | "
                         f"{cell(spread)} | | {'yes' if met else 'no'} |")
        bounds = [speed_bound(record, model)] + ([speed_bound(again, model)] if again else [])
        lines.append(f"| {model} | 4x4 | bound: the most tokens/s of any row ÷ stage eager | - | "
                     + " | ".join(cell(b) for b in bounds) + " | - |")
    return "\n".join(lines)


# -- the one-command GPU check's summary ---------------------------------------------------------------


def junit_counts(path: Path) -> dict[str, Any]:
    """Counts and failures of a pytest JUnit XML report (``--junitxml``)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                               "message": (node.get("message") or "")[:500]})
    return {**counts, "failed": failed}


def summarize(out_dir: Path, exit_codes: dict[str, int], wall_s: float | None = None) -> dict[str, Any]:
    """``summary.json`` of ``scripts/gpu_check.sh``: the pytest outcome and the benchmark's record."""
    junit, bench = out_dir / "pytest.xml", out_dir / "bench_gpu.json"
    tests = junit_counts(junit) if junit.exists() else None
    record = json.loads(bench.read_text()) if bench.exists() else None
    ok = (exit_codes.get("tests") == 0 and tests is not None and not tests["failed"] and tests["tests"] > 0
          and exit_codes.get("bench") == 0 and record is not None)
    return {"ok": ok, "exit_codes": exit_codes, "wall_s": wall_s,
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tests": tests if tests is not None else "no report (pytest did not finish: see gpu_check.log)",
            "bench": record if record is not None else "no record (the benchmark did not finish: see gpu_check.log)"}


LAYER_BATCHES = (1, 2, 4, 8)  # micro-batch sizes of a layer table (a line per layer through them, CAPTURE §III-B2)


def layer_table(model: str, out: Path, *, device: str = "cuda", batch_sizes: Sequence[int] = LAYER_BATCHES,
                reps: int = 5) -> dict[str, Any]:
    """The device cost table of ``conf/model/<model>.yaml``: each pipeline layer's forward, backward (and no-graph
    forward) seconds and stored / transient / sent bytes at ``batch_sizes``, as lines in the micro-batch
    (:func:`pipeline_recipes.planner.profile.profile_model`, identical blocks timed once, the model built on the meta
    device so that one larger than the GPU is profiled), written as a
    :class:`~pipeline_recipes.planner.model_costs.ModelCosts` JSON with the command and device in ``meta``. A cluster
    names it in ``cost_table`` (``conf/cluster/``) and the planner then uses these times instead of derived ones."""
    from hydra import compose, initialize_config_dir

    from pipeline_recipes.planner.profile import profile_model

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}"])
    costs = profile_model(cfg.model, batch_sizes=batch_sizes, reps=reps, device=device, layers="distinct",
                          budget_s=None)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    record = costs.to_json()
    record["meta"] = {**record.get("meta", {}), "device_name": name, "batch_sizes": list(batch_sizes),
                      "command": " ".join(["python scripts/bench_gpu.py --layer-table", str(out), model, device]),
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


USAGE = ("usage: bench_gpu.py --summary OUT_DIR tests=RC bench=RC [wall_s=S]  (gpu_check.sh's summary.json)\n"
         "       bench_gpu.py --layer-table OUT.json MODEL [DEVICE]  (per-layer cost table; DEVICE default cuda)\n"
         "       bench_gpu.py --targets RUN.json [RUN2.json]  (the targets table; RUN2: the same command again)\n"
         "the benchmark itself runs as python scripts/bench.py --parts gpu")


def main(argv: list[str] | None = None) -> int:
    """``--summary OUT_DIR tests=RC bench=RC [wall_s=S]``: write OUT_DIR/summary.json (used by gpu_check.sh);
    ``--targets RUN.json [RUN2.json]``: print the targets table (and the measured rows' table)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) in (3, 4) and args[0] == "--layer-table":
        layer_table(args[2], Path(args[1]), device=args[3] if len(args) == 4 else "cuda")
        print(f"wrote {args[1]}")
        return 0
    if len(args) in (2, 3) and args[0] == "--targets":
        records = [json.loads(Path(a).read_text()) for a in args[1:]]
        print(markdown_table(*records) + "\n\n" + target_table(*records))
        return 0
    if len(args) < 2 or args[0] != "--summary":
        print(USAGE, file=sys.stderr)
        return 2
    out_dir = Path(args[1])
    values = dict(a.split("=", 1) for a in args[2:])
    wall = float(values.pop("wall_s")) if "wall_s" in values else None
    summary = summarize(out_dir, {k: int(v) for k, v in values.items()}, wall)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    tests = summary["tests"]
    print(f"summary: ok={summary['ok']}; tests: " + (f"{tests['passed']} passed, {len(tests['failed'])} failed, "
          f"{tests['skipped']} skipped" if isinstance(tests, dict) else tests))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
