"""Model FLOPs per token, device peaks, MFU and the progress line (recipe.flops, recipe.progress).

Expected values are computed by hand from the PaLM / Megatron-LM formula 6·N + 12·L·d·T and from
the GPT-2 architecture (per block 12·d² + 13·d parameters), or taken from the vendors' data sheets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pipeline_recipes.recipe.report.flops import (Utilisation, flops_per_token, is_half_precision, lookup_peak_tflops,
                                           matmul_parameters, model_flops_per_token, resolve_utilisation,
                                           transformer_shape)

CONF = Path(__file__).resolve().parents[2] / "conf"


def _model_cfg(name: str, **overrides) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")), **overrides}


def test_formula_by_hand() -> None:
    # 6 · 1000 + 12 · 2 · 64 · 32 = 6000 + 49152
    assert flops_per_token(1000, n_layer=2, d_model=64, seq_len=32) == 55_152


def test_gpt2_small_counts_as_nanogpt() -> None:
    """GPT-2 small (12 × 768, vocabulary 50257, 1024 positions, tied head): the 124,439,808 parameters
    less the 786,432 of the position table = 123,653,376 (nanoGPT's non-embedding count); at T = 1024
    6N = 741,920,256 and 12·12·768·1024 = 113,246,208."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))
    d, L = 768, 12
    by_hand = L * (12 * d * d + 13 * d) + 2 * d + 50257 * d  # blocks, final norm, tied embedding / head
    assert by_hand == 123_653_376 == matmul_parameters(hf)
    assert flops_per_token(matmul_parameters(hf), L, d, 1024) == 741_920_256 + 113_246_208


def test_model_config_flops_tied_and_untied() -> None:
    """gpt2-tiny (4 × 64, vocabulary 1000, T = 32, tied): N = 4·49,984 + 128 + 64,000 = 264,064.
    Untied, the input table is a look-up only and the head counts: the same N."""
    tiny = _model_cfg("gpt2-tiny")
    assert transformer_shape(tiny) == (4, 64)
    expected = 6 * 264_064 + 12 * 4 * 64 * 32
    assert model_flops_per_token(tiny) == expected == 1_682_688
    assert model_flops_per_token({**tiny, "tie_word_embeddings": False}) == expected
    assert model_flops_per_token(tiny, seq_len=64) == 6 * 264_064 + 12 * 4 * 64 * 64
    before = torch.random.get_rng_state()
    model_flops_per_token(_model_cfg("bert-tiny"))
    assert torch.equal(before, torch.random.get_rng_state())  # no random numbers drawn
    assert model_flops_per_token({"_target_": "torch.nn.Identity"}) is None  # not a transformer config
    # a builder that cannot build on the meta device (here: unexpected keys): the model built for training counts
    built = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64))
    foreign = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2, "n_layer": 1, "n_embd": 64}
    assert model_flops_per_token(foreign, 32, model=built) == 6 * (64 * 64 + 64) + 12 * 64 * 32


def test_lookup_only_embeddings_are_not_counted() -> None:
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    assert matmul_parameters(nn.ModuleList([emb, head])) == 40  # untied: only the head multiplies
    head.weight = emb.weight
    assert matmul_parameters(nn.ModuleList([emb, head])) == 40  # tied: counted once
    assert matmul_parameters(nn.ModuleList([emb, nn.LayerNorm(4)])) == 8


@pytest.mark.parametrize("name, half, expected", [
    ("NVIDIA A100-SXM4-80GB", True, ("A100", 312.0)),
    ("NVIDIA H100 80GB HBM3", True, ("H100 SXM", 989.0)),
    ("NVIDIA H100 PCIe", True, ("H100 PCIe", 756.0)),
    ("NVIDIA H200", True, ("H200", 989.0)),
    ("NVIDIA L4", True, ("L4", 121.0)),
    ("NVIDIA L40S", True, ("L40S", 362.0)),
    ("NVIDIA A10G", True, ("A10G", 125.0)),
    ("Tesla V100-SXM2-32GB", True, ("V100 SXM", 125.0)),
    ("NVIDIA A100-SXM4-80GB", False, ("A100", 19.5)),
    ("Some Future GPU", True, None),
])
def test_peak_table(name: str, half: bool, expected: tuple | None) -> None:
    assert lookup_peak_tflops(name, half) == expected


def test_precision_and_cpu_peak() -> None:
    assert is_half_precision("bf16-mixed") and is_half_precision("16-mixed") and not is_half_precision("32-true")
    cpu = resolve_utilisation(1_000, 4, torch.device("cpu"), "32-true")
    assert cpu.peak_tflops is None and cpu.mfu(1e9) is None
    assert resolve_utilisation(1_000, 4, torch.device("cpu"), "32", peak_tflops=2.0).peak_tflops == 2.0
    with pytest.raises(ValueError, match="trainer.peak_tflops must be positive"):
        resolve_utilisation(1_000, 4, torch.device("cpu"), "32", peak_tflops=0)


def test_utilisation_spreads_over_all_devices() -> None:
    """1e9 FLOPs per token at 8e5 tokens/s over W·D = 8 devices: 100 TFLOP/s each; MFU 100/312."""
    util = Utilisation(flops_per_token=10**9, devices=8, peak_tflops=312.0)
    assert util.tflops_per_device(8e5) == pytest.approx(100.0)
    assert util.mfu(8e5) == pytest.approx(100.0 / 312.0)
    assert Utilisation(None, 8, 312.0).mfu(8e5) is None


def test_progress_line_has_every_field() -> None:
    from pipeline_recipes.recipe.worker.progress import format_progress

    line = format_progress(10, 40, 6.14231, 8.66e-4, 512.34, 16394.2, 0.0312, None, 612 * 1024 * 1024)
    assert line == ("step 10/40 | loss 6.1423 | lr 8.66e-04 | 512.3 samples/s | 16,394 tokens/s | "
                    "0.0312 TFLOP/s/device | MFU n/a | peak mem 612 MiB")
    assert "MFU 41.3%" in format_progress(1, 2, 1.0, 1e-3, 1.0, 1.0, 128.9, 0.413, 1)


def test_progress_lines_are_at_most_one_per_interval_and_the_last_always(monkeypatch, capsys) -> None:
    """Logging every step, 0.4 s per step, at most a line a second: lines at steps 1, 4 (1.2 s after 1),
    7 and 10 (the last); the loggers get TFLOP/s on every step."""
    from types import SimpleNamespace

    from pipeline_recipes.recipe.worker import progress as progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(step))
    metrics = SimpleNamespace(layout=SimpleNamespace(global_batch_size=4), utilisation=Utilisation(1000, 2),
                              loss_history=[2.0], lr_history=[1e-3], peak_memory=[1])
    trainer = SimpleNamespace(is_global_zero=True, log_every_n_steps=1, max_steps=10, global_step=0, loggers=[logger],
                              progress_bar_callback=None, should_stop=False)
    line = progress.ProgressLine(metrics, replicas=1, min_interval_s=1.0)
    line.on_train_start(trainer, None)
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    for step in range(1, 11):
        trainer.global_step, now[0] = step, 0.4 * step
        line.on_train_batch_end(trainer, None, None, batch, step - 1)
    printed = [int(row.split(" | ")[0].split()[1].split("/")[0]) for row in capsys.readouterr().out.splitlines()]
    assert printed == [1, 4, 7, 10]
    assert logged == list(range(10))
