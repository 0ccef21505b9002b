"""``strategy=auto``: replace it by the planner's best layout before Hydra composes the job.

:func:`auto_overrides` composes the config the rest of the overrides describe, profiles the model on
this device (cached, :func:`pipeline_recipes.planner.profile.load_or_profile`) or, under ``cluster=<name>`` (a
described cluster), derives its costs there (:func:`pipeline_recipes.planner.derived_costs.described_costs`), predicts every layout of the configured
processes and global batch (:func:`pipeline_recipes.planner.recommend.best_config`, Chimera §3.4) and returns the
overrides with ``strategy=auto`` replaced by the best one's ``strategy=…``, ``strategy.D=…`` and so on
(:meth:`pipeline_recipes.planner.predict.Candidate.overrides`), ``strategy.shard_optimizer`` included: the planner
compares every layout with its optimizer state whole and sharded across each stage's copies (ZeRO stage 1, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", §5.1) where the rule allows it, so a layout that fits
only sharded, or runs faster sharded, comes with ``strategy.shard_optimizer=true``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline_recipes.core.node import GPU_NAMES
from pipeline_recipes.planner.cluster import ClusterSpec
from pipeline_recipes.planner.derived_costs import described_budget, described_costs
from pipeline_recipes.planner.estimate import with_run_memory
from pipeline_recipes.planner.memory import device_budget
from pipeline_recipes.planner.profile import load_or_profile
from pipeline_recipes.planner.recommend import best_config

from pipeline_recipes.recipe.check.accelerator import choose_accelerator

AUTO = "strategy=auto"


def auto_overrides(overrides: Sequence[str], config_dir: str | Path, *, cache_dir: str | Path | None = None,
                   comm: str = "measure", budget_bytes: int | None = None,
                   log: Callable[[str], None] | None = None) -> list[str]:
    """``overrides`` with ``strategy=auto`` replaced by the recommended layout (unchanged without it)."""
    rest = [o for o in overrides if o != AUTO]
    if len(rest) == len(overrides):
        return list(overrides)
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[o for o in rest if not o.startswith("strategy")])
    spec = ClusterSpec.from_config(cfg.get("cluster"))
    if not spec.measure:  # a described cluster (cluster=dgx-h100 ...): its devices, memory and network, no profiling
        per_node, nodes = int(cfg.trainer.get("devices", 1)), int(cfg.trainer.get("num_nodes", 1) or 1)
        costs = described_costs(cfg.model, spec, cfg.trainer.get("precision"))
        best = best_config(costs, per_node * nodes, int(cfg.data.global_batch_size), described_budget(spec),
                           num_nodes=nodes)
        return _replace_strategy(rest, best, log)
    trainer = choose_accelerator(OmegaConf.to_container(cfg.trainer, resolve=True)).trainer  # trainer=auto: this node
    accelerator = str(trainer.get("accelerator", "cpu"))
    per_node, nodes = int(trainer.get("devices", 1)), int(trainer.get("num_nodes", 1))
    costs = load_or_profile(cfg.model, cache_dir=cache_dir, comm=comm, log=log,
                            device="cuda" if accelerator in GPU_NAMES else "cpu")
    costs = with_run_memory(costs, OmegaConf.to_container(cfg.model, resolve=True), precision=trainer.get("precision"),
                            device="cuda" if accelerator in GPU_NAMES else "cpu")  # the run's autocast
    budget = device_budget(accelerator, override=budget_bytes, process_bytes=costs.comm.process_bytes)
    best = best_config(costs, per_node * nodes, int(cfg.data.global_batch_size), budget, num_nodes=nodes)
    return _replace_strategy(rest, best, log)


def _replace_strategy(rest: Sequence[str], best: Sequence[str], log: Callable[[str], None] | None) -> list[str]:
    chosen = [o for o in best if o.startswith("strategy")]
    if log:
        log("strategy=auto -> " + " ".join(chosen))
    return [o for o in rest if not o.startswith("strategy")] + chosen
