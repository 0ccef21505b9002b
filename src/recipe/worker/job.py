"""One training job inside one process of the job's world (launched by :mod:`pipeline_recipes.recipe.launch.main`, by
torchrun or by SLURM): build model, data, strategy, loggers, metrics and checkpointing from the
resolved config, then ``Trainer.fit`` (resuming from ``ckpt_path`` when given).

The job file (``job.yaml``, :mod:`pipeline_recipes.recipe.worker.job_spec`) holds the resolved Hydra config, the layout the
launcher resolved (:class:`~pipeline_recipes.core.layout.Layout`) and the W&B group, so a worker needs no Hydra context;
the pipeline strategy and the stage table read that layout (:func:`build_strategy`, :func:`stage_table`).
"""

from __future__ import annotations

import logging
import re
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import get_object, instantiate
from lightning.pytorch.loggers import WandbLogger

from pipeline_recipes.core.layout import Layout
from pipeline_recipes.core.signals import SignalRecord
from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S
from pipeline_recipes.strategies.lightning.strategy import CONFIG_KEYS, PipelineModule, PipelineStrategy, share_gpus
from pipeline_recipes.strategies.lightning.precision import with_precision_plugin
from pipeline_recipes.strategies.lightning.stop import StopOnSignal
from pipeline_recipes.strategies.lightning.verified_checkpoint import VerifiedCheckpoint
from pipeline_recipes.strategies.runtime.topology import Topology

from pipeline_recipes.recipe.check.accelerator import GPU_NAMES, apply_float32_matmul_precision, resolve_compile, shared_devices
from pipeline_recipes.recipe.worker.background_logger import finish_wandb
from pipeline_recipes.recipe.check.launch_mode import is_global_zero
from pipeline_recipes.recipe.report.ending import JobEnd
from pipeline_recipes.recipe.report.flops import model_flops_per_token
from pipeline_recipes.recipe.worker.job_spec import JobSpec
from pipeline_recipes.recipe.worker.loggers import instantiate_loggers
from pipeline_recipes.recipe.worker.metrics import PipelineMetrics, ReplicaThroughputMonitor
from pipeline_recipes.recipe.worker.progress import ProgressLine
from pipeline_recipes.recipe.check.resume import CHECKPOINT_DIR

LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"  # Lightning 2.6's advert, logged by every Trainer
# Lightning's INFO lines that repeat what the recipe's own lines say (the layout line names the accelerator and
# the processes, the strategy's line every rank's place, the last line the steps run), each matched from its start
NOT_NEWS = (
    re.escape(LITLOGGER_TIP),
    r"GPU available: ", r"TPU available: ", r"HPU available: ",  # the accelerator banner
    r"LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES: ",  # every GPU rank's device list
    r"Initializing distributed: GLOBAL_RANK: ", r"-+\ndistributed_backend=",  # the process group's banner
    r"`Trainer\.fit` stopped: `max_steps=\d+` reached\.",  # the configured end (other ends still print)
)
# the loggers Lightning writes those lines to (rank_zero_info's module logger is whichever package set it last)
NOTICE_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                  "lightning.fabric.utilities.distributed", "lightning.pytorch.accelerators.cuda")
_NOT_NEWS = re.compile("|".join(f"(?:{pattern})" for pattern in NOT_NEWS))


def is_news(record: logging.LogRecord) -> bool:
    """False for an INFO (or lower) record of :data:`NOT_NEWS`; a warning or an error is always news."""
    return record.levelno > logging.INFO or _NOT_NEWS.match(record.getMessage()) is None


def quiet_library_notices() -> None:
    """Drop library messages that say nothing about this run, each matched by its text: Lightning's own use
    of torch's deprecated ``LeafSpec`` (a ``FutureWarning`` from its ``_pytree`` module), its advice to prepend
    ``srun`` wherever ``srun`` exists (the recipe reads SLURM itself, :mod:`pipeline_recipes.recipe.check.launch_mode`: the
    workers of a one-task-per-node job are no SLURM tasks, on purpose), and the INFO lines of :data:`NOT_NEWS` (its
    litlogger tip, its accelerator and process-group banners, the ``max_steps`` end). Its warnings all stay (e.g.
    "GPU available but not used")."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    for name in NOTICE_LOGGERS:
        logger = logging.getLogger(name)
        if is_news not in logger.filters:
            logger.addFilter(is_news)


def quiet_resume_notice(checkpointing: list[Any], ckpt_path: str | None) -> None:
    """A run resuming from a save in its own checkpoint directory: ModelCheckpoint's "Checkpoint directory …
    exists and is not empty" is that save, no news, and is dropped for that directory only. A run that does not
    resume from it (a fresh run into a used job directory, ``ckpt_path=auto`` that found no complete save, a resume
    from elsewhere) still gets the warning: its saves go next to ones it did not write."""
    if ckpt_path is None:
        return
    resumed = Path(ckpt_path).resolve()
    for callback in checkpointing:
        directory = Path(callback.dirpath).resolve()
        if resumed == directory or directory in resumed.parents:
            warnings.filterwarnings("ignore", message=re.escape(
                f"Checkpoint directory {callback.dirpath} exists and is not empty.") + "$")


def is_rank_zero() -> bool:
    """Global rank 0 of the job (``RANK``, or ``SLURM_PROCID`` under SLURM: torchrun sets no ``NODE_RANK``)."""
    return is_global_zero()


def checkpoint_callbacks(spec: JobSpec) -> list[Any]:
    """The ``checkpoint`` section: a ModelCheckpoint saving every ``every_n_steps`` training steps into
    ``<job dir>/checkpoints/step-NNNNNN.ckpt`` (sharded directories under the pipeline strategies),
    keeping the latest or all of them (latest: the previous one is removed once the new one has verified,
    :class:`~pipeline_recipes.strategies.lightning.verified_checkpoint.VerifiedCheckpoint`); none when
    ``every_n_steps`` is null."""
    cfg = dict(spec.config.get("checkpoint") or {})
    every = cfg.get("every_n_steps")
    if not every:
        return []
    keep = cfg.get("keep", "latest")
    if keep not in ("latest", "all"):
        raise ValueError(f"checkpoint.keep must be 'latest' or 'all', got {keep!r}")
    return [VerifiedCheckpoint(dirpath=str(Path(spec.out_dir) / CHECKPOINT_DIR), filename="step-{step:06d}",
                               auto_insert_metric_name=False, every_n_train_steps=int(every),
                               save_top_k=-1 if keep == "all" else 1, save_last=False,
                               enable_version_counter=False)]


RECIPE_TRAINER_KEYS = ("peak_tflops", "float32_matmul_precision")  # trainer.* keys of ours, not Trainer arguments


def trainer_kwargs(trainer_cfg: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """``Trainer`` arguments: the recipe's (strategy, loggers, callbacks, output directory, no progress
    bar) overridden by every ``trainer.*`` key the user set except the recipe's own
    (``RECIPE_TRAINER_KEYS``); ``trainer.callbacks`` (Hydra configs or callbacks) are added to the
    recipe's. ``trainer.strategy`` is refused: the ``strategy`` group derives the layout."""
    user = {k: v for k, v in trainer_cfg.items() if k not in RECIPE_TRAINER_KEYS}
    if user.get("strategy") is not None:
        raise ValueError(f"trainer.strategy={user['strategy']!r} is not a setting of this recipe: choose the "
                         "strategy with the strategy group (strategy=gpipe, strategy=ddp, ...)")
    user.pop("strategy", None)
    extra = user.pop("callbacks", None) or []
    extra = [instantiate(c) if isinstance(c, dict) else c for c in (extra if isinstance(extra, list) else [extra])]
    kwargs = {**recipe, **user}
    kwargs["callbacks"] = [*recipe.get("callbacks", []), *extra]
    return kwargs


def place_ranks(strategy: Any, trainer_cfg: dict[str, Any], gpus: int | None = None) -> list[int] | None:
    """More processes per node than GPUs (``trainer=auto``, checked by the launcher): the ranks share the
    node's ``gpus`` (default: the visible ones) over gloo, and Lightning's ``devices`` becomes the GPUs
    used (it checks they exist; the processes come from the strategy). Returns each local rank's GPU, or
    None when every rank has its own."""
    if trainer_cfg.get("accelerator") not in GPU_NAMES or not isinstance(trainer_cfg.get("devices"), int):
        return None
    if gpus is None:
        gpus = torch.cuda.device_count()
    gpu_of_rank = shared_devices(trainer_cfg["devices"], gpus)
    if gpu_of_rank is not None:
        share_gpus(strategy, gpu_of_rank)
        trainer_cfg["devices"] = len(set(gpu_of_rank))
    return gpu_of_rank


def stage_table(model: Any, topology: Topology) -> str:
    """The partition table of the S stages that train (``model.partition(S)``, as the strategy splits the
    model; S = v·D) and the worker holding each stage, from ``topology`` (the layout's:
    :meth:`~pipeline_recipes.strategies.runtime.topology.Topology.from_layout`): the data of the strategy's
    ``rank r: … stages […]`` line."""
    holders = [sorted({row[s] for row in topology.placement}) for s in range(topology.stages)]
    placement = ", ".join(f"stage {s} → worker{'s' if len(ws) > 1 else ''} {' and '.join(map(str, ws))}"
                          for s, ws in enumerate(holders))
    return (f"{model.partition_table(model.partition(topology.stages))}\nplacement: {placement} "
            f"(worker w is rank w + {topology.workers}·r of replica r)")


def build_strategy(strategy_cfg: dict[str, Any], layout: Layout) -> Any:
    """The strategy of the job: a pipeline strategy (the ``_target_`` a :class:`PipelineStrategy`) from the layout the
    launcher resolved (:meth:`PipelineStrategy.from_layout`), with the config's ``timeout_s`` and any key that is no
    setting of the layout (Lightning's own, passed on); a baseline as configured, with the layout's B where the config
    leaves ``micro_batch_size`` null."""
    target = get_object(strategy_cfg["_target_"])
    if isinstance(target, type) and issubclass(target, PipelineStrategy):
        passed_on = {k: v for k, v in strategy_cfg.items() if k not in CONFIG_KEYS and not k.startswith("_")}
        return target.from_layout(layout, **passed_on, timeout_s=float(strategy_cfg["timeout_s"]))
    unset_batch = strategy_cfg.get("micro_batch_size", 0) is None
    return instantiate(strategy_cfg, **({"micro_batch_size": layout.B} if unset_batch else {}))


def run_job(spec: JobSpec, signals: SignalRecord | None = None) -> JobEnd:
    """Train as configured; how it ended (ok, or stopped by a signal: :mod:`pipeline_recipes.strategies.lightning.stop`;
    a divergence or failure raises). ``signals``: the process's stop signals, recorded since it started."""
    quiet_library_notices()
    cfg, layout = spec.config, spec.layout
    trainer_cfg = dict(cfg["trainer"])
    peak_tflops = trainer_cfg.pop("peak_tflops", None)  # ours, not a Trainer argument
    if trainer_cfg.get("accelerator") == "cpu":
        torch.set_num_threads(1)
    apply_float32_matmul_precision(trainer_cfg)  # before any matmul of the model
    strategy = build_strategy(cfg["strategy"], layout)
    place_ranks(strategy, trainer_cfg)
    pipeline = isinstance(strategy, PipelineStrategy)
    pl.seed_everything(cfg["seed"], workers=True, verbose=False)  # same seed everywhere: identical stage copies
    # A pipeline builds on the meta device and materialises only this rank's layers (PipelineEngine): no
    # rank holds the whole model. Baselines build it whole, from the same per-module init streams.
    model = instantiate(cfg["model"], **({"device": "meta"} if pipeline else {}))
    if is_rank_zero() and pipeline and layout.stages > 1:
        print(stage_table(model, Topology.from_layout(layout)), flush=True)
    data = instantiate(cfg["data"], batch_size=layout.global_batch_size // layout.W)
    optim = dict(cfg.get("optim") or {})
    # conf/optim and conf/scheduler are _partial_: the module completes them with its parameter groups
    module = PipelineModule(model, lr=optim.get("lr", 1e-3), weight_decay=optim.get("weight_decay", 0.0),
                            nonfinite_loss=cfg.get("nonfinite_loss", "stop"), model_config=cfg["model"],
                            optimizer=instantiate(optim, _convert_="all") if optim.get("_target_") else None,
                            scheduler=instantiate(cfg["scheduler"], _convert_="all") if cfg.get("scheduler") else None,
                            compile_blocks=resolve_compile(cfg["model"].get("compile"), trainer_cfg["accelerator"]),
                            nonfinite_patience=cfg.get("nonfinite_loss_patience", 3))
    checkpointing = checkpoint_callbacks(spec)
    if checkpointing:
        trainer_cfg["enable_checkpointing"] = True
    if pipeline and (cfg.get("checkpoint") or {}).get("async_save", False):
        strategy.save_in_background()  # every save, the periodic ones and a stop's
    ckpt_path = cfg.get("ckpt_path")  # resolved (auto) and checked by the launcher: recipe.resume
    quiet_resume_notice(checkpointing, ckpt_path)
    metrics_cfg = cfg.get("metrics", {})
    throughput = ReplicaThroughputMonitor(layout.W, window_size=int(metrics_cfg.get("window_size", 3)))
    seq_len = (cfg.get("data") or {}).get("seq_len") or cfg["model"].get("seq_len")
    stop = StopOnSignal(signals, raise_at_end=False,
                        timeout=timedelta(seconds=float(cfg["strategy"].get("timeout_s", COLLECTIVE_TIMEOUT_S))))
    metrics = PipelineMetrics(layout, spec.out_dir, throughput, warmup_steps=int(metrics_cfg.get("warmup_steps", 1)),
                              flops_per_token=model_flops_per_token(cfg["model"], seq_len, model),
                              peak_tflops=peak_tflops)
    progress = ProgressLine(metrics, layout.W, min_interval_s=float(metrics_cfg.get("progress_interval_s", 1.0)))
    loggers = instantiate_loggers(spec)
    # bf16-mixed as a plugin that also clips a fused optimizer (Lightning's refuses: strategies/lightning/precision.py)
    trainer = pl.Trainer(**with_precision_plugin(trainer_kwargs(trainer_cfg, {
        "strategy": strategy, "logger": loggers or False, "default_root_dir": spec.out_dir,
        "callbacks": [throughput, metrics, progress, stop, *checkpointing],
        "enable_progress_bar": False,
    })))
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    finally:
        if trainer.is_global_zero and any(isinstance(lg, WandbLogger) for lg in loggers):
            # the writers stopped, then wandb.finish(), every wait bounded; a W&B service that is gone (signalled
            # with the job) is one warning, never the job's end, and a W&B error never hides the run's own error
            finish_wandb(loggers)
    return stop_ending(stop)


def stop_ending(stop: StopOnSignal) -> JobEnd:
    """Ok, or stopped by the signal every rank agreed on."""
    if stop.request is None:
        return JobEnd("ok")
    return JobEnd.stopped(stop.request.signum, stop.request.describe())
