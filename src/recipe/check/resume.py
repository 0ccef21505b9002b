"""``ckpt_path``, resolved and checked by the launcher before any process starts.

* ``ckpt_path=auto`` resumes from the newest checkpoint of the job directory that verifies
  (``<job dir>/checkpoints/step-NNNNNN.ckpt``, the highest step; a ``.partial`` save, or one with a missing, cut or
  damaged file, is skipped), or starts fresh when there is none: what a requeued job needs, since it restarts with
  the same ``hydra.run.dir``. The launcher prints which in one line, naming each checkpoint skipped and why, and the
  workers get the concrete path (``job.yaml``).
* A checkpoint given or found must exist, be complete and undamaged
  (:func:`pipeline_recipes.strategies.checkpoint.verify_checkpoint`, through
  :func:`~pipeline_recipes.strategies.checkpoint.inspect_checkpoint`), fit the strategy (``ddp`` and ``single``
  read the consolidated file, not a sharded directory) and hold this run's model
  (:mod:`pipeline_recipes.recipe.check.model_match`, which names the ``model.*`` overrides that make it so).
  Each failure is a :class:`~pipeline_recipes.recipe.check.settings.ConfigError`: one message and exit status 2.

Under an external launcher (torchrun, SLURM) every rank resolves ``auto`` itself and reaches the same answer: the
answer is a function of what the checkpoint directory holds, and nothing writes there before every rank has started
(a checkpoint is saved only after training steps, which need all of them).

This module imports neither torch nor Lightning: the checkpoint is read (torch) only when ``ckpt_path`` is set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from pipeline_recipes.recipe.check.settings import BASELINES, ConfigError
from pipeline_recipes.recipe.check.model_match import model_mismatch

if TYPE_CHECKING:
    from pipeline_recipes.strategies.checkpoint import SavedCheckpoint

CHECKPOINT_DIR = "checkpoints"  # <job dir>/checkpoints: where ModelCheckpoint saves (recipe.job)
AUTO = "auto"
# ModelCheckpoint's "step-{step:06d}" (recipe.job); with a suffix (".partial"): a save that did not finish
STEP_NAME = re.compile(r"step-(\d+)\.ckpt(.*)")


@dataclass(frozen=True)
class Resume:
    """What the workers resume from, and the launcher's line about it (``ckpt_path=auto``)."""

    path: str | None  # absolute; None: start fresh
    note: str | None = None
    step: int | None = None  # the training step the checkpoint was saved at

    def finished(self, max_steps: Any) -> bool:
        """The checkpoint is at (or past) ``trainer.max_steps``: nothing is left to train."""
        return (self.step is not None and isinstance(max_steps, int) and not isinstance(max_steps, bool)
                and 0 < max_steps <= self.step)


def resolve_resume(cfg: DictConfig, out_dir: Path, strategy: str) -> Resume:
    """``cfg.ckpt_path`` resolved (``auto``: in ``out_dir``'s checkpoints) and checked for ``strategy``."""
    value = cfg.get("ckpt_path")
    if not value:
        return Resume(None)
    if str(value) == AUTO:
        saved, note = newest_checkpoint(out_dir / CHECKPOINT_DIR)
        if saved is None:
            return Resume(None, note)
        label = f"ckpt_path=auto ({saved.path})"
    else:
        note, label = None, f"ckpt_path={value}"
        saved = _given(Path(str(value)).expanduser().absolute(), label)
    check_strategy(saved, label, strategy)
    check_model(saved, label, OmegaConf.to_container(cfg.model, resolve=True))
    return Resume(str(saved.path), note, saved.step)


def _inspect(path: Path) -> SavedCheckpoint:
    from pipeline_recipes.strategies.checkpoint import inspect_checkpoint  # local: torch ≥1.2 s, only when resuming

    return inspect_checkpoint(path)


def step_checkpoints(directory: Path) -> list[tuple[int, Path, bool]]:
    """``(step, path, finished)`` of each ``step-N.ckpt*`` entry of ``directory``, highest step first (a
    finished name before an unfinished one of the same step); none when the directory does not exist."""
    if not directory.is_dir():
        return []
    found = [(int(m[1]), path, not m[2]) for path in directory.iterdir() if (m := STEP_NAME.fullmatch(path.name))]
    return sorted(found, key=lambda item: (item[0], item[2], item[1].name), reverse=True)


def newest_checkpoint(directory: Path) -> tuple[SavedCheckpoint | None, str]:
    """The checkpoint of the highest step in ``directory`` that verifies (or None), and one line saying which, or
    that the run starts fresh, naming the newer saves skipped and why."""
    skipped: list[str] = []
    for step, path, finished in step_checkpoints(directory):
        if not finished:
            skipped.append(f"{path.name}: a save that did not finish")
            continue
        try:
            saved = _inspect(path)
        except (ValueError, OSError) as err:  # CheckpointError is a ValueError
            skipped.append(_skip_reason(path, err))
            continue
        return saved, (f"ckpt_path=auto: resuming from {path} (step {step if saved.step is None else saved.step})"
                       + _skipped(skipped))
    return None, f"ckpt_path=auto: no complete checkpoint in {directory}, starting fresh" + _skipped(skipped)


def _skipped(reasons: list[str]) -> str:
    return f"; skipped {'; '.join(reasons)}" if reasons else ""


def _skip_reason(path: Path, err: BaseException) -> str:
    """``<name>: <reason>``: the first line of ``err``, naming the checkpoint ``path`` once, by its name."""
    lines = str(err).strip().splitlines()
    reason = (lines[0] if lines else type(err).__name__).replace(str(path), path.name)
    return reason if reason.startswith(path.name) else f"{path.name}: {reason}"


def _given(path: Path, label: str) -> SavedCheckpoint:
    """The checkpoint at ``path``, complete, or the reason it cannot be resumed and the newest one nearby."""
    if not path.exists():
        raise ConfigError(f"{label}: {path} does not exist{_nearby(path)}")
    try:
        return _inspect(path)
    except (ValueError, OSError) as err:
        text = str(err)  # naming the path once: the label already does
        reason = text[len(str(path)):] if text.startswith(str(path)) else f": {text}"
        raise ConfigError(f"{label}{reason}{_nearby(path)}") from err


def _nearby(path: Path) -> str:
    """Where the newest complete checkpoint next to (or inside) ``path`` is, if there is one."""
    directory = path if path.is_dir() and not STEP_NAME.fullmatch(path.name) else path.parent
    saved, _ = newest_checkpoint(directory)
    return f"; the newest complete checkpoint in {directory} is {saved.path.name}" if saved is not None else ""


def check_strategy(saved: SavedCheckpoint, label: str, strategy: str) -> None:
    """Only the pipeline strategies read sharded directories; ``ddp`` and ``single`` need the consolidated file."""
    if saved.sharded and strategy in BASELINES:
        raise ConfigError(f"{label} is a sharded pipeline checkpoint, which only the pipeline strategies read, not "
                          f"strategy={strategy}; consolidate it first: python scripts/consolidate_ckpt.py "
                          f"{saved.path} full.ckpt, then pass ckpt_path=full.ckpt")


def check_model(saved: SavedCheckpoint, label: str, run_model: dict[str, Any]) -> None:
    """The checkpoint's model config builds this run's parameters (a checkpoint without one, e.g. a Lightning file
    of another module, is left to the workers, which compare the tensors they load)."""
    if saved.model_config is None:
        return
    try:
        mismatch = model_mismatch(saved.model_config, run_model)
    except Exception as err:  # this run's own model config does not build: say so before any process starts
        raise ConfigError(f"the model config cannot be built ({type(err).__name__}: {err})") from err
    if mismatch is not None:
        raise ConfigError(f"{label} {mismatch}")
