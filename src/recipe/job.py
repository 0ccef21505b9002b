"""One training job inside one process of the job's world (launched by :mod:`recipe.launch`, by
torchrun or by SLURM): build model, data, strategy, loggers, metrics and checkpointing from the
resolved config, then ``Trainer.fit`` (resuming from ``ckpt_path`` when given).

The job file (``job.yaml`` in the job's output directory) holds the resolved Hydra config, the
derived layout and the W&B group, so a worker needs no Hydra context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .layout import Layout

JOB_FILE = "job.yaml"


@dataclass(frozen=True)
class JobSpec:
    """Everything a worker needs: the resolved config, the derived layout, where to write."""

    config: dict[str, Any]
    layout: Layout
    out_dir: str
    group: str

    def save(self) -> Path:
        path = Path(self.out_dir) / JOB_FILE
        OmegaConf.save(OmegaConf.create({"config": self.config, "layout": self.layout.as_dict(),
                                         "out_dir": self.out_dir, "group": self.group}), path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        return cls(raw["config"], Layout(**raw["layout"]), raw["out_dir"], raw["group"])


def is_rank_zero() -> bool:
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def build_loggers(spec: JobSpec) -> list[Any]:
    """The ``logger`` group: ``wandb`` (offline unless told otherwise), ``csv`` or ``none``."""
    from hydra.utils import instantiate

    cfg = dict(spec.config.get("logger") or {})
    kind = cfg.pop("kind", "none")
    if kind == "none":
        return []
    layout = spec.layout
    if kind == "csv":
        logger = instantiate(cfg, save_dir=spec.out_dir, name="", version="")
    else:
        logger = instantiate(cfg, name=layout.run_name, group=spec.group, job_type=layout.label, save_dir=spec.out_dir)
    logger.log_hyperparams({**spec.config, "derived": layout.as_dict()})
    return [logger]


CHECKPOINT_DIR = "checkpoints"


def checkpoint_callbacks(spec: JobSpec) -> list[Any]:
    """The ``checkpoint`` section: a ModelCheckpoint saving every ``every_n_steps`` training steps into
    ``<job dir>/checkpoints/step-NNNNNN.ckpt`` (sharded directories under the pipeline strategies),
    keeping the latest or all of them; none when ``every_n_steps`` is null."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = dict(spec.config.get("checkpoint") or {})
    every = cfg.get("every_n_steps")
    if not every:
        return []
    keep = cfg.get("keep", "latest")
    if keep not in ("latest", "all"):
        raise ValueError(f"checkpoint.keep must be 'latest' or 'all', got {keep!r}")
    return [ModelCheckpoint(dirpath=str(Path(spec.out_dir) / CHECKPOINT_DIR), filename="step-{step:06d}",
                            auto_insert_metric_name=False, every_n_train_steps=int(every),
                            save_top_k=-1 if keep == "all" else 1, save_last=False, enable_version_counter=False)]


def resolve_ckpt_path(value: str | None, pipeline: bool = True) -> str | None:
    """``ckpt_path``: a sharded checkpoint directory, a consolidated or Lightning file, or null.

    Only the pipeline strategies read sharded directories; ``ddp`` and ``single`` need the
    consolidated file (``scripts/consolidate_ckpt.py``).
    """
    from strategies.checkpoint import is_sharded

    if not value:
        return None
    path = Path(value).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={value}: {path} does not exist")
    if not pipeline and is_sharded(path):
        raise ValueError(f"ckpt_path={value} is a sharded pipeline checkpoint, which only the pipeline strategies "
                         f"read; consolidate it first: python scripts/consolidate_ckpt.py {value} full.ckpt, then "
                         "pass ckpt_path=full.ckpt")
    return str(path)


def run_job(spec: JobSpec) -> float | None:
    """Train as configured; return the final training loss (every rank) or None."""
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate

    from strategies.lightning import PipelineModule, PipelineStrategy

    from .metrics import PipelineMetrics, ReplicaThroughputMonitor

    cfg, layout = spec.config, spec.layout
    trainer_cfg = dict(cfg["trainer"])
    if trainer_cfg.get("accelerator") == "cpu":
        torch.set_num_threads(1)
    strategy = instantiate(cfg["strategy"], **({"micro_batch_size": layout.B}
                                                if cfg["strategy"].get("micro_batch_size", 0) is None else {}))
    pipeline = isinstance(strategy, PipelineStrategy)
    pl.seed_everything(cfg["seed"], workers=True, verbose=False)  # same seed everywhere: identical stage copies
    # A pipeline builds on the meta device and materialises only this rank's layers (PipelineEngine): no
    # rank holds the whole model. Baselines build it whole, from the same per-module init streams.
    model = instantiate(cfg["model"], **({"device": "meta"} if pipeline else {}))
    if is_rank_zero() and layout.D > 1:
        print(model.partition_table(model.partition(layout.D)), flush=True)
    data = instantiate(cfg["data"], batch_size=layout.global_batch_size // layout.W)
    optim = cfg["optim"]
    module = PipelineModule(model, lr=optim["lr"], weight_decay=optim["weight_decay"],
                            nonfinite_loss=cfg.get("nonfinite_loss", "stop"), model_config=cfg["model"])
    checkpointing = checkpoint_callbacks(spec)
    if checkpointing:
        trainer_cfg["enable_checkpointing"] = True
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), pipeline=pipeline)
    metrics_cfg = cfg.get("metrics", {})
    throughput = ReplicaThroughputMonitor(layout.W, window_size=int(metrics_cfg.get("window_size", 3)))
    metrics = PipelineMetrics(layout, spec.out_dir, throughput, warmup_steps=int(metrics_cfg.get("warmup_steps", 1)))
    loggers = build_loggers(spec)
    trainer = pl.Trainer(**trainer_cfg, strategy=strategy, logger=loggers or False,
                         callbacks=[throughput, metrics, *checkpointing], default_root_dir=spec.out_dir,
                         enable_progress_bar=False)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    finally:
        if trainer.is_global_zero and any(type(lg).__name__ == "WandbLogger" for lg in loggers):
            import wandb

            wandb.finish()  # one W&B run per job
    return metrics.loss_history[-1] if metrics.loss_history else None
