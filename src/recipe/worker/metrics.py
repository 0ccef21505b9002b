"""What a run measures: throughput per replica, iteration time, bubbles, memory, the timeline.

* Throughput is rank 0's, over windows of steps (:class:`ReplicaThroughputMonitor`), counting the W
  data-parallel replicas that consume distinct samples, not the W·D processes.
* Bubble ratios follow Chimera §2's definition, idle time / (workers × iteration time), computed one
  way for both figures (:func:`bubble_ratio`): 1 − Σ busy / (ranks × the longest rank's span from
  its first action's start to its last one's end). *Measured*: busy is the per-action times every
  rank's executor records (:mod:`pipeline_recipes.strategies.compute.timing`: wall clock on CPU, CUDA events on GPUs; an
  action starts once its inputs arrived), so waiting on messages and host-side stalls between
  actions count as idle; the median over the steps after warm-up. *Theory*: the schedule that was
  executed, simulated with the last step's measured per-stage action times and no communication
  (:func:`theory_bubble_ratio`), i.e. the bubble the schedule's order alone leaves at this run's
  compute times. Their difference is what communication and the host cost. Without a recorded
  timeline the simulation takes t_b = 2·t_f.
* Peak memory per rank: CUDA max allocated on GPU, the process's peak RSS on CPU.
* The learning rate of every step (a logger row per step, written in bursts on reporting steps; kept
  as ``lr_history``) and the model FLOPs
  utilisation (:mod:`pipeline_recipes.recipe.report.flops`: achieved TFLOP/s per device from the median token rate, MFU
  against the device's peak).

At the end rank 0 draws the last step's measured timeline (rows = ranks, like the paper's
figures), writes the summary into ``results.json`` and only then hands the last rows and the summary to the
loggers: a logger whose backend is gone (a signal reached W&B's service too) is one warning line
(:mod:`pipeline_recipes.recipe.worker.background_logger`), never the job's end. Rank 0 also writes ``results.json``
while training (at a reporting step at most every :data:`RUNNING_RESULTS_S`) and when a step raises (no
collective: a peer may be gone), so a job that ends badly keeps the losses it reached. Every write of rank 0 says
``running``: the launcher writes the final ``results.json`` over it, from how the job ended
(:class:`~pipeline_recipes.recipe.report.ending.JobEnd`).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from pipeline_recipes.core.layout import Layout
from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy, reporting_step
from pipeline_recipes.strategies.runtime.collectives import wait_collective
from pipeline_recipes.strategies.schedules import Action, Schedule, simulate
from pipeline_recipes.strategies.schedules.actions import KINDS
from pipeline_recipes.strategies.schedules.render import save_png
from typing_extensions import override

from pipeline_recipes.recipe.worker.background_logger import backend_failures_warned, lost
from pipeline_recipes.recipe.report.flops import Utilisation, resolve_utilisation
from pipeline_recipes.recipe.report.results import write_results

RUNNING_RESULTS_S = 30.0  # rank 0 rewrites results.json (status running) at most this often while training


def newest_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint this run wrote that is complete (one written in the background appears once it is;
    one whose save failed never does), else the one it resumed from (None without either)."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        saved = getattr(callback, "_last_checkpoint_saved", None)
        if saved and Path(saved).exists():
            return str(saved)
        dirpath = getattr(callback, "dirpath", None)
        written = sorted(Path(dirpath).glob("step-*.ckpt")) if dirpath else []  # step-NNNNNN: in step order
        if written:
            return str(written[-1])
    resumed = getattr(trainer, "ckpt_path", None)
    return str(resumed) if resumed else None


def samples_in(batch: dict[str, Any]) -> int:
    return int(next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor)))


def tokens_in(batch: dict[str, Any]) -> int:
    return int(batch["input_ids"].numel())


def held_bytes(trainer: pl.Trainer | None) -> tuple[int, int]:
    """The bytes of the parameters this rank holds (materialised: a pipeline rank's stages) and of its optimizers'
    state tensors (Adam's moments, ...), each storage counted once."""
    if trainer is None:
        return 0, 0
    seen: set[int] = set()

    def size(tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    module = getattr(trainer, "lightning_module", None)  # a test's stand-in trainer may have neither
    parameters = size(module.parameters()) if module is not None else 0
    optimizers = getattr(trainer, "optimizers", [])
    state = size(value for optimizer in optimizers for entry in getattr(optimizer, "state", {}).values()
                 for value in entry.values())
    return parameters, state


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory a rank held: on a GPU what the caching allocator reserved (what must fit: tensors,
    fragmentation and cached blocks), on CPU the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def busy_and_span(record: Any) -> tuple[float, float]:
    """Seconds a step record's actions ran, and from its first action's start to its last one's end."""
    timeline = record.timeline if record is not None else []
    if not timeline:
        return 0.0, 0.0
    return sum(end - start for _, start, end in timeline), timeline[-1][2] - timeline[0][1]


def bubble_ratio(busy_and_spans: Sequence[tuple[float, float]]) -> float:
    """1 − Σ busy / (ranks × the longest span) over ``(busy, span)`` per rank (:func:`busy_and_span`):
    the share of the ranks' time in the step that no action ran; 0 when nothing ran."""
    longest = max((span for _, span in busy_and_spans), default=0.0)
    if longest <= 0:
        return 0.0
    return 1.0 - sum(busy for busy, _ in busy_and_spans) / (len(busy_and_spans) * longest)


def measured_costs(rows: Iterable[Iterable[tuple[Action, float, float]]], stages: int,
                   ) -> tuple[list[float], list[float], list[float] | None]:
    """Per stage, the measured ``(t_f, t_b, t_w)`` of one micro-batch (the simulator's costs, see
    :func:`pipeline_recipes.strategies.schedules.simulate.action_cost`) from timeline boxes: each kind's total time over
    its total micro-batch units (a doubled forward is two, a halved backward one half), so the
    simulated actions add up to the measured busy time. ``t_w`` is ``None`` without ``W`` boxes;
    ``t_b`` of a split backward is its ``I`` plus its ``W``. A stage without boxes of a kind gets the
    mean of the other stages' (t_b = 2·t_f, 1 and 2 when none has any)."""
    total = {(s, k): [0.0, 0.0] for s in range(stages) for k in KINDS}
    for row in rows:
        for action, start, end in row:
            units = len(action.mbs) if action.kind == "F" else (0.5 if action.half is not None else 1.0)
            cell = total[(action.stage, action.kind)]
            cell[0] += end - start
            cell[1] += units

    def per_unit(stage: int, kind: str) -> float | None:
        seconds, units = total[(stage, kind)]
        return seconds / units if units else None

    def filled(values: list[float | None], default: list[float]) -> list[float]:
        known = [v for v in values if v is not None]
        return [v if v is not None else (sum(known) / len(known) if known else d) for v, d in zip(values, default)]

    t_f = filled([per_unit(s, "F") for s in range(stages)], [1.0] * stages)
    has_w = any(total[(s, "W")][1] for s in range(stages))
    t_w = filled([per_unit(s, "W") for s in range(stages)], t_f) if has_w else None
    t_b_raw: list[float | None] = []
    for s in range(stages):
        (b_sec, b_units), (i_sec, i_units) = total[(s, "B")], total[(s, "I")]
        w = t_w[s] if t_w is not None else 0.0
        # a whole backward costs t_b; a split one I + W (I alone costs t_b − t_w)
        t_b_raw.append((b_sec + i_sec + w * i_units) / (b_units + i_units) if b_units + i_units else None)
    t_b = filled(t_b_raw, [2 * f for f in t_f])
    if t_w is not None:
        t_w = [min(w, b) for w, b in zip(t_w, t_b)]
    return t_f, t_b, t_w


def theory_bubble_ratio(schedule: Schedule, rows: Sequence[Sequence[tuple[Action, float, float]]] | None) -> float:
    """:func:`bubble_ratio` of ``schedule`` simulated without communication at the per-stage action
    times measured in ``rows`` (one timeline per rank, :func:`measured_costs`); ``rows`` ``None`` or
    empty: at t_b = 2·t_f. The measured ratio of the same step minus this one is what waiting on
    messages and host-side stalls cost."""
    if rows and any(rows):
        t_f, t_b, t_w = measured_costs(rows, schedule.stages)
        sim = simulate(schedule, t_f=t_f, t_b=t_b, t_w=t_w)
    else:
        sim = simulate(schedule, t_f=1.0, t_b=2.0)
    return bubble_ratio([(sum(t.end - t.start for t in row), row[-1].end - row[0].start if row else 0.0)
                         for row in sim.timeline])


def _all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """One row per rank (a collective: every rank takes part); a single process gives one row. A rank lost during
    it is named like a lost p2p peer (:func:`pipeline_recipes.strategies.runtime.collectives.wait_collective`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.reshape(1, -1)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    wait_collective(dist.all_gather(rows, local, async_op=True), None, "the metrics all-gather", time.monotonic())
    return torch.stack(rows)


class ReplicaThroughputMonitor(Callback):
    """Samples, tokens and iteration time per second of the run, measured by rank 0 over windows of
    ``window_size`` steps, counting the W data-parallel replicas that consume distinct samples, not the
    W·D processes (each of a replica's D ranks sees the same mini-batch).

    A CUDA device is synchronised once per window, where a window ends (Lightning's ``ThroughputMonitor``
    synchronised it after every step and cost rank 0 about 0.4 ms per step on CPUs); between windows a
    step only counts its batch, and validation runs inside a window are left out of its time.
    :attr:`history` keeps every window's rates for the run's medians.
    """

    def __init__(self, replicas: int, window_size: int = 3) -> None:
        if window_size < 1:
            raise ValueError(f"metrics.window_size must be >= 1 step, got {window_size}")
        self.replicas, self.window_size = int(replicas), int(window_size)
        self.history: list[dict[str, float]] = []
        self._start, self._steps, self._samples, self._tokens = 0.0, 0, 0, 0  # the window so far
        self._validating_since: float | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._steps, self._samples, self._tokens = time.perf_counter(), 0, 0, 0

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validating_since = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validating_since is not None:  # a validation run inside training is not training time
            self._start += time.perf_counter() - self._validating_since
            self._validating_since = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        self._steps += 1
        self._samples += samples_in(batch)
        self._tokens += tokens_in(batch)
        if self._steps < self.window_size:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the window's steps have run, not just been launched
        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)
        self.history.append({"samples_per_s": self._samples * self.replicas / seconds,
                             "tokens_per_s": self._tokens * self.replicas / seconds,
                             "iteration_s": seconds / self._steps})
        self._start, self._steps, self._samples, self._tokens = now, 0, 0, 0

    def median(self, key: str, warmup: int = 0) -> float | None:
        values = [h[key] for h in self.history[warmup:]] or [h[key] for h in self.history]
        return statistics.median(values) if values else None


class PipelineMetrics(Callback):
    """Loss history, measured bubble ratio, peak memory per rank, timeline picture and results.json."""

    def __init__(self, layout: Layout, out_dir: str | Path, throughput: ReplicaThroughputMonitor,
                 warmup_steps: int = 1, flops_per_token: int | None = None, peak_tflops: float | None = None) -> None:
        self.layout, self.out_dir, self.throughput, self.warmup_steps = layout, Path(out_dir), throughput, warmup_steps
        self._running_written_at: float | None = None
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.utilisation = Utilisation(flops_per_token, layout.world_size)  # the peak is known once set up
        self.loss_history: list[float] = []
        self.lr_history: list[float | None] = []
        self._lr: float | None = None
        self.bubbles: list[float] = []
        self.peak_memory: list[int] = []
        self.parameter_bytes: list[int] = []  # per rank: the parameters it holds, and its optimizer's state
        self.optimizer_state_bytes: list[int] = []
        # (loss, step record, async loss step) of the steps since the last gather (:meth:`_collect`); the
        # records' timelines are read there, not every step (on a GPU reading one waits for the device)
        self._pending: list[tuple[torch.Tensor, Any, int | None]] = []
        self._device = torch.device("cpu")
        self._trainer: pl.Trainer | None = None
        self._rows: list[tuple[int, dict[str, float]]] = []  # rank 0: (step, metrics) not written yet

    @override
    def state_dict(self) -> dict[str, Any]:  # kept in checkpoints: a resumed run reports the whole history
        if self._pending and self._trainer is not None:  # every rank saves (dump_checkpoint runs everywhere)
            self._collect(self._engine(self._trainer))
        return {"loss_history": list(self.loss_history), "lr_history": list(self.lr_history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_history = [float(x) for x in state_dict.get("loss_history", [])]
        self.lr_history = [None if x is None else float(x) for x in state_dict.get("lr_history", [])]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.utilisation = resolve_utilisation(self.flops_per_token, self.layout.world_size,
                                               trainer.strategy.root_device, trainer.precision, self.peak_tflops)
        self._device, self._trainer = trainer.strategy.root_device, trainer

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # the rate this step's update uses: Lightning steps the scheduler before on_train_batch_end
        self._lr = float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else None

    @staticmethod
    def _engine(trainer: pl.Trainer):
        strategy = trainer.strategy
        return strategy.engine if isinstance(strategy, PipelineStrategy) else None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Keep this step's loss and timeline figures; gather them over the ranks only on reporting steps
        (:func:`pipeline_recipes.strategies.lightning.strategy.reporting_step`): a collective every step would line the ranks up
        once more per step."""
        engine = self._engine(trainer)
        record = engine.last_record if engine is not None else None  # its timeline is read when gathered
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.lr_history.append(self._lr)
        if trainer.is_global_zero:  # the learning rate of every step, written to the loggers on reporting steps
            self._rows.append((trainer.global_step - 1, {} if self._lr is None else {"train/lr": self._lr}))
        step = engine.loss_step if engine is not None and engine.config.is_async else None
        self._pending.append((torch.full((), float("nan")) if loss is None else loss.detach(), record, step))
        if not reporting_step(trainer, trainer.global_step):
            return
        self._collect(engine)
        if trainer.is_global_zero and self._rows:  # this step's row also carries the bubble and memory figures
            figures = self._rows[-1][1]
            if record is not None and self.bubbles:
                figures["train/bubble_ratio_measured"] = self.bubbles[-1]
            figures["memory/peak_bytes_max"] = float(max(self.peak_memory))
            figures.update({f"memory/peak_bytes_rank{rank}": float(peak) for rank, peak in enumerate(self.peak_memory)})
        self._write_rows(trainer)
        now = time.monotonic()
        if trainer.is_global_zero and (self._running_written_at is None
                                       or now - self._running_written_at >= RUNNING_RESULTS_S):
            self._running_written_at = now
            self._write_progress(trainer)

    def _write_progress(self, trainer: pl.Trainer, **figures: Any) -> None:
        """Rank 0's ``results.json`` while the job runs (status ``running``): the layout, the histories reached and
        ``figures``, no collective. The launcher writes the final one over it, with how the job ended
        (:mod:`pipeline_recipes.recipe.report.ending`); a write that fails (a full disk) is left to it to report."""
        try:
            write_results(self.out_dir, status="running", reason="", **self.layout.result_fields(), **figures,
                          peak_memory_bytes=self.peak_memory, parameter_bytes=self.parameter_bytes,
                          optimizer_state_bytes=self.optimizer_state_bytes, loss_history=self.loss_history,
                          lr_history=self.lr_history,
                          final_loss=self.loss_history[-1] if self.loss_history else None,
                          global_step=trainer.global_step, last_checkpoint=newest_checkpoint(trainer),
                          checkpoint_saves=getattr(trainer.strategy, "checkpoint_saves", []))
        except OSError:
            pass

    def _write_rows(self, trainer: pl.Trainer) -> None:
        """The rows kept since the last reporting step, one logger call per step, in step order (one
        call per step, but in bursts: a logger call every step cost rank 0 about 1 ms, which the other
        ranks of a pipeline then wait for)."""
        rows, self._rows = self._rows, []
        for step, metrics in rows:
            if metrics:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)

    def _collect(self, engine: Any) -> None:
        """One collective for every step kept since the last call: the loss of each (equal on pipeline
        ranks; mean over DDP replicas), each step's measured bubble ratio, and the ranks' peak memory.
        Every rank calls it at the same steps."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        losses = torch.stack([loss.to("cpu", torch.float64).reshape(()) for loss, *_ in pending])
        times = torch.tensor([busy_and_span(record) for _, record, _ in pending], dtype=torch.float64)
        held = [float(peak_memory_bytes(self._device)), *map(float, held_bytes(self._trainer))]
        local = torch.cat([losses, times.flatten(), torch.tensor(held, dtype=torch.float64)])
        gathered = _all_gather_rows(local.to(self._device)).cpu()
        k = len(pending)
        mean_losses = gathered[:, :k].mean(dim=0)
        spans = gathered[:, k:3 * k].reshape(len(gathered), k, 2)
        for i, (_, _, step) in enumerate(pending):
            self._record_loss(float(mean_losses[i]), engine, step)
            if engine is not None and engine.last_record is not None and float(spans[:, i, 1].max()) > 0:
                self.bubbles.append(bubble_ratio([(float(b), float(t)) for b, t in spans[:, i].tolist()]))
        self.peak_memory = [int(m) for m in gathered[:, -3]]
        self.parameter_bytes = [int(m) for m in gathered[:, -2]]
        self.optimizer_state_bytes = [int(m) for m in gathered[:, -1]]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = len(self.loss_history)  # a resumed run continues the history

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Rank 0 keeps the losses reached: the gathered ones, and under a synchronous pipeline (whose loss is
        the same on every rank) those of the steps since the last gather; the launcher adds why the job ended."""
        if not trainer.is_global_zero:
            return
        engine = self._engine(trainer)
        if engine is not None and not engine.config.is_async:
            pending, self._pending = self._pending, []
            self.loss_history.extend(float(loss.to("cpu", torch.float64).reshape(())) for loss, *_ in pending)
        self._write_progress(trainer)

    def _record_loss(self, value: float, engine: Any, step: int | None = None) -> None:
        """One loss per optimizer step, in step order: an asynchronous schedule reports step t's loss
        a step or more later (:meth:`pipeline_recipes.strategies.runtime.engine.PipelineEngine.train_step`), so it
        goes where it belongs."""
        if engine is None or not engine.config.is_async:
            self.loss_history.append(value)
            return
        index = getattr(self, "_first_step", 0) + (engine.loss_step if step is None else step)
        self.loss_history[index:index + 1] = [value]

    def theory_bubble_ratio(self, trainer: pl.Trainer, rows: list | None = None) -> float:
        """:func:`theory_bubble_ratio` of what ran, at the action times of ``rows`` (the last step's
        timelines of all ranks), else of this rank's last step; 0 without a pipeline."""
        engine = self._engine(trainer)
        if engine is None:
            return 0.0
        if rows is None and engine.last_record is not None:
            rows = [engine.last_record.timeline]
        return theory_bubble_ratio(engine.whole_run(self.layout.N), rows)

    def _gather_timeline(self, trainer: pl.Trainer) -> list | None:
        engine = self._engine(trainer)
        if engine is None or engine.last_record is None or not dist.is_initialized():
            return None
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, engine.last_record.timeline)
        origin = min((row[0][1] for row in rows if row), default=0.0)  # one host: perf_counter is shared
        return [[(a, start - origin, end - origin) for a, start, end in row] for row in rows]

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._engine(trainer)
        finish_saves = getattr(trainer.strategy, "finish_saves", None)
        if finish_saves is not None:  # a checkpoint written in the background: complete, and timed, in the results
            finish_saves()
        self._collect(engine)  # steps since the last reporting step (every rank)
        for step, loss in engine.flush_losses() if engine is not None else []:  # the last steps' losses, late
            self._record_loss(float(loss), engine, step)
        rows = self._gather_timeline(trainer)
        if not trainer.is_global_zero:
            return
        picture = None
        if rows is not None:
            picture = self.out_dir / "timeline.png"
            save_png([[(a, start * 1e3, end * 1e3) for a, start, end in row] for row in rows],
                     self._engine(trainer).last_executed(self.layout.N), str(picture),
                     title=f"{self.layout.run_name}: measured step (rows = ranks)", time_unit="ms")
        warm = self.bubbles[self.warmup_steps:] or self.bubbles
        tokens_per_s = self.throughput.median("tokens_per_s", self.warmup_steps)
        summary = {
            "samples_per_s": self.throughput.median("samples_per_s", self.warmup_steps),
            "tokens_per_s": tokens_per_s,
            "iteration_s": self.throughput.median("iteration_s", self.warmup_steps),
            "bubble_ratio_measured": statistics.median(warm) if warm else None,
            "bubble_ratio_theory": self.theory_bubble_ratio(trainer, rows),
            "tflops_per_device": self.utilisation.tflops_per_device(tokens_per_s),
            "mfu": self.utilisation.mfu(tokens_per_s),
        }
        self._write_progress(trainer, **summary)
        # then the loggers (results.json and the log needed none of them): the rows kept since the last reporting
        # step, the summary, the picture; a logger whose backend is gone says so once and the run's end stands
        self._write_rows(trainer)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and lost(logger) is None:
                with backend_failures_warned(logger):
                    logger.experiment.summary.update({k: v for k, v in summary.items() if v is not None})
                    if picture is not None:
                        logger.log_image("timeline", [str(picture)])
