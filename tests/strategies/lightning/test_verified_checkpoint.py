"""``checkpoint.keep=latest`` never removes the last verified checkpoint before a newer one has verified
(:class:`pipeline_recipes.strategies.lightning.verified_checkpoint.VerifiedCheckpoint`).

A real Lightning ``Trainer`` (one CPU process, Lightning's ``BoringModel``) saves a checkpoint every step, keeping
the latest; the checks of some saves are made to fail (``verify_checkpoint`` replaced in the callback's module), and
the files left in the directory say what was removed.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from pipeline_recipes.strategies import checkpoint as ckpt
from pipeline_recipes.strategies.lightning import verified_checkpoint
from pipeline_recipes.strategies.lightning.verified_checkpoint import VerifiedCheckpoint


def _train(directory: Path, steps: int) -> list[str]:
    """``steps`` training steps saving a checkpoint after each one, keeping the latest; the files left."""
    callback = VerifiedCheckpoint(dirpath=str(directory), filename="step-{step:06d}", auto_insert_metric_name=False,
                                  every_n_train_steps=1, save_top_k=1, save_last=False, enable_version_counter=False)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, callbacks=[callback],
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=str(directory))
    trainer.fit(BoringModel())
    return sorted(p.name for p in directory.iterdir())


def _failing(*names: str) -> object:
    """``verify_checkpoint`` failing for the checkpoints ``names``, and really verifying every other one."""
    def verify(path: str | Path) -> None:
        if Path(path).name in names:
            raise ckpt.CheckpointError(f"{path}: stage0.pt is damaged: its record x fails its CRC-32 check")
        ckpt.verify_checkpoint(path)
    return verify


def test_the_previous_checkpoint_is_removed_once_the_new_one_verifies(tmp_path: Path) -> None:
    assert _train(tmp_path, 3) == ["step-000003.ckpt"]
    assert ckpt.verify_checkpoint(tmp_path / "step-000003.ckpt") is None  # Lightning's own file passes for real


def test_a_new_checkpoint_that_fails_keeps_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verified_checkpoint, "verify_checkpoint", _failing("step-000003.ckpt"))
    with pytest.warns(UserWarning, match=r"keeping .*step-000002\.ckpt until a newer checkpoint verifies: "
                                         r".*step-000003\.ckpt: stage0\.pt is damaged"):
        left = _train(tmp_path, 3)
    assert left == ["step-000002.ckpt", "step-000003.ckpt"]


def test_checkpoints_kept_go_once_a_newer_one_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verified_checkpoint, "verify_checkpoint", _failing("step-000002.ckpt", "step-000003.ckpt"))
    with pytest.warns(UserWarning, match="keeping"):
        left = _train(tmp_path, 4)
    assert left == ["step-000004.ckpt"]  # step 1 kept while 2 and 3 failed, then removed with 3 after 4 verified
