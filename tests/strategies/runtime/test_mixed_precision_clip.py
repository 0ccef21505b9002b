"""Gradient clipping under mixed precision: bf16 (no loss scaler) clips every optimizer, fused ones
included, for every strategy; fp16 with a scaler and a fused optimizer is refused before launch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline_recipes.recipe.check.accelerator import check_precision
from pipeline_recipes.recipe.check.settings import ConfigError
from pipeline_recipes.strategies.lightning.precision import ClippingMixedPrecision, with_precision_plugin
from train_jobs import run_train_jobs

ROOT = Path(__file__).resolve().parents[3]
BF16_LOSS_TOL = 2e-3  # the same run under another layout: bf16 roundings of ~2^-9 relative, averaged in the loss


def _bf16_backward(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    nn.functional.mse_loss(out.float(), y).backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_bf16_clips_a_fused_optimizer_like_clip_grad_norm_on_a_plain_copy(optimizer: type) -> None:
    """The plugin clips the gradients of a fused optimizer and of the unfused one to the same tensors as
    ``torch.nn.utils.clip_grad_norm_`` on a plain copy of the model; the two then take the same step."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    reference = copy.deepcopy(base)
    _bf16_backward(reference)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    clip = 0.1 * norm  # active: the gradients shrink tenfold
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    want = _grads(reference)

    plugin = ClippingMixedPrecision("bf16-mixed", "cpu")
    stepped = []
    for fused in (True, None):
        model = copy.deepcopy(base)
        _bf16_backward(model)
        opt = optimizer(model.parameters(), lr=0.1, fused=fused)
        assert bool(getattr(opt, "_step_supports_amp_scaling", False)) is bool(fused)  # fused: unscales in its step
        plugin.clip_gradients(opt, clip)
        for got, expected in zip(_grads(model), want):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        assert float(torch.nn.utils.get_total_norm(_grads(model))) == pytest.approx(clip, rel=1e-5)
        opt.step()
        stepped.append([p.detach().clone() for p in model.parameters()])
    for fused_param, plain_param in zip(*stepped):
        torch.testing.assert_close(fused_param, plain_param, rtol=1e-5, atol=1e-6)


def test_fp16_scaler_with_a_fused_optimizer_is_refused_before_launch() -> None:
    """fp16 + fused + clipping: the launcher names the three settings, why, and the fixes; with a
    scaler the plugin still refuses (the gradients carry the loss scale); bf16 passes for every strategy."""
    fused = {"_target_": "torch.optim.AdamW", "fused": True}
    with pytest.raises(ConfigError) as err:
        check_precision("single", {"precision": "16-mixed", "gradient_clip_val": 0.5}, fused)
    message = str(err.value)
    for part in ("trainer.precision = 16-mixed", "optim.fused = true", "trainer.gradient_clip_val = 0.5",
                 "loss scale", "trainer.precision=bf16-mixed", "optim.fused=null", "trainer.gradient_clip_val=null"):
        assert part in message, message
    for strategy in ("single", "ddp", "gpipe", "dapple", "chimera"):
        check_precision(strategy, {"precision": "bf16-mixed", "gradient_clip_val": 0.5}, fused)

    param = nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    scaled = ClippingMixedPrecision("16-mixed", "cpu")
    assert scaled.scaler is not None
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        scaled.clip_gradients(torch.optim.AdamW([param], fused=True), 0.5)


def test_bf16_reaches_the_trainer_as_the_clipping_plugin() -> None:
    import lightning.pytorch as pl

    assert with_precision_plugin({"precision": "32-true", "accelerator": "cpu"}) == \
        {"precision": "32-true", "accelerator": "cpu"}
    kwargs = with_precision_plugin({"precision": "bf16-mixed", "accelerator": "cpu", "devices": 1})
    assert "precision" not in kwargs  # Lightning takes a precision or a precision plugin
    (plugin,) = kwargs["plugins"]
    assert isinstance(plugin, ClippingMixedPrecision) and plugin.device == "cpu" and plugin.scaler is None
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    assert trainer.precision == "bf16-mixed" and trainer.precision_plugin is plugin


def test_cpu_trainer_takes_a_precision_without_plus() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["trainer=cpu", "trainer.precision=bf16-mixed"])
    assert cfg.trainer.precision == "bf16-mixed"


@pytest.mark.slow
def test_baselines_and_pipelines_clip_alike_under_bf16(tmp_path: Path) -> None:
    """``train.py`` under bf16-mixed with the default fused AdamW and a clip far below the gradient norm:
    single (1 process), DDP (W = 2), GPipe and DAPPLE (D = 2) see the same batches and give the same
    losses at bf16 tolerance. The clip is small enough that Adam's ε matters, so the update depends on the
    norm each strategy clips by; the same single run without clipping departs from them."""
    common = ["trainer=cpu", "trainer.precision=bf16-mixed", "trainer.max_steps=4", "logger=none",
              "data.global_batch_size=8", "preflight=false", "scheduler=constant", "optim.lr=1e-2",
              "trainer.gradient_clip_val=1e-5"]
    jobs = {"single": ["strategy=single", "trainer.devices=1"],
            "ddp": ["strategy=ddp", "trainer.devices=2"],
            "gpipe": ["strategy=gpipe", "strategy.D=2", "trainer.devices=2"],
            "dapple": ["strategy=dapple", "strategy.D=2", "trainer.devices=2"],
            "unclipped": ["strategy=single", "trainer.devices=1", "trainer.gradient_clip_val=null"]}
    losses = {name: result["loss_history"] for name, result in run_train_jobs(tmp_path, common, jobs)[0].items()}
    reference = losses["single"]
    assert len(reference) == 4
    for name in ("ddp", "gpipe", "dapple"):
        assert losses[name] == pytest.approx(reference, abs=BF16_LOSS_TOL), (name, losses)
    departure = max(abs(a - b) for a, b in zip(losses["unclipped"], reference))
    assert departure > 5 * BF16_LOSS_TOL, losses  # clipping changed the updates (in fp32: the 4th loss by 0.014)
