#!/usr/bin/env python
"""Merge a sharded pipeline checkpoint into one file of the unsplit model.

    python scripts/consolidate_ckpt.py outputs/run/checkpoints/step-000100.ckpt full.ckpt

The output is an ordinary Lightning checkpoint (``state_dict`` with every parameter name of the
unsplit model, ``optimizer_states`` in torch's positional format for its trainable parameters in
module order, loop/callback/scheduler state) plus a ``pipeline`` section naming each optimizer
position. Resume it with ``train.py ckpt_path=full.ckpt`` under any strategy and layout (pipeline,
``ddp`` or ``single``), or export it with ``scripts/export_hf.py``. A sharded checkpoint also resumes
under another pipeline layout directly; consolidating is for one-file archives, non-pipeline
strategies and exports. It reads both formats: the torch.distributed.checkpoint directories saved today and the
stage files of earlier versions. For DCP's own single file (the unsplit names, no Lightning state) use
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (docs/checkpoints.md). Errors exit with status 2 and
an ``error: ...`` line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline_recipes.strategies.checkpoint import CheckpointError, read_meta, save_consolidated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="consolidate_ckpt.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("shard_dir", help="a sharded checkpoint directory (with meta.json)")
    parser.add_argument("out", help="the consolidated checkpoint file to write")
    args = parser.parse_args(argv)
    try:
        meta = read_meta(args.shard_dir)
        out = save_consolidated(args.shard_dir, args.out)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"consolidated {meta['schedule']} W={meta['W']} D={meta['D']} step {meta['global_step']} "
          f"({len(meta['partition'])} stages) -> {out} ({Path(out).stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
