"""What the default run prints: its own lines, no library noise, and the bubble column's definition.

One short ``python train.py logger=wandb`` run (the default Chimera job on 2 CPU processes, W&B offline).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_recipes.recipe.report.results import BUBBLE_NOTE

ROOT = Path(__file__).resolve().parents[2]

# where each came from: transformers' create_causal_mask(past_key_values=...) deprecation, torch's LeafSpec
# deprecation hit by Lightning's _pytree, Lightning's litlogger advert, W&B's warning about the anonymous
# setting Lightning passes, kineto's profiler start/stop lines; Lightning's accelerator and process-group banners
# and its max_steps end; W&B's banner, run history and summary panels and its sync advice
NOISE = ("FutureWarning", "past_key_values", "LeafSpec", "litlogger", "anonymous setting", "USDT", "profiler_start",
         "GPU available", "TPU available", "Initializing distributed", "distributed_backend=",
         "All distributed processes", "`Trainer.fit` stopped", "Tracking run with wandb", "Run history",
         "Run summary", "You can sync this run", "Find logs at", "wandb leet")

# every line the default run prints, by what prints it (the recipe's own lines only); the stage table has 7 lines
OWN_LINES = (
    r"layout: chimera .*",  # the launcher's layout line
    r"stage \| layers .*", r"-+\+-+.*", r" +\d+ \| \d+-\d+: .*", r"total \| .*",  # the stage table
    r"\(tied weights are counted in every layer holding them; .*",
    r"placement: stage 0 → .*", r"pipeline: chimera .*",  # the strategy's line
    r"step \d+/2 \| loss .*",  # the progress line(s)
    r"wandb: offline run in .*",  # W&B's block, one line
    r"strategy +W +D +B +N +samples/s .*", r"[- ]+", r"chimera +1 +2 +1 +32 .* ok",  # the summary table
    re.escape(BUBBLE_NOTE), r"final train/loss = .* after 2 steps \(.*\)",
)


@pytest.mark.slow
def test_the_default_run_prints_no_library_noise_and_explains_the_bubble_column(tmp_path: Path) -> None:
    """The default run (W&B offline) prints the recipe's own lines only, 17 of them with one progress line: W&B's
    34-line block is one line naming the offline run's directory and its upload command, and neither Lightning's
    banners nor its max_steps end print."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("WANDB_SILENT", "WANDB_QUIET", "WANDB_SHOW_INFO"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", "logger=wandb",
                             "trainer.max_steps=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    found = {noise: line for noise in NOISE for line in output.splitlines() if noise in line}
    assert not found, found
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")  # W&B did run, offline, in the job directory
    wandb_lines = [line for line in output.splitlines() if line.startswith("wandb:")]
    assert wandb_lines == [f"wandb: offline run in {run_dir}; upload it with: wandb sync {run_dir}"]
    lines = output.splitlines()
    strangers = [line for line in lines if not any(re.fullmatch(own, line) for own in OWN_LINES)]
    assert not strangers, strangers
    # layout 1, stage table 7, placement 1, the strategy's line 1, progress 1 (every 5 steps and the last: step 2),
    # W&B 1, summary table 3, its note 1, the final line 1
    assert len(lines) == 17, output
    table = result.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("strategy ") and "bubble meas/theory" in line)
    assert table[header + 2].startswith("chimera") and table[header + 3] == BUBBLE_NOTE


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_stage_builds_its_attention_mask_once_per_forward_without_deprecation_warnings(attn: str) -> None:
    """GPT-2's blocks share one causal mask per forward (HF's ``GPT2Model.forward`` builds one), built with the
    installed ``create_causal_mask`` signature (no FutureWarning); the loss equals the unsplit HF model's.
    BERT's encoder layers share the padding mask of the micro-batch they are given, and rebuild it for another."""
    import warnings

    import torch

    from pipeline_recipes.models.bert import build_bert
    from pipeline_recipes.models.gpt2 import build_gpt2
    from pipeline_recipes.core.pipeline_model import run_layers, sequential_loss

    gpt2 = build_gpt2("gpt2-tiny", 16, attn_implementation=attn, init_seed=0, device="cpu", n_layer=3, n_embd=32,
                      n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = sequential_loss(gpt2, {"input_ids": ids})
        masks = gpt2.layers[1].masks
        assert masks.builds == 1 and all(layer.masks is masks for layer in gpt2.layers[1:4])
        run_layers(gpt2.layers[1:3], gpt2.layers[0](ids[:1]), {})  # another micro-batch size: a new mask
        assert masks.builds == 2
    assert torch.allclose(loss, gpt2.reference()(input_ids=ids, labels=ids).loss, atol=1e-6)

    bert = build_bert("bert-tiny", 16, attn_implementation=attn, init_seed=0, device="cpu", num_hidden_layers=2,
                      hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                      vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    masks = bert.layers[1].masks
    for n, padded in enumerate((8, 12), start=1):
        attention = torch.ones(2, 16, dtype=torch.long)
        attention[1, padded:] = 0
        batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": attention}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run_layers(bert.layers[:-1], ids, batch)
        assert masks.builds == n


@pytest.mark.slow
def test_a_new_attention_implementation_gets_its_own_mask() -> None:
    """The shared mask follows ``set_attn_implementation``: after an sdpa forward (no mask needed), an eager
    forward of the same shapes builds the causal mask again and equals a model built eager."""
    import torch

    from pipeline_recipes.models.gpt2 import build_gpt2
    from pipeline_recipes.core.pipeline_model import sequential_loss

    sizes = dict(init_seed=0, device="cpu", n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    switched = build_gpt2("gpt2-tiny", 16, attn_implementation="sdpa", **sizes)
    eager = build_gpt2("gpt2-tiny", 16, attn_implementation="eager", **sizes)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    sequential_loss(switched, {"input_ids": ids})
    switched.set_attn_implementation("eager")
    assert torch.allclose(sequential_loss(switched, {"input_ids": ids}), sequential_loss(eager, {"input_ids": ids}),
                          atol=1e-6)
    assert switched.layers[1].masks.builds == 2
