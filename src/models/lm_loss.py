"""Cross entropy of a vocabulary projection, computed a chunk of tokens at a time.

A language model's head turns ``N`` hidden states into ``N × V`` logits; in fp32, with their softmax
and its gradient, those are the largest tensors of a training step (the Chimera paper's GPT-2, one
micro-batch of 16 × 632 tokens over 50,257 words: 2 GB of logits, as much again for their gradient).
"Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al., ICLR 2025, §4) computes the
loss without ever holding them: each token's log-sum-exp over the vocabulary and its label's logit
are all the loss needs, and the backward can rebuild the softmax a block at a time.
:func:`linear_cross_entropy` does this with ordinary matrix products over chunks of ``chunk`` tokens:

* forward: per chunk, the logits ``h Wᵀ + b`` in the compute dtype (autocast's, else the input's),
  upcast to fp32, and their cross entropy (one log-softmax kernel); kept for the backward are the hidden
  states, the labels and the fp32 losses (the weight is the parameter itself, no copy);
* backward: per chunk, the logits again and ``softmax - one_hot(label)`` in the compute dtype (one
  softmax kernel, fp32 inside, rounded once; the labels' entries ``exp(-loss) - 1`` in fp32), then the
  input, weight and bias gradients of that chunk with each token's output gradient applied to the
  narrow side (the ``chunk × hidden`` input rows and input gradient, not the ``chunk × vocabulary``
  softmax). The weight and bias gradients are summed in fp32 and returned once. Against the
  elementwise passes of autograd's path (upcast, subtract, exponentiate, scale, downcast: about 36
  bytes moved per logit), this moves about 8, which on a GPU is the head's memory-bound share.

So at most one chunk's logits exist at a time, forward or backward, and the result equals
``F.cross_entropy(F.linear(h, W, b).float(), labels, ignore_index=-100, reduction="none")`` (fp32:
to rounding; under autocast: matrix products on half-precision casts and the softmax in fp32, as
"Mixed Precision Training", Micikevicius et al., §3, prescribes and autocast does). The price is one
more matrix product of the head per backward (the logits are computed twice).

The weight gradient is computed inside this function's backward, so under the split backward of
Zero Bubble Pipeline Parallelism (Qi et al., 2024, §2) it lands in ``.grad`` during ``I``, as the
gradients of norms and biases do: deferring it to ``W`` would need the logits a third time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from pipeline_recipes.core.pipeline_model import IGNORE_INDEX

DEFAULT_CHUNK_TOKENS = 4096


def check_chunk_tokens(value: Any, name: str = "model.loss_chunk_tokens") -> int | None:
    """``value`` as a chunk size: a positive integer, or ``None`` (no chunks: the whole logits at once)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r}: the tokens whose logits the LM loss computes at a time must be a "
                         f"positive integer (e.g. {name}={DEFAULT_CHUNK_TOKENS}), or null for the whole micro-batch "
                         "at once")
    return value


def transient_bytes(tokens: int, vocab: int, hidden: int, chunk: int | None, itemsize: int) -> int:
    """Bytes :func:`linear_cross_entropy` holds at its peak beyond its inputs and what the forward saved,
    for ``tokens`` tokens whose products run in a dtype of ``itemsize`` bytes: 8 per logit of one chunk
    (the forward's fp32 logits and their fp32 log-softmax; the backward's logits and softmax in that
    dtype, at most as many bytes), and the weight's cast (none in fp32). The fp32 weight gradient is
    not included (a memory model counts it as the layer's largest parameter). ``chunk=None``: 0, the
    whole logits are saved tensors."""
    if chunk is None:
        return 0
    cast = vocab * hidden * itemsize if itemsize != 4 else 0
    return min(tokens, chunk) * vocab * max(8, 2 * itemsize) + cast


def compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype a matrix product of ``hidden`` runs in: autocast's where it applies, else ``hidden``'s."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.is_floating_point() and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One chunk's logits in ``weight``'s dtype (the compute dtype)."""
    return F.linear(h, weight, None if bias is None else bias.to(weight.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token ``cross_entropy(h Wᵀ + b, labels)`` over chunks of tokens (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk: int,
                dtype: torch.dtype) -> Tensor:
        n = hidden.shape[0]
        losses = hidden.new_empty(n, dtype=torch.float32)
        w = weight.to(dtype)
        for start in range(0, n, chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = _chunk_logits(h, w, bias).float()
            losses[start:start + chunk] = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="none")
            del logits  # before the next chunk's: one chunk's logits at a time
        ctx.save_for_backward(hidden, weight, bias, labels, losses)
        ctx.chunk, ctx.dtype = chunk, dtype
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, losses = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):  # a backward run inside autocast casts nothing
            return _LinearCrossEntropy._backward(ctx, grad, hidden, weight, bias, labels, losses)

    @staticmethod
    def _backward(ctx: Any, grad: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                  losses: Tensor) -> tuple[Tensor | None, ...]:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(ctx.dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            h, y = hidden[start:stop], labels[start:stop]
            valid = y != IGNORE_INDEX
            target = torch.where(valid, y, 0).unsqueeze(1)
            scale = torch.where(valid, grad[start:stop].float(), 0.0).unsqueeze(1)  # each token's output gradient
            label_p = torch.exp(-losses[start:stop]).unsqueeze(1)  # the label's probability, from the fp32 loss
            g = torch.softmax(_chunk_logits(h, w, bias), dim=-1)  # in fp32 inside the kernel, rounded once
            g.scatter_(1, target, (label_p - 1).to(g.dtype))  # softmax - one_hot(label), unscaled
            if grad_h is not None:
                grad_h[start:stop] = (g @ w).mul_(scale)
            if grad_w is not None:
                grad_w.add_(g.t() @ (h * scale).to(ctx.dtype))
            if grad_b is not None:
                grad_b.add_((g.t() @ scale.to(g.dtype)).squeeze(1))
            del g  # before the next chunk's logits
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                         chunk: int | None) -> Tensor:
    """Per-token cross entropy (fp32, ``0`` where the label is ``-100``) of the logits
    ``hidden @ weight.T + bias`` against ``labels``, ``hidden`` ``[..., H]``, ``labels`` ``[...]``.

    ``chunk``: tokens whose logits exist at a time (:class:`_LinearCrossEntropy`); ``None``: the whole
    logits at once, through ``F.linear`` and ``F.cross_entropy`` (autograd keeps them for the backward).
    """
    shape = labels.shape
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    if chunk is None:
        logits = F.linear(hidden, weight, bias)
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none").view(shape)
    dtype = compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):  # the function casts as autocast would
        losses = _LinearCrossEntropy.apply(hidden.to(dtype), weight, bias, labels, int(chunk), dtype)
    return losses.view(shape)


class ChunkedLMHead(nn.Module):
    """``hidden -> lm_head(norm(hidden))``: logits over the vocabulary; with ``chunk_tokens`` only
    ``norm(hidden)``, which :meth:`token_losses` projects a chunk of tokens at a time. The norm is held
    under ``norm_name``, its checkpoints' name (so its state-dict key, registered before ``lm_head``)."""

    def __init__(self, norm_name: str, norm: nn.Module, lm_head: nn.Linear, chunk_tokens: int | None) -> None:
        super().__init__()
        self.add_module(norm_name, norm)
        self.norm_name, self.lm_head, self.chunk_tokens = norm_name, lm_head, chunk_tokens

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = getattr(self, self.norm_name)(hidden)
        return hidden if self.chunk_tokens is not None else self.lm_head(hidden)

    def logits(self, output: Tensor) -> Tensor:
        """The logits of this layer's ``output``."""
        return self.lm_head(output) if self.chunk_tokens is not None else output

    def token_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        """Per-token cross entropy (fp32, 0 where ``targets`` is -100) of this layer's chunked ``output``."""
        return linear_cross_entropy(output, self.lm_head.weight, self.lm_head.bias, targets, self.chunk_tokens)

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}"
