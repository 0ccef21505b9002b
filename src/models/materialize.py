"""Build on the meta device, then give only chosen pipeline layers real, deterministically initialised tensors.

A model built under ``torch.device("meta")`` has every parameter's shape and dtype but no memory (the
paper's 1.39 B GPT-2 builds in a fraction of a second). :func:`materialize_layers` turns the tensors of
the chosen pipeline layers into real tensors on a device and initialises them with the model's own
initialisation (``transformers``' ``_init_weights``), each module under a private random stream seeded
from ``(seed, layer index, module path inside the layer)``. A parameter's initial value therefore
depends on the seed and on where it sits, never on which other layers the process holds: the full
single-process build (every layer) and the stages materialised on different ranks are bit-identical,
and no rank ever needs the whole model. (Pipeline parallelism exists because large models must be
"distributed among many ... accelerators to just fit into main memory", each stage holding a group of
consecutive layers: Chimera, Li & Hoefler, SC'21, §1.)

* Modules are initialised children first, as ``PreTrainedModel.initialize_weights`` does, so a parent
  overriding a child's init (GPT-2's scaled residual projections) wins as in ``transformers``.
* A parameter shared by several layers (tied word embeddings) takes the value its first holder (the
  lowest layer index) gives it: a rank holding only the head runs the embedding layer's init too,
  where every tensor but the shared one is still meta (init on meta tensors is a no-op).
* Buffers (BERT's position ids) are recreated by the same init functions.
* Tensors are initialised on the CPU, floating ones in float32, then cast to the dtype they were
  declared with (a bf16 model equals the fp32 build cast to bf16) and moved to ``device`` layer by
  layer, so the values do not depend on the device either; one layer at a time passes through host
  memory.
* Python identity is kept (:func:`torch.utils.swap_tensors`): tied parameters stay one ``Parameter``
  and modules that reference a layer's submodules (the unsplit HF model) see the real tensors.

The random streams are private (:func:`torch.random.fork_rng`): materialising consumes nothing from the
global generator, so every strategy leaves the build with the same random state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

__all__ = ["allocate_empty", "materialize_layers", "module_seed", "resolve_seed"]

_SEED_MASK = (1 << 63) - 1


def resolve_seed(init_seed: int | None) -> int:
    """``init_seed``, or one drawn from the global CPU generator (``seed_everything`` makes it the same
    on every rank)."""
    if init_seed is not None:
        return int(init_seed)
    return int(torch.randint(0, 2**62, (), generator=torch.default_generator).item())


def module_seed(seed: int, layer: int, path: str) -> int:
    """The seed of one module's init stream: a hash of (model seed, layer index, module path)."""
    digest = hashlib.blake2b(f"{int(seed)}/{int(layer)}/{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    """Parameters and buffers of ``module`` (each object once)."""
    seen: set[int] = set()
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _replace(t: Tensor, value: Tensor) -> None:
    """Give ``t`` (a parameter or buffer) the contents of ``value``, keeping its Python identity."""
    if isinstance(t, nn.Parameter):
        value = nn.Parameter(value, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, value)


def _move(t: Tensor, value: Tensor) -> None:
    """``t.data = value`` as ``nn.Module.to`` does (CPU to CUDA, dtype casts), else a swap."""
    if torch._has_compatible_shallow_copy_type(t, value):
        t.data = value
    else:
        _replace(t, value)


def allocate_empty(modules: Iterable[nn.Module], device: str | torch.device) -> None:
    """Uninitialised tensors on ``device`` in place of every meta tensor of ``modules``: the shapes
    without the values, e.g. fake tensors under ``FakeTensorMode`` for memory estimates. The slots of
    the (shared) submodules are replaced, one new tensor per old one, so tied parameters stay tied."""
    memo: dict[int, Tensor] = {}
    for root in modules:
        for m in root.modules():
            for slots in (m._parameters, m._buffers):
                for name, t in slots.items():
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in memo:
                        new = torch.empty(t.shape, dtype=t.dtype, device=device)
                        memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(
                            t, nn.Parameter) else new
                    slots[name] = memo[id(t)]


def materialize_layers(
    layers: Sequence[nn.Module],
    indices: Iterable[int],
    device: str | torch.device,
    *,
    seed: int,
    init_module: Callable[[nn.Module], None],
) -> None:
    """Give the meta tensors of ``layers[i]`` for ``i`` in ``indices`` real values on ``device`` (see the
    module docstring); ``init_module(m)`` initialises the direct tensors of one module in place (with
    the global CPU generator, which is seeded per module here). Other layers stay as they are."""
    device = torch.device(device)
    chosen = sorted(set(int(i) for i in indices))
    bad = [i for i in chosen if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer indices {bad} out of range: the model has {len(layers)} pipeline layers")
    wanted = {id(t): t for i in chosen for t in _tensors(layers[i]) if t.is_meta}
    if not wanted:
        return
    owner: dict[int, int] = {}  # tensor -> first layer holding it (its value comes from that layer's init)
    for i, layer in enumerate(layers):
        for t in _tensors(layer):
            if id(t) in wanted:
                owner.setdefault(id(t), i)
    target = {key: t.dtype for key, t in wanted.items()}
    # Highest index first: a shared tensor is written last by its owner, the lowest layer holding it.
    order = sorted(set(chosen) | set(owner.values()), reverse=True)
    from transformers import initialization as hf_init

    with torch.random.fork_rng(devices=[]), torch.no_grad(), hf_init.guard_torch_init_functions():
        for i in order:
            layer = layers[i]
            for t in _tensors(layer):
                if id(t) in wanted and t.is_meta:
                    dtype = torch.float32 if t.dtype.is_floating_point else t.dtype
                    _replace(t, torch.empty(t.shape, dtype=dtype, device="cpu"))
            for path, module in _post_order(layer):
                torch.default_generator.manual_seed(module_seed(seed, i, path))
                init_module(module)
            for t in _tensors(layer):
                key = id(t)
                if key in wanted and owner[key] == i and (t.device != device or t.dtype != target[key]):
                    _move(t, t.detach().to(device=device, dtype=target[key]))
    left = [tuple(t.shape) for t in wanted.values() if t.is_meta]
    if left:
        raise RuntimeError(f"tensors of shapes {left[:4]} are still on the meta device after materialising")
