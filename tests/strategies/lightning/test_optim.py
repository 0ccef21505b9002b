"""Optimizer parameter groups and learning-rate schedules (strategies.optim, conf/optim, conf/scheduler).

The schedule's expected values are worked out by hand from its definition (linear warm-up
``(s+1)/(w+1)``, then ``r + (1-r)·(1+cos(π·p))/2`` or ``r + (1-r)·(1-p)``).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from pipeline_recipes.strategies.lightning.strategy import PipelineModule
from pipeline_recipes.strategies.lightning.optim import WarmupDecayLR, build_scheduler, cosine, linear, lr_factor, param_groups

CONF = Path(__file__).resolve().parents[3] / "conf"


@pytest.mark.parametrize("decay, step, expected", [
    ("cosine", 0, 0.2), ("cosine", 3, 0.8), ("cosine", 4, 1.0), ("cosine", 8, 0.55), ("cosine", 12, 0.1),
    ("cosine", 50, 0.1), ("linear", 6, 0.775), ("linear", 8, 0.55), ("linear", 12, 0.1),
    ("constant", 2, 0.6), ("constant", 11, 1.0),
])
def test_lr_factor_by_hand(decay: str, step: int, expected: float) -> None:
    """warm-up 4 steps, horizon 12, floor 0.1: warm-up 1/5 … 4/5, peak at step 4, half-way (step 8)
    cosine and linear both at 0.1 + 0.9·0.5; linear at a quarter (step 6): 0.1 + 0.9·0.75."""
    assert lr_factor(step, warmup_steps=4, total_steps=12, min_lr_ratio=0.1, decay=decay) == pytest.approx(expected)


def _run(scheduler: WarmupDecayLR, steps: int) -> list[float]:
    optimizer, lrs = scheduler.optimizer, []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _fresh(total_steps: int = 12) -> WarmupDecayLR:
    weight = nn.Parameter(torch.ones(2, 2))
    return cosine(torch.optim.AdamW([weight], lr=1e-2), warmup_steps=4, min_lr_ratio=0.1, total_steps=total_steps)


def test_scheduler_steps_follow_the_formula_and_resume_exactly() -> None:
    whole = _run(_fresh(), 14)
    assert whole == pytest.approx([1e-2 * lr_factor(s, 4, 12, 0.1, "cosine") for s in range(14)], rel=1e-12)
    first = _fresh()
    _run(first, 6)
    saved_opt, saved_sched = first.optimizer.state_dict(), first.state_dict()
    resumed = _fresh()
    resumed.optimizer.load_state_dict(saved_opt)
    resumed.load_state_dict(saved_sched)
    assert _run(resumed, 8) == whole[6:]
    longer = _fresh(total_steps=24)  # a resumed run keeps its configured horizon, not the saved one
    longer.optimizer.load_state_dict(saved_opt)
    longer.load_state_dict(saved_sched)
    assert longer.total_steps == 24 and longer.last_epoch == 6


def test_bad_schedule_settings_are_named() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match="scheduler.min_lr_ratio must be in"):
        cosine(opt, min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="scheduler.warmup_steps must be >= 0"):
        linear(opt, warmup_steps=-1)


def test_build_scheduler_fills_an_open_horizon() -> None:
    import functools

    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    assert build_scheduler(functools.partial(cosine, warmup_steps=1), opt, 40).total_steps == 40
    assert build_scheduler(functools.partial(cosine, total_steps=7), opt, 40).total_steps == 7
    step_lr = build_scheduler(functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3), opt, 40)
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)  # no total_steps argument: left alone


def test_no_weight_decay_on_biases_and_norms() -> None:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "gpt2-tiny.yaml"))
    module = PipelineModule(instantiate({**cfg, "n_layer": 1}), weight_decay=0.1)
    names = {id(p): n for n, p in module.named_parameters()}
    decay, no_decay = param_groups(module)
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decayed == ["model.layers.0.wpe.weight", "model.layers.0.wte.weight", "model.layers.1.block.attn.c_attn.weight",
                       "model.layers.1.block.attn.c_proj.weight", "model.layers.1.block.mlp.c_fc.weight",
                       "model.layers.1.block.mlp.c_proj.weight"]  # the tied head is the embedding: once
    assert all(names[id(p)].endswith("bias") or ".ln_" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    optimizer = module.configure_optimizers()  # the plain Python default: AdamW, constant rate
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.param_groups[0]["lr"] == 1e-3


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def _module(cfg: dict, max_steps: int = 40) -> tuple[torch.optim.Optimizer, dict]:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    module = PipelineModule(model, optimizer=instantiate(cfg["optim"], _convert_="all"),
                            scheduler=instantiate(cfg["scheduler"], _convert_="all"))
    module._trainer = SimpleNamespace(max_steps=max_steps, estimated_stepping_batches=max_steps)
    configured = module.configure_optimizers()
    return configured["optimizer"], configured["lr_scheduler"]


@pytest.mark.slow
def test_config_groups_reach_the_module() -> None:
    optimizer, scheduler = _module(_compose())  # default: adamw + cosine with a short warm-up
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.999)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert scheduler["interval"] == "step" and scheduler["frequency"] == 1
    sched = scheduler["scheduler"]
    assert (sched.decay, sched.warmup_steps, sched.min_lr_ratio, sched.total_steps) == ("cosine", 10, 0.1, 40)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 11)  # first warm-up step
    optimizer, scheduler = _module(_compose("optim=sgd", "optim.lr=0.05", "optim.weight_decay=0.01",
                                            "scheduler=linear", "scheduler.warmup_steps=0",
                                            "scheduler.min_lr_ratio=0.5"), max_steps=10)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    lrs = _run(scheduler["scheduler"], 10)
    assert lrs == pytest.approx([0.05 * (0.5 + 0.5 * (1 - s / 10)) for s in range(10)])
    optimizer, scheduler = _module(_compose("scheduler=constant", "scheduler.warmup_steps=1"))
    assert _run(scheduler["scheduler"], 3) == pytest.approx([5e-4, 1e-3, 1e-3])
    assert math.isclose(optimizer.param_groups[1]["lr"], 1e-3)
