"""Train a model with a pipeline schedule: ``python train.py strategy=chimera model=gpt2 trainer.devices=8``.

Hydra composes ``conf/``; the layout (W, D, B, N) is derived and checked before any process
starts; Lightning launches ``trainer.devices × trainer.num_nodes`` processes (or joins an
external launcher such as torchrun or SLURM) and the strategy runs the schedule every step.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; nothing waits on the network

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from recipe.layout import ConfigError, resolve_layout

    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    try:
        layout = resolve_layout(strategy_cfg, trainer_cfg, cfg.data.global_batch_size, _num_layers(cfg))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return _train(cfg, layout, trainer_cfg)


def _num_layers(cfg: DictConfig) -> int:
    layers = cfg.model.get("n_layer", cfg.model.get("num_hidden_layers"))
    return int(layers) + 2  # embedding and head are layers too


def _train(cfg: DictConfig, layout, trainer_cfg: dict) -> float | None:
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import CSVLogger

    from strategies.lightning import PipelineModule

    is_rank_zero = int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0
    if is_rank_zero:
        print(layout.describe(), flush=True)
    if trainer_cfg.get("accelerator") == "cpu":
        torch.set_num_threads(1)
    pl.seed_everything(cfg.seed, workers=True)  # same seed everywhere: identical copies of every stage
    model = instantiate(cfg.model)
    if is_rank_zero:
        print(model.partition_table(model.partition(layout.D)), flush=True)
    data = instantiate(cfg.data, batch_size=layout.global_batch_size // layout.W)
    module = PipelineModule(model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    strategy = instantiate(cfg.strategy)
    out_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    trainer = pl.Trainer(**trainer_cfg, strategy=strategy, logger=CSVLogger(out_dir, name="", version=""),
                         default_root_dir=out_dir, enable_progress_bar=False)
    trainer.fit(module, datamodule=data)
    loss = trainer.callback_metrics.get("train/loss")
    if trainer.is_global_zero and loss is not None:
        print(f"final train/loss = {float(loss):.4f} after {trainer.global_step} steps ({out_dir})", flush=True)
    return None if loss is None else float(loss)


if __name__ == "__main__":
    main()
