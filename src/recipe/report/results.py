"""One training job's results (``results.json``): writing, reading, finding and tabulating them.

Every job (one Hydra job; a multirun sweep puts them in ``<sweep_dir>/<job_num>/``) writes a
``results.json`` in its output directory with exactly the keys in :data:`RESULT_KEYS`:

- ``status`` and ``reason`` (empty when ok): ``ok`` (trained to the end), ``stopped`` (a signal stopped every
  rank at a step boundary: the reason names the signal, the rank and the step), ``diverged`` (the training loss
  stayed NaN/inf), ``running`` (written by rank 0 while training, replaced when the job ends; left as it is
  only when rank 0 was killed under an external launcher), ``skipped`` (refused before launch: the reason is the refusal), ``failed`` (a rank raised,
  died or hung, or a write failed: the reason names the rank that failed first and how);
- the layout: ``strategy``, ``W``, ``D``, ``B``, ``N``, ``global_batch_size``, ``world_size``;
- medians after warm-up: ``samples_per_s``, ``tokens_per_s``, ``iteration_s``;
- ``bubble_ratio_measured`` and ``bubble_ratio_theory``: both 1 − Σ busy / (ranks × the longest rank's
  span of the step), measured from the recorded action times (waiting on messages and host-side stalls
  count as idle), and for the executed schedule simulated at those measured action times with no
  communication (:mod:`pipeline_recipes.recipe.worker.metrics`); the table says so under its rows (:data:`BUBBLE_NOTE`);
- ``tflops_per_device`` (model FLOPs achieved per device, median) and ``mfu`` (that over the device's
  peak; null where the peak is unknown, e.g. on CPUs);
- ``peak_memory_bytes``, ``parameter_bytes`` (the parameters a rank holds) and ``optimizer_state_bytes`` (its
  optimizer's state tensors), one int per rank each; ``loss_history`` (loss per optimizer step), ``final_loss``,
  ``lr_history`` (the learning rate of each optimizer step);
- ``global_step`` (optimizer steps done, a resumed run's included) and ``last_checkpoint`` (the newest
  checkpoint this job wrote, or null): where a stopped or failed job resumes from;
- ``checkpoint_saves``: each checkpoint a pipeline job saved, ``{"step", "blocking_s", "write_s", "bytes"}``: the
  seconds training was held (waiting for the previous save, staging the copy, and writing unless
  ``checkpoint.async_save``), the seconds until its files were complete, and its size on disk (null while a save
  was still being written when the job ended).

Every job that ran keeps the losses it reached, however it ended; skipped and failed jobs may leave the
measured values null. ``scripts/compare.py`` puts many
jobs side by side with :func:`find_results` and :func:`summary_table`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

RESULTS_FILE = "results.json"
STATUSES = ("ok", "running", "stopped", "diverged", "skipped", "failed")

RESULT_KEYS: tuple[str, ...] = (
    "status",
    "reason",
    "strategy",
    "W",
    "D",
    "B",
    "N",
    "global_batch_size",
    "world_size",
    "samples_per_s",
    "tokens_per_s",
    "iteration_s",
    "bubble_ratio_measured",
    "bubble_ratio_theory",
    "tflops_per_device",
    "mfu",
    "peak_memory_bytes",
    "parameter_bytes",
    "optimizer_state_bytes",
    "loss_history",
    "final_loss",
    "lr_history",
    "global_step",
    "last_checkpoint",
    "checkpoint_saves",
)

_LIST_KEYS = ("peak_memory_bytes", "parameter_bytes", "optimizer_state_bytes", "loss_history", "lr_history",
              "checkpoint_saves")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class RunResult:
    """The contents of one ``results.json`` and the ``path`` it was read from (``None`` if not read)."""

    status: str | None = None
    reason: str = ""
    strategy: str | None = None
    W: int | None = None
    D: int | None = None
    B: int | None = None
    N: int | None = None
    global_batch_size: int | None = None
    world_size: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    iteration_s: float | None = None
    bubble_ratio_measured: float | None = None
    bubble_ratio_theory: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    peak_memory_bytes: tuple[int, ...] = ()
    parameter_bytes: tuple[int, ...] = ()
    optimizer_state_bytes: tuple[int, ...] = ()
    loss_history: tuple[float, ...] = ()
    final_loss: float | None = None
    lr_history: tuple[float, ...] = ()
    global_step: int | None = None
    last_checkpoint: str | None = None
    checkpoint_saves: tuple[dict[str, Any], ...] = ()
    path: Path | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak_memory_mib(self) -> float | None:
        """Largest peak over the ranks, in MiB (``None`` when nothing was recorded)."""
        return max(self.peak_memory_bytes) / _MIB if self.peak_memory_bytes else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the result keys in order, lists as lists, then ``path`` as a string."""
        data = asdict(self)
        out = {key: list(data[key]) if key in _LIST_KEYS else data[key] for key in RESULT_KEYS}
        out["path"] = None if self.path is None else str(self.path)
        return out


def _results_path(path_or_dir: str | os.PathLike[str]) -> Path:
    """A directory (existing, or any path not ending in ``.json``) means ``<dir>/results.json``."""
    path = Path(path_or_dir)
    return path / RESULTS_FILE if path.is_dir() or path.suffix != ".json" else path


def _plain(value: Any) -> Any:
    """JSON-ready: tensors and numpy scalars via ``.item()``/``.tolist()``, tuples as lists,
    NaN and infinities as null (strict JSON has no spelling for them)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    elif hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_results(path_or_dir: str | os.PathLike[str], **values: Any) -> Path:
    """Write ``results.json`` (into ``path_or_dir`` if it is a directory) with every key of
    :data:`RESULT_KEYS`: missing ones become null, ``reason`` "" and the lists []; NaN/inf become null.
    Unknown keys and a status outside :data:`STATUSES` raise ValueError. The write is atomic (a
    temporary file, then a rename); returns the file path."""
    unknown = sorted(set(values) - set(RESULT_KEYS))
    if unknown:
        raise ValueError(f"unknown results key(s) {unknown}; allowed keys: {', '.join(RESULT_KEYS)}")
    status = values.get("status")
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    defaults = {field.name: field.default for field in fields(RunResult)}
    record = {key: _plain(values.get(key, defaults[key])) for key in RESULT_KEYS}
    for key in _LIST_KEYS:
        record[key] = list(record[key] or [])
    record["reason"] = record["reason"] or ""

    path = _results_path(path_or_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def update_results(path_or_dir: str | os.PathLike[str], **values: Any) -> Path:
    """Write ``results.json`` with ``values`` over what it holds already (the histories a rank wrote before
    the launcher learnt why the job ended), or a new one."""
    path = _results_path(path_or_dir)
    try:
        held = read_results(path).to_dict()
    except (OSError, ValueError):
        held = {}
    held.pop("path", None)
    return write_results(path, **{**held, **values})


def read_results(path: str | os.PathLike[str]) -> RunResult:
    """Read one ``results.json`` (or the one inside a directory). Missing keys take their defaults,
    keys this version does not know are ignored; unreadable JSON raises ValueError naming the file."""
    path = _results_path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    known = {key: data[key] for key in RESULT_KEYS if key in data}
    for key in _LIST_KEYS:
        known[key] = tuple(known.get(key) or ())
    known["reason"] = known.get("reason") or ""
    return RunResult(**known, path=path)


def _natural_key(path: Path) -> list[Any]:
    """Sort ``2/`` before ``10/`` (multirun job numbers), otherwise alphabetically."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", path.as_posix())]


def find_results(paths: Iterable[str | os.PathLike[str]]) -> list[RunResult]:
    """Every ``results.json`` under ``paths`` (multirun directories, job directories or the files
    themselves), searched recursively, in path order (job numbers compared as numbers), each file once.
    A path that does not exist raises FileNotFoundError."""
    found: dict[Path, None] = {}
    for entry in paths:
        entry = Path(entry)
        if not entry.exists():
            raise FileNotFoundError(f"{entry}: no such file or directory")
        files = [entry] if entry.is_file() else [p for p in entry.rglob(RESULTS_FILE) if p.is_file()]
        for file in sorted(files, key=_natural_key):
            found.setdefault(file.resolve(), None)
    return [read_results(file) for file in found]


def sort_results(results: Iterable[RunResult]) -> list[RunResult]:
    """Ok runs by samples/s, fastest first (unmeasured ones last), then stopped, diverged, skipped and failed runs
    (:data:`STATUSES` order).
    The sort is stable: ties keep their input order."""

    def key(result: RunResult) -> tuple[int, float]:
        rank = STATUSES.index(result.status) if result.status in STATUSES else len(STATUSES)
        speed = result.samples_per_s
        return rank, -speed if isinstance(speed, (int, float)) and math.isfinite(speed) else math.inf

    return sorted(results, key=key)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _bubble(result: RunResult) -> str:
    measured, theory = result.bubble_ratio_measured, result.bubble_ratio_theory
    if measured is None and theory is None:
        return "-"
    return f"{_fmt(measured, '.1%')}/{_fmt(theory, '.1%')}"


COLUMNS = (
    "strategy", "W", "D", "B", "N", "samples/s", "tokens/s", "iter s",
    "bubble meas/theory", "peak mem MiB", "final loss", "status",
)


def table_row(result: RunResult) -> list[str]:
    """One result as the cells of :data:`COLUMNS`; a skipped or failed run shows its reason."""
    status = result.status or "?"
    if not result.ok and result.reason:
        status = f"{status}: {result.reason}"
    return [
        result.strategy or "?",
        *(_fmt(getattr(result, key), "") for key in ("W", "D", "B", "N")),
        _fmt(result.samples_per_s, ".2f"),
        _fmt(result.tokens_per_s, ".1f"),
        _fmt(result.iteration_s, ".4f"),
        _bubble(result),
        _fmt(result.peak_memory_mib, ".1f"),
        _fmt(result.final_loss, ".4f"),
        status,
    ]


BUBBLE_NOTE = ("bubble meas/theory: idle share of the step, 1 - busy/(ranks x step span); meas: the recorded "
               "action times (message waits and host-side stalls count as idle); theory: the executed schedule "
               "simulated at the measured action times with zero communication")


def summary_table(results: Iterable[RunResult], note: bool = True) -> str:
    """A plain-text table, one line per run in :func:`sort_results` order, columns :data:`COLUMNS`
    (text left-aligned, numbers right-aligned; "-" where a value is missing), and with ``note`` the
    bubble column's definition (:data:`BUBBLE_NOTE`) on the line under it."""
    rows = [list(COLUMNS)] + [table_row(result) for result in sort_results(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    left = {0, len(COLUMNS) - 1}

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return "\n".join([line(rows[0]), line(["-" * w for w in widths]), *map(line, rows[1:]),
                      *([BUBBLE_NOTE] if note else [])])
