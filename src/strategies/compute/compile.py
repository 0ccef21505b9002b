"""Compiled stages: every repeated block of a model compiled once, its graph shared by all of them.

``model.compile`` (``auto``: on CUDA, not on CPU; ``true``; ``false``; checked before launch by
:func:`pipeline_recipes.recipe.check.accelerator.resolve_compile`) compiles each repeated block with
``torch.compile`` (PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode Transformation and
Graph Compilation, Ansel et al., ASPLOS 2024: TorchDynamo captures the graph behind guards, TorchInductor
generates its kernels). Regional compilation: the blocks are instances of one class whose parameters are
the graph's inputs, so one graph per input shape and mode serves every block of every stage of the rank,
and compiling costs the same whether a stage holds 2 blocks or 32. ``nn.Module.compile`` works in place:
parameter names, ``state_dict`` keys and checkpoints stay those of the eager model.

What is compiled is the block's own transformer module (the child holding all of the layer's
parameters: ``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``); the pipeline wrapper around it, which
builds the attention mask once per stage forward and the rotary embeddings, stays eager, and so do the
embedding and the head, which run once per stage.

Split backwards (Zero Bubble Pipeline Parallelism, Qi et al. 2024, §2): a traced deferring linear layer
(:mod:`pipeline_recipes.strategies.compute.deferred_weights`) would compute its weight gradient inside the
compiled backward, during ``I``, and leave nothing for ``W``; these layers run eagerly between the
compiled parts of their block (norms, attention, activation, residuals). Recomputation (GPipe §2.3)
compiles the no-grad forward and its replay as two graphs; each autocast dtype, parameter dtype,
micro-batch shape and train/eval mode is another graph (``dynamic=False``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeline_recipes.strategies.compute.deferred_weights import is_deferring

BACKEND = "inductor"
# torch.compile's recompile limit per code object is 8; the blocks of a rank share one code object and a run
# meets a handful of variants per shape (grad/no-grad, train/eval, autocast, halved micro-batches)
RECOMPILE_LIMIT = 64
EAGER_LINEARS = ("the stages that split their backward into I and W run their linear layers eagerly inside the "
                 "compiled blocks (their weight gradients wait for W)")


@dataclass(frozen=True)
class CompiledBlocks:
    """What :func:`compile_blocks` did on this rank: the blocks compiled, those whose deferring linear
    layers run eagerly inside them, and why nothing was compiled (``fallback``: the compiler's error)."""

    compiled: int = 0
    eager_linears: int = 0
    fallback: str | None = None

    def describe(self, split_backward: bool | None = None) -> str:
        """One line for the log; ``split_backward``: whether the schedule splits backwards (else this rank's
        blocks say whether theirs do)."""
        if self.fallback is not None:
            return (f"model.compile: torch.compile cannot run here ({self.fallback}); the blocks run eagerly "
                    "(set model.compile=false to skip this attempt)")
        line = f"model.compile: {self.compiled} repeated block{'s' if self.compiled != 1 else ''} compiled on this rank"
        if split_backward or (split_backward is None and self.eager_linears):
            line += f"; {EAGER_LINEARS}"
        return line


def repeated_blocks(layers: Sequence[nn.Module]) -> list[int]:
    """Indices of the layers whose type occurs more than once among the layers holding parameters: the
    transformer blocks (embedding and head occur once). Call it before a pipeline drops remote layers."""
    types = [type(layer) for layer in layers]
    counts = Counter(t for t, layer in zip(types, layers) if any(True for _ in layer.parameters()))
    return [i for i, t in enumerate(types) if counts[t] > 1]


def compile_target(layer: nn.Module) -> nn.Module:
    """The module of ``layer`` to compile: its child holding every one of its parameters (a wrapper's
    masks and rotary embeddings stay eager), else ``layer`` itself."""
    params = {id(p) for p in layer.parameters()}
    for child in layer.children():
        if params and {id(p) for p in child.parameters()} == params:
            return child
    return layer


def compiler_error(device: torch.device, backend: str = BACKEND) -> str | None:
    """None where ``torch.compile`` with ``backend`` compiles and runs a small function on ``device``;
    else the first line of its error (no C++ compiler, no Triton, an unsupported GPU)."""
    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x * 2.0 + 1.0, approximate="tanh")

    try:
        torch.compile(probe, backend=backend, dynamic=False, fullgraph=True)(torch.ones(4, device=device))
    except Exception as err:  # any failure of the compiler stack means: run eagerly
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
    return None


def compile_blocks(layers: Sequence[nn.Module], blocks: Iterable[int], device: torch.device, *,
                   backend: str = BACKEND) -> CompiledBlocks:
    """Compile in place the :func:`compile_target` of ``layers[i]`` for each ``i`` of ``blocks`` (those this
    rank holds: layers without parameters, a pipeline's remote ones, are skipped); called after the stages
    are built, it counts the blocks with deferring linear layers. Eager, with the reason, where the
    compiler cannot run."""
    targets = [compile_target(layers[i]) for i in blocks if any(True for _ in layers[i].parameters())]
    if not targets:
        return CompiledBlocks()
    error = compiler_error(device, backend)
    if error is not None:
        return CompiledBlocks(fallback=error)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    eager_linears = 0
    for target in targets:
        if any(is_deferring(m) for m in target.modules()):
            eager_linears += 1
        target.compile(backend=backend, dynamic=False)
    return CompiledBlocks(len(targets), eager_linears)


__all__ = ["CompiledBlocks", "compile_blocks", "compile_target", "compiler_error", "repeated_blocks"]
