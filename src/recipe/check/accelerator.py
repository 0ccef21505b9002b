"""Which accelerator a job runs on: ``trainer=auto`` (the default) picks the node's GPUs when CUDA is
available and CPU processes over gloo otherwise; ``trainer=cpu`` / ``trainer=gpu`` force one.

:func:`resolve_accelerator` is pure: it takes what the node offers (:class:`NodeDevices`, from
:func:`probe_node` or a test's fake GPU node) and the ``trainer`` settings, and returns the concrete
Lightning arguments plus the reason that is printed with the layout, e.g. ``accelerator: gpu × 8,
bf16-mixed (auto: 8 CUDA devices found, NVIDIA H100 has bf16)``. Nothing here starts a process.

Fewer GPUs than processes under ``trainer=auto`` (one GPU and the default Chimera D = 2): the ranks
share the GPUs, local rank r on ``cuda:(r mod G)``, over gloo, since NCCL refuses two ranks on one
device; the pipeline's messages are then staged through the host (:mod:`pipeline_recipes.strategies.runtime.p2p`). Fine for
trying schedules, not for speed. ``trainer=gpu`` with too few GPUs is refused instead
(:func:`pipeline_recipes.recipe.check.settings.check_devices`).

fp32 matrix products on CUDA: TensorFloat-32 (``torch.set_float32_matmul_precision("high")``; TF32 as
introduced in NVIDIA's "A100 Tensor Core GPU Architecture" whitepaper) unless
``trainer.float32_matmul_precision`` says otherwise; applied in every worker before the model is built
(:func:`apply_float32_matmul_precision`). The CPU keeps torch's default (``highest``).

Precision under ``auto``: ``bf16-mixed`` where the GPU computes bf16 natively (Ampere and later),
fp32 elsewhere. ``16-mixed`` is not chosen, and refused for the pipeline schedules: Lightning scales
the loss for fp16 in its own backward, which the schedules replace by theirs (every backward runs
inside the pipeline step), so its GradScaler would unscale gradients that were never scaled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pipeline_recipes.core.fixes import ConfigError, values
from pipeline_recipes.core.errors import did_you_mean

from pipeline_recipes.core.layout import BASELINES
from pipeline_recipes.core.node import AUTO, GPU_NAMES, NodeDevices, cpus_per_rank, loader_settings, probe_node

CPU_DEVICES = 2  # `trainer=auto` without CUDA and without trainer.devices: the README's 2-process CPU job
FP16_MIXED = ("16-mixed", "16")  # Lightning's spellings of fp16 autocast with a GradScaler
CUDA_CONTEXT_BYTES = 512 * 2**20  # what one process's CUDA context and kernels hold outside torch's allocator
MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values
MATMUL_KEY = "float32_matmul_precision"  # trainer.float32_matmul_precision: ours, not a Trainer argument
CUDA_MATMUL_PRECISION = "high"  # TF32 products of fp32 matrices on CUDA
_MATMUL_WORDS = {"highest": "full fp32", "high": "TF32", "medium": "bf16"}
SHARED_NOTE = "fine for trying schedules, not for speed"


@dataclass(frozen=True)
class AcceleratorChoice:
    """The concrete ``trainer`` settings (Lightning's arguments: no ``auto`` left in accelerator,
    devices or precision) and why they were chosen."""

    trainer: dict[str, Any]
    reason: str
    node: NodeDevices = NodeDevices()
    shared_gpus: int = 0  # GPUs the processes of a node share (more processes than GPUs); 0: one GPU each, or CPU
    compile: bool | None = None  # model.compile resolved (:func:`with_compile`); None: not asked; the line omits
    # the CPU's default (auto: eager)
    compile_setting: Any = AUTO  # model.compile as set

    @property
    def accelerator(self) -> str:
        return str(self.trainer["accelerator"])

    @property
    def backend(self) -> str:
        """The process group's backend: NCCL with one GPU per rank, gloo on CPU and on shared GPUs."""
        return "nccl" if self.accelerator in GPU_NAMES and not self.shared_gpus else "gloo"

    @property
    def memory_per_rank(self) -> int | None:
        """Bytes of GPU memory each rank may use when ranks share the GPUs (the GPU's memory less one CUDA
        context per rank, over the ranks on it); None otherwise (the pre-flight measures one GPU per rank itself)."""
        if not self.shared_gpus or not self.node.gpu_memory_bytes:
            return None
        ranks = -(-int(self.trainer["devices"]) // self.shared_gpus)
        return (self.node.gpu_memory_bytes - ranks * CUDA_CONTEXT_BYTES) // ranks

    def describe(self) -> str:
        trainer = self.trainer
        precision = trainer.get("precision") or "32-true"
        compiled = "" if self.compile is None or (not self.compile and self.compile_setting == AUTO) else (
            f", {'compiled' if self.compile else 'eager'} blocks (model.compile={_setting(self.compile_setting)})")
        if self.shared_gpus:
            gpus = f"{self.shared_gpus} GPU{'s' if self.shared_gpus > 1 else ''}"
            return (f"accelerator: {self.accelerator} × {trainer['devices']} per node sharing {gpus} over gloo "
                    f"({self.reason}; {SHARED_NOTE}), {precision}{compiled}")
        return (f"accelerator: {self.accelerator} × {trainer['devices']} per node, {precision} ({self.reason})"
                f"{compiled}")


def _devices(value: Any, default: int, node: NodeDevices) -> Any:
    """``trainer.devices``: a number as given; ``auto`` (or null, -1) means the launcher's processes
    per node, else ``default``."""
    if value in (AUTO, None, -1):
        return node.launched_per_node or default
    return value


def layout_processes(strategy: Mapping[str, Any], num_nodes: Any = 1) -> int | None:
    """Processes per node the strategy's layout needs at least: W·D over the nodes (``W`` null: one
    replica). None when the settings are not numbers
    (:func:`pipeline_recipes.recipe.check.settings.resolve_layout` says why)."""
    D, W = strategy.get("D", 1), strategy.get("W") or 1
    numbers = [v for v in (D, W, num_nodes) if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if len(numbers) != 3:
        return None
    return -(-W * D // num_nodes)


def shared_devices(processes: int, gpus: int) -> list[int] | None:
    """The GPU of each local rank when ``processes`` ranks share ``gpus`` GPUs (rank r on GPU r mod
    ``gpus``); None when every rank has a GPU of its own (or there is none)."""
    if gpus < 1 or processes <= gpus:
        return None
    return [rank % gpus for rank in range(processes)]


def resolve_accelerator(trainer: Mapping[str, Any], node: NodeDevices,
                        processes: int | None = None) -> AcceleratorChoice:
    """The concrete ``trainer`` settings for this node and why.

    - ``accelerator: auto``: ``gpu`` when the node has CUDA devices (``devices: auto`` = all of them,
      or the ``processes`` per node the layout needs when that is more: they share the GPUs), else
      ``cpu`` (``devices: auto`` = 2 processes);
    - ``accelerator: cpu`` / ``gpu``: kept, the user asked for it;
    - ``precision: auto``: ``bf16-mixed`` on a GPU with native bf16, else ``32-true``;
    - ``float32_matmul_precision: auto`` (or absent): ``high`` (TF32) on an Ampere or newer GPU, else
      torch's ``highest``.

    A GPU asked for bf16 it lacks is refused here (:class:`ConfigError`), before any process starts.
    """
    out = dict(trainer)
    accelerator = str(out.get("accelerator", AUTO))
    matmul = out.get(MATMUL_KEY, AUTO)
    if matmul not in (AUTO, None, *MATMUL_PRECISIONS):
        raise _matmul_refusal(matmul)
    if accelerator == AUTO:
        if node.cuda_devices > 0:
            out["accelerator"] = "gpu"
            why = f"auto: {node.cuda_devices} CUDA device{'s' if node.cuda_devices > 1 else ''} found"
        else:
            out["accelerator"] = "cpu"
            why = "auto: no CUDA"
    else:
        why = f"trainer.accelerator={accelerator}"
    gpu = out["accelerator"] in GPU_NAMES
    if gpu and node.cuda_devices == 0 and out.get("devices", AUTO) in (AUTO, None, -1):
        raise ConfigError(f"trainer.accelerator = {out['accelerator']} with trainer.devices = {out.get('devices')} but "
                          "this node has no CUDA device (trainer=auto picks the CPU here)",
                          [values("trainer", ["cpu", "auto"]), values("trainer.accelerator", ["cpu", "auto"])])
    wanted = node.cuda_devices if gpu else CPU_DEVICES
    if gpu and accelerator == AUTO and processes:  # fewer GPUs than the layout's processes: they share them
        wanted = max(wanted, processes)
    out["devices"] = _devices(out.get("devices", AUTO), wanted, node)
    devices = out["devices"]
    shared = 0
    if gpu and accelerator == AUTO and isinstance(devices, int) and shared_devices(devices, node.cuda_devices):
        shared = node.cuda_devices
    precision = out.get("precision", AUTO)
    if precision == AUTO or precision is None:
        bf16 = gpu and node.bf16
        out["precision"] = "bf16-mixed" if bf16 else "32-true"
        if gpu:
            name = node.gpu_name or "the GPU"
            why += f", {name} has bf16" if bf16 else f", no native bf16 on {name}: fp32"
    elif gpu and node.cuda_devices > 0 and not node.bf16 and str(precision).startswith("bf16"):
        raise ConfigError(f"trainer.precision = {precision} but {node.gpu_name or 'this GPU'} has no native bf16 "
                          "(it needs compute capability 8.0 or newer)",
                          [values("trainer.precision", ["32-true", AUTO])])
    if matmul in (AUTO, None):  # TF32 exists from Ampere on, as native bf16 does
        out[MATMUL_KEY] = CUDA_MATMUL_PRECISION if gpu and node.bf16 else MATMUL_PRECISIONS[0]
        if gpu and node.bf16:
            why += f", {_matmul_words(out[MATMUL_KEY])}"
    elif gpu or matmul != MATMUL_PRECISIONS[0]:
        why += f", {_matmul_words(matmul)}"
    return AcceleratorChoice(out, why, node, shared)


def _matmul_refusal(value: Any) -> ConfigError:
    """``trainer.float32_matmul_precision`` is not one torch takes (nor auto)."""
    return ConfigError(f"trainer.{MATMUL_KEY} = {value!r} is not a precision of torch.set_float32_matmul_precision "
                       "(auto: TF32 on CUDA)", [values(f"trainer.{MATMUL_KEY}", (AUTO, *MATMUL_PRECISIONS))])


def _matmul_words(precision: str) -> str:
    return f"fp32 matmuls in {_MATMUL_WORDS[precision]} (trainer.{MATMUL_KEY}={precision})"


def choose_accelerator(trainer: Mapping[str, Any], processes: int | None = None,
                       probe: Callable[[bool], NodeDevices] | None = None) -> AcceleratorChoice:
    """:func:`resolve_accelerator` for this node (``processes``: per node, what the layout needs). Only
    ``auto`` and GPU runs pay for importing torch (to look at the node's GPUs); ``trainer=cpu`` needs nothing.
    ``probe(cuda)`` tells what the node offers (default :func:`probe_node`)."""
    accelerator = trainer.get("accelerator", AUTO)
    cuda = accelerator == AUTO or accelerator in GPU_NAMES
    return resolve_accelerator(trainer, probe(cuda) if probe is not None else probe_node(cuda=cuda), processes)


COMPILE_SETTINGS = ("auto", "true", "false")  # model.compile (pipeline_recipes.strategies.compute.compile)


def _setting(value: Any) -> str:
    """A setting as written on the command line (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def resolve_compile(value: Any, accelerator: str) -> bool:
    """``model.compile``: whether every repeated block is compiled with ``torch.compile``; ``auto`` (or absent)
    compiles on CUDA and not on the CPU, where compiling a model costs more than a short run saves."""
    if value in (AUTO, None):
        return accelerator in GPU_NAMES
    if isinstance(value, bool):
        return value
    close = did_you_mean(value, COMPILE_SETTINGS)
    guess = [values("model.compile", [close], keep=1, lead=f"did you mean {close!r}?")] if close else []
    raise ConfigError(f"model.compile = {value!r} is not one of auto, true or false (whether each repeated block of "
                      "the model is compiled with torch.compile; auto: on CUDA, not on CPU)",
                      [*guess, values("model.compile", COMPILE_SETTINGS)])


def with_compile(choice: AcceleratorChoice, value: Any) -> AcceleratorChoice:
    """``choice`` with ``model.compile`` resolved for its accelerator (:func:`resolve_compile`), so that its
    line says whether the blocks are compiled."""
    return replace(choice, compile=resolve_compile(value, choice.accelerator),
                   compile_setting=AUTO if value is None else value)


def matmul_precision(trainer: Mapping[str, Any]) -> str:
    """``trainer.float32_matmul_precision`` as torch takes it: as set, or under ``auto`` (a job file
    written without the launcher's choice) ``high`` on a GPU and ``highest`` elsewhere."""
    value = trainer.get(MATMUL_KEY, AUTO)
    if value in (AUTO, None):
        return CUDA_MATMUL_PRECISION if trainer.get("accelerator") in GPU_NAMES else MATMUL_PRECISIONS[0]
    if value not in MATMUL_PRECISIONS:
        raise _matmul_refusal(value)
    return str(value)


def resolve_loader(data: Mapping[str, Any], choice: AcceleratorChoice, cpus: int | None = None) -> dict[str, Any]:
    """The data loader's settings for the chosen accelerator (:func:`loader_settings`; ``cpus``: per
    rank, default this node's CPUs over its processes)."""
    devices = choice.trainer.get("devices")
    per_rank = cpus if cpus is not None else cpus_per_rank(devices if isinstance(devices, int) else 1)
    workers, pin = loader_settings(data.get("num_workers", AUTO), data.get("pin_memory", AUTO),
                                   cuda=choice.accelerator in GPU_NAMES, cpus=per_rank)
    return {"num_workers": workers, "pin_memory": pin}


def apply_float32_matmul_precision(trainer: Mapping[str, Any]) -> str:
    """Set this process's fp32 matmul precision from ``trainer`` (:func:`matmul_precision`); a worker
    calls it before building the model. Returns the precision set."""
    import torch  # local: the launcher imports this module without torch (≥1.2 s)

    precision = matmul_precision(trainer)
    torch.set_float32_matmul_precision(precision)
    return precision


def check_precision(strategy: str, trainer: Mapping[str, Any], optim: Mapping[str, Any] | None = None) -> None:
    """fp16 autocast with a GradScaler (``16-mixed``) cannot run under the pipeline schedules (see
    the module docstring); bf16 needs no scaler. Nor can any strategy clip the gradients of a fused
    optimizer under a GradScaler: they carry the loss scale until the fused step unscales them itself.
    Without a scaler (bf16, fp32) every optimizer is clipped (strategies/lightning/precision.py)."""
    precision = str(trainer.get("precision"))
    if precision in FP16_MIXED and (optim or {}).get("fused") and trainer.get("gradient_clip_val"):
        raise ConfigError(f"trainer.precision = {precision} with optim.fused = true and trainer.gradient_clip_val = "
                          f"{trainer.get('gradient_clip_val')}: under fp16 the gradients carry the GradScaler's loss "
                          "scale until the fused optimizer step removes it, so they cannot be clipped before it (bf16 "
                          "and fp32 need no scaler; null optim.fused is torch's default implementation)",
                          [values("trainer.precision", ["bf16-mixed", "32-true"]), values("optim.fused", [None]),
                           values("trainer.gradient_clip_val", [None])])
    if strategy not in BASELINES and precision in FP16_MIXED:
        raise ConfigError(f"trainer.precision = {precision} (fp16 with loss scaling) is not supported by "
                          f"strategy={strategy}: the pipeline runs every backward itself, so Lightning's loss "
                          "scaler would unscale gradients that were never scaled (bf16 needs Ampere GPUs or newer)",
                          [values("trainer.precision", ["bf16-mixed", "32-true"])])
