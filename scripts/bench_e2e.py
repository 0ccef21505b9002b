"""End-to-end part of ``scripts/bench.py``: ``train.py`` as a user runs it, against
``torch.distributed.pipelining`` and against a plain Lightning loop, in interleaved rounds.

``train.py`` runs unchanged (Hydra config, launcher, worker processes, the Lightning strategy, data
module, metrics and progress callbacks, logger; checkpointing off) with one more callback,
:class:`InterleavedRounds`, added through ``+trainer.callbacks``. It sits last in the callback list:
after each training step of the job it runs one step of each comparison system in the same
processes (rotating order), so every round times the job's step and theirs on the same machine
within a fraction of a second (paired ratios, as the rest of ``bench.py``).

* The job's iteration time is measured from the end of this hook to its next call: everything
  Lightning does for one step (fetching the batch, the hooks, the training step, the optimizer,
  logging, the other callbacks). The largest time over the ranks counts.
* ``torch``: each of torch's classes the schedule registry names (``ScheduleSpec.torch_class``, read by
  ``scripts/torch_stages.py``) on the same model, stage split (the engine's ``even_partition`` over the
  class's number of stages, each rank holding the stages ours would), micro-batches and gloo
  processes; each step starts after a barrier and lasts until the slowest rank returns.
* ``engine:<schedule>``: this repository's engine stepped directly (no Lightning), the same schedule
  as the job: job ÷ engine is what the Lightning path adds.
* ``plain``: a plain Lightning loop (a LightningModule computing the model's loss, no
  logger/callbacks) on the same model and batch size, in a thread of the same process that runs
  one step whenever the job has run one (only one of the two runs at a time).

Every system steps the job's own optimizer (:func:`same_optimizer`: its class and settings, the
implementation included), so optimizers differ in nothing but the job's parameter groups and
learning-rate schedule.

The callback writes ``{"job": [...], "<system>": [...]}`` (seconds per counted round) as JSON.
"""

from __future__ import annotations

import inspect
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch_stages import same_schedule, stages_held, torch_classes

SIZE = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 1000, "seq": 64}  # the benchmark model of BENCHMARKS.md §0
SIZE_QUICK = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 1000, "seq": 32}


def build_gpt2(size: dict[str, int]) -> Any:
    from pipeline_recipes.models import build_model

    torch.manual_seed(0)
    return build_model("gpt2-tiny", n_layer=size["layers"], n_embd=size["hidden"], n_head=size["heads"],
                       vocab_size=size["vocab"], n_positions=size["seq"], seq_len=size["seq"],
                       tie_word_embeddings=False, loss_chunk_tokens=None)  # torch's loss_fn takes logits


def _max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return float(t)


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def same_optimizer(job_optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """``params -> optimizer`` of the job's class and settings (AdamW, its learning rate, betas, weight
    decay and implementation: ``fused``/``foreach``), so every system steps the same optimizer."""
    cls = type(job_optimizer)
    accepted = inspect.signature(cls).parameters  # defaults may hold more (AdamW: decoupled_weight_decay)
    settings = {k: v for k, v in job_optimizer.defaults.items() if k in accepted}
    return lambda params: cls(params, **settings)


class _TorchSchedule:
    """One ``torch.distributed.pipelining`` schedule class over this rank's stages (the same
    placement and ``even_partition`` split as this repository's schedule of that name), stepping the
    job's optimizer."""

    def __init__(self, label: str, size: dict[str, int], samples: int, micro_batches: int, optimizer: OptimizerFactory) -> None:
        from torch import nn
        from torch.distributed import pipelining

        from pipeline_recipes.models.causal_lm import causal_lm_loss
        from pipeline_recipes.strategies.runtime.engine import even_partition

        self.rank, world = dist.get_rank(), dist.get_world_size()
        layers = build_gpt2(size).pipeline_layers()
        held = stages_held(label, self.rank, world)
        S = world * len(held)
        part = even_partition(len(layers), S)
        modules = [nn.Sequential(*[layers[i] for i in part[s]]) for s in held]
        stages = [pipelining.PipelineStage(m, s, S, torch.device("cpu")) for m, s in zip(modules, held)]
        cls = getattr(pipelining, label)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)  # takes the list of stages
        self.schedule = cls(stages if multi else stages[0], micro_batches, loss_fn=causal_lm_loss)
        self.optimizer = optimizer([p for m in modules for p in m.parameters()])
        self.first, self.last = 0 in held, S - 1 in held
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, size["vocab"], (samples, size["seq"]), generator=g)

    def __call__(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        args = (self.ids,) if self.first else ()
        self.schedule.step(*args, target=self.ids if self.last else None, return_outputs=False)
        self.optimizer.step()


class _BareEngine:
    """This repository's engine stepped directly (no Lightning), with the job's optimizer: what ``bench.py``'s
    ``vs_torch`` part times, here in the job's processes."""

    def __init__(self, schedule: str, size: dict[str, int], samples: int, micro_batches: int, optimizer: OptimizerFactory) -> None:
        from pipeline_recipes.strategies.runtime.engine import build_engine
        from pipeline_recipes.strategies.schedules import derive_layout

        world = dist.get_world_size()
        layout = derive_layout(schedule, world, world, samples, B=samples // micro_batches)
        self.engine = build_engine(build_gpt2(size), layout, torch.device("cpu"))
        self.optimizer = optimizer(self.engine.local_parameters())
        g = torch.Generator().manual_seed(1)
        self.batch = {"input_ids": torch.randint(0, size["vocab"], (samples, size["seq"]), generator=g)}

    def __call__(self) -> None:
        self.engine.train_step(self.batch)
        self.optimizer.step()


class _PlainModule(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, optimizer: OptimizerFactory) -> None:
        super().__init__()
        self.model, self.optimizer_factory = model, optimizer

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from pipeline_recipes.core.pipeline_model import sequential_loss

        return sequential_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, size: dict[str, int], samples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, size["vocab"], (samples, size["seq"]), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class _PlainLightning:
    """A plain Lightning loop in a thread; :meth:`__call__` lets it run exactly one training step.

    Its step time runs from the hand-over to its ``on_train_batch_end`` (the whole iteration: data,
    hooks, step, optimizer); the caller's clock would also count the thread switch.
    """

    def __init__(self, size: dict[str, int], samples: int, steps: int, optimizer: OptimizerFactory) -> None:
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.last_s = 0.0
        self.steps = steps
        self._started = 0.0
        module = _PlainModule(build_gpt2(size), optimizer)
        loader = torch.utils.data.DataLoader(_Tokens(size, samples * 8), batch_size=samples, shuffle=True)
        handoff = self

        class Handoff(Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                handoff.last_s = time.perf_counter() - handoff._started
                handoff.done.release()
                if trainer.global_step < handoff.steps:
                    handoff.go.acquire()
                    handoff._started = time.perf_counter()

        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[Handoff()])

        def fit() -> None:
            handoff.go.acquire()
            handoff._started = time.perf_counter()
            trainer.fit(module, loader)

        self.thread = threading.Thread(target=fit, name="plain-lightning", daemon=True)
        self.thread.start()

    def __call__(self) -> float:
        self.go.release()
        if not self.done.acquire(timeout=600):
            raise TimeoutError("the plain Lightning loop did not finish a step within 600 s")
        return self.last_s


class InterleavedRounds(Callback):
    """After each of the job's training steps, one step of every comparison system (see the module
    docstring); ``warmup`` rounds are not counted. Must be the job's last callback."""

    def __init__(self, out: str, kind: str, warmup: int = 3, micro_batches: int = 4, samples: int = 16,
                 quick: bool = False, systems: list[str] | None = None) -> None:
        if kind not in ("torch", "plain"):
            raise ValueError(f"kind must be 'torch' or 'plain', got {kind!r}")
        self.out, self.kind, self.warmup = Path(out), kind, warmup
        self.size = SIZE_QUICK if quick else SIZE
        self.micro_batches, self.samples = micro_batches, samples
        default = [SAME_SCHEDULE[name] for name in ("gpipe", "dapple")] if kind == "torch" else ["plain_lightning"]
        self.labels = list(systems or default)
        self.systems: dict[str, Any] = {}
        self.times: dict[str, list[float]] = {"job": [], **{label: [] for label in self.labels}}
        self._resumed: float | None = None
        self._round = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = same_optimizer(trainer.optimizers[0])
        if self.kind == "torch":
            self.systems = {label: _BareEngine(label.split(":", 1)[1], self.size, self.samples, self.micro_batches,
                                               optimizer) if label.startswith("engine:")
                            else _TorchSchedule(label, self.size, self.samples, self.micro_batches, optimizer)
                            for label in self.labels}
        else:
            self.systems = {self.labels[0]: _PlainLightning(self.size, self.samples, trainer.max_steps, optimizer)}
        self._resume()

    def _resume(self) -> None:
        if dist.is_initialized():
            dist.barrier()
        self._resumed = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        job_s = _max_over_ranks(time.perf_counter() - self._resumed)
        counted = self._round >= self.warmup
        if counted:
            self.times["job"].append(job_s)
        order = self.labels[self._round % len(self.labels):] + self.labels[: self._round % len(self.labels)]
        for label in order:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            inner = self.systems[label]()
            elapsed = _max_over_ranks(inner if isinstance(inner, float) else time.perf_counter() - start)
            if counted:
                self.times[label].append(elapsed)
        self._round += 1
        self._resume()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.times))
        plain = self.systems.get("plain_lightning")
        if plain is not None:
            plain.thread.join(timeout=60)


# -- the part (run by bench.py in the parent) -----------------------------------------------------


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def _run_job(root: Path, name: str, overrides: list[str], callback: dict[str, Any], timeout: float,
             src: Path | None = None) -> dict:
    """``python train.py <overrides>`` with the rounds callback (the package from ``src``, default this
    checkout's); returns the callback's times."""
    import os
    import subprocess
    import sys

    run_dir = root / name
    times_file = run_dir / "rounds.json"
    cb = ",".join(f"{k}:{v}" for k, v in {"_target_": "bench_e2e.InterleavedRounds", "out": str(times_file),
                                          **callback}.items())
    scripts = Path(__file__).resolve().parent
    src = src or scripts.parent / "src"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(src), str(scripts), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(scripts.parent / "train.py"), f"hydra.run.dir={run_dir}", *overrides,
           f"+trainer.callbacks=[{{{cb}}}]"]
    result = subprocess.run(cmd, cwd=scripts.parent, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 or not times_file.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(times_file.read_text())


def common_overrides(quick: bool, steps: int) -> list[str]:
    """The end-to-end benchmark (BENCHMARKS.md §0) as ``train.py`` arguments: GPT-2 4 × 128 (4 heads, vocabulary 1000,
    sequence 64, untied), global batch 16; no gradient clipping (torch's side has none) and the head returning
    the logits (torch's ``loss_fn`` takes them), so both sides compute the same."""
    size = SIZE_QUICK if quick else SIZE
    return ["trainer=cpu", "model=gpt2-tiny", f"model.n_layer={size['layers']}", f"model.n_embd={size['hidden']}",
            f"model.n_head={size['heads']}", f"model.vocab_size={size['vocab']}", f"model.seq_len={size['seq']}",
            f"model.n_positions={size['seq']}", "model.tie_word_embeddings=false", "model.loss_chunk_tokens=null",
            "data.global_batch_size=16",
            f"trainer.max_steps={steps}", "trainer.gradient_clip_val=null", "preflight=false", "checkpoint.every_n_steps=null"]


SAME_SCHEDULE = same_schedule()  # our schedule -> torch's class of the same schedule (ScheduleSpec.torch_class)
TORCH_BEST = "torch best"  # the class with the lowest median step in the job's rounds


def fastest(times: dict[str, list[float]], labels: tuple[str, ...]) -> str:
    """The label of ``labels`` with the lowest median time: torch's best schedule on this work. (The
    per-round minimum over several classes would sit below every class's own times by noise alone.)"""
    return min(labels, key=lambda label: statistics.median(times[label]))


def e2e_rows(label_ours: str, name: str, times: dict[str, list[float]], theirs: tuple[str, ...]) -> list[dict]:
    """One job's rows: against each of ``theirs``, against the fastest of them (``torch best``, which
    names it) and against the bare engine; ``throughput_ratio`` = their step time ÷ the job's, the
    median of the per-round ratios."""
    best = fastest(times, theirs)
    rows = []
    for label in (*theirs, TORCH_BEST, f"engine:{name}"):
        measured = times[best if label == TORCH_BEST else label]
        rows.append({"ours": label_ours, "theirs": label, "same_schedule": SAME_SCHEDULE.get(name) == label,
                     **({"best_class": best} if label == TORCH_BEST else {}),
                     "ours_median_s": statistics.median(times["job"]),
                     "theirs_median_s": statistics.median(measured),
                     "throughput_ratio": paired_ratio(measured, times["job"]), "rounds": len(times["job"])})
    return rows


def part_e2e(quick: bool, rounds: int | None = None, ours: tuple[str, ...] = ("gpipe", "dapple"),
             extra: list[str] | None = None, without_logger: tuple[str, ...] = (),
             theirs: tuple[str, ...] = torch_classes()) -> dict[str, Any]:
    """``e2e_vs_torch``: each of ``ours`` through ``train.py`` (D = 2, 4 micro-batches) against each of
    ``theirs`` (torch's classes), against the fastest of them in each round (``torch best``) and against
    the bare engine (``engine:<name>``); ``e2e_overhead_d1``: ``train.py strategy=single`` against a plain
    Lightning loop; ``without_logger``: those schedules once more with ``logger=none`` (what the default
    W&B logger costs). ``throughput_ratio`` = their step time ÷ ours, median of the rounds (> 1: ours faster)."""
    import tempfile

    rounds = rounds or (4 if quick else 40)
    warmup = 1 if quick else 5
    steps = rounds + warmup
    root = Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    rows, raw = [], {}
    jobs = [(name, []) for name in ours] + [(name, ["logger=none"]) for name in without_logger]
    for name, job_overrides in jobs:
        engine = f"engine:{name}"
        label_ours = " ".join([f"train.py strategy={name}", *job_overrides])
        times = _run_job(root, label_ours.replace(" ", "_").replace("=", "-"),
                         [*common_overrides(quick, steps), *(extra or []), f"strategy={name}", "strategy.D=2",
                          "trainer.devices=2", "strategy.micro_batch_size=4", *job_overrides],
                         {"kind": "torch", "warmup": warmup, "quick": quick,
                          "systems": f"[{','.join([*theirs, engine])}]"}, timeout=900)
        raw[label_ours] = times
        rows += e2e_rows(label_ours, name, times, theirs)
    times = _run_job(root, "single", [*common_overrides(quick, steps), *(extra or []), "strategy=single",
                                      "trainer.devices=1"],
                     {"kind": "plain", "warmup": warmup, "quick": quick}, timeout=900)
    raw["single"] = times
    overhead = {"train_py_median_s": statistics.median(times["job"]),
                "plain_lightning_median_s": statistics.median(times["plain_lightning"]),
                "ratio": paired_ratio(times["job"], times["plain_lightning"]), "rounds": len(times["job"])}
    return {"e2e_vs_torch": rows, "e2e_overhead_d1": overhead, "_e2e_times": raw}
