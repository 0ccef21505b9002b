#!/usr/bin/env python
"""Export a trained model as a ``transformers`` directory (``save_pretrained``).

    python scripts/export_hf.py outputs/run/checkpoints/step-000100.ckpt exported/ [--tokenizer NAME_OR_PATH]
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('exported')"
    python -c "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('exported')"

CKPT is a sharded checkpoint directory (merged in memory), a consolidated file
(``scripts/consolidate_ckpt.py``) or a Lightning checkpoint of the unsplit model. The model is
rebuilt from the ``model_config`` the checkpoint carries (the job's ``model`` config), its weights
are loaded, and its unsplit ``transformers`` model (``reference()``: ``GPT2LMHeadModel``,
``BertForPreTraining``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) is saved with its config.
Tied word embeddings stay tied (saved once);
BERT's deduplicated output bias (:func:`pipeline_recipes.models.bert.dedupe_decoder_bias`) is written under both of
HF's names, so ``from_pretrained`` gives the trained bias whether or not the config ties them.

The tokenizer the run trained with is saved beside the model (``AutoTokenizer.from_pretrained(out)``):
checkpoints of text data carry its files (``data.tokenizer`` or the offline BPE); ``--tokenizer NAME_OR_PATH``
saves another one instead. Synthetic data has no tokenizer. Errors exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline_recipes.datamodules.tokenizer import TOKENIZER_FILES_KEY, write_tokenizer_files
from pipeline_recipes.strategies.checkpoint import MODEL_CONFIG_KEY, CheckpointError, model_state, read_checkpoint
from pipeline_recipes.strategies.legacy import upgrade_targets

DATAMODULE_KEY = "PipelineDataModule"  # Lightning keeps the datamodule's state_dict under its class name


def build_model(model_config: dict[str, Any]) -> nn.Module:
    """The model of ``model_config`` (its own init: the checkpoint's weights are loaded over it, so a
    ``pretrained`` starting point is not read again)."""
    from hydra.utils import instantiate

    config = {k: v for k, v in upgrade_targets(dict(model_config)).items() if k != "device"}  # older names too
    if config.get("pretrained"):
        config["pretrained"] = None
    return instantiate(config)


def load_trained(ckpt: str | Path) -> nn.Module:
    """The pipeline model of ``ckpt`` (an ``HFPipelineModel``) with its trained weights, on the CPU."""
    return _load_trained(read_checkpoint(ckpt), ckpt)


def checkpoint_tokenizer(trainer_state: dict[str, Any]) -> dict[str, bytes]:
    """The tokenizer files a checkpoint carries (``{}`` when the run had none: synthetic data)."""
    return dict((trainer_state.get(DATAMODULE_KEY) or {}).get(TOKENIZER_FILES_KEY) or {})


def save_tokenizer(trainer_state: dict[str, Any], out: Path, tokenizer: str | None = None) -> list[str]:
    """Save ``tokenizer`` (an ``AutoTokenizer`` name or path) or the checkpoint's own into ``out``."""
    if tokenizer:
        from transformers import AutoTokenizer

        saved = AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
        return sorted(Path(p).name for p in saved)
    return write_tokenizer_files(checkpoint_tokenizer(trainer_state), out)


def _load_trained(full: Any, ckpt: str | Path) -> nn.Module:
    config = full.trainer_state.get(MODEL_CONFIG_KEY)
    if not config:
        raise CheckpointError(f"{ckpt} carries no {MODEL_CONFIG_KEY!r} (how to rebuild the model): it was not "
                              "written by train.py; build the model yourself and load "
                              "pipeline_recipes.strategies.checkpoint.model_state(ckpt) into it")
    model = build_model(dict(config))
    state = model_state(full)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{ckpt} does not fit its model config: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    return model.eval()


def _untie_bert_bias(hf: nn.Module) -> None:
    """Give ``cls.predictions.bias`` its own copy of the decoder bias (HF's untied BERT reads the decoder's)."""
    pred = getattr(getattr(hf, "cls", None), "predictions", None)
    if pred is not None and getattr(pred, "bias", None) is not None and pred.bias is pred.decoder.bias:
        pred.bias = nn.Parameter(pred.decoder.bias.detach().clone())


def export(ckpt: str | Path, out_dir: str | Path, tokenizer: str | None = None) -> Path:
    full = read_checkpoint(ckpt)
    model = _load_trained(full, ckpt)
    hf = model.reference()
    _untie_bert_bias(hf)  # the exported copy only: the pipeline model is thrown away
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    save_tokenizer(full.trainer_state, out, tokenizer)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="sharded checkpoint directory, consolidated file or Lightning checkpoint")
    parser.add_argument("out_dir", help="where to write the transformers model (config.json + weights)")
    parser.add_argument("--tokenizer", default=None, help="AutoTokenizer name or path to save instead of the "
                        "checkpoint's own tokenizer")
    args = parser.parse_args(argv)
    try:
        out = export(args.ckpt, args.out_dir, args.tokenizer)
    except (CheckpointError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.ckpt} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
