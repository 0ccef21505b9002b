"""Bad values stop ``train.py`` before any rank starts: exit status 2 within seconds, one ``error:`` line that
names the setting, no traceback, no ``logs/`` (no worker was launched).

* A number of the wrong type or out of its range (``trainer.max_steps=-5``, ``checkpoint.every_n_steps=abc``
  or ``-3``): the schema of :mod:`pipeline_recipes.recipe.check.settings`, checked first by the launcher's checks
  (every such value in-process: ``tests/recipe/test_settings_checks.py``).
* A job directory that cannot be created or written (``hydra.run.dir`` on a read-only file system, or under
  a file): Hydra's first write there fails, and :func:`~pipeline_recipes.recipe.check.command_line.run_app` says
  why with a directory that can be written. As root
  permission bits do not stop a write, so the read-only directory is a read-only tmpfs (or bind) mount there,
  a ``chmod 0555`` directory otherwise.

Only the tests that run ``train.py`` are ``slow`` (a few seconds each).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline_recipes.core import signals
from pipeline_recipes.recipe.check.command_line import unwritable_reason

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
REFUSED_WITHIN_S = 60.0  # a refusal takes a few seconds (Hydra's composition, twice); a launched rank, 20 s or more
COMMON = ("trainer=cpu", "logger=none")


def _train(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=ENV, capture_output=True,
                            text=True, timeout=300)
    return result, time.monotonic() - started


def _writable(path: Path) -> bool:
    try:
        (path / ".probe").write_text("x")
        (path / ".probe").unlink()
    except OSError:
        return False
    return True


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing can be written to: a read-only tmpfs or bind mount as root, else mode 0555."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            if _writable(path):
                pytest.skip("a chmod 0555 directory is still writable here")
            yield path
        finally:
            path.chmod(0o755)
        return
    attempts = ([["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]],
                [["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,ro,bind", str(path)]])
    for steps in attempts:
        done = 0
        for step in steps:
            if subprocess.run(step, capture_output=True).returncode != 0:
                break
            done += 1
        if done == len(steps) and not _writable(path):
            break
        if done:
            subprocess.run(["umount", str(path)], capture_output=True)
    else:
        pytest.skip("running as root, where permission bits do not stop writes, and neither a read-only tmpfs nor a "
                    "read-only bind mount could be made here (mount needs CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, check=True)


# -- bad values of the settings --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("override, key, shown", [
    ("trainer.max_steps=-5", "trainer.max_steps", "-5"),
    ("checkpoint.every_n_steps=abc", "checkpoint.every_n_steps", "'abc'"),
    ("checkpoint.every_n_steps=-3", "checkpoint.every_n_steps", "-3"),
])
def test_a_bad_number_stops_train_py_before_launch(tmp_path: Path, override: str, key: str, shown: str) -> None:
    job = tmp_path / "job"
    result, seconds = _train(tmp_path, *COMMON, override, f"hydra.run.dir={job}")
    print(f"{override}: exit {result.returncode} in {seconds:.1f} s")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert seconds < REFUSED_WITHIN_S
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {key} = {shown}: "), result.stderr
    assert "; set " in last and result.stderr.count("error:") == 1
    assert not (job / "logs").exists()  # no worker was started
    assert not (job / "job.yaml").exists()


# -- the job directory -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_read_only_job_directory_stops_train_py_with_one_line(tmp_path: Path, read_only_dir: Path) -> None:
    job = read_only_dir / "job"
    result, seconds = _train(tmp_path, *COMMON, f"hydra.run.dir={job}")
    print(f"read-only hydra.run.dir: exit {result.returncode} in {seconds:.1f} s")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert seconds < REFUSED_WITHIN_S
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: hydra.run.dir = {job}: "), result.stderr
    assert str(read_only_dir) in lines[0] and "; set hydra.run.dir=" in lines[0]
    fix = lines[0].split("; set hydra.run.dir=")[1].split(" ")[0]
    assert unwritable_reason(fix) is None  # the directory proposed can be written


def _refusal(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int | None, str]:
    """``python train.py argv`` in-process, up to Hydra's first write of the job directory: the exit status
    with which :func:`~pipeline_recipes.recipe.check.command_line.run_app` refuses it, and stderr."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # run_app sets it: restored after the test
    # train.py's first line records stop signals (install_early): its record and the handlers are this test's only
    monkeypatch.setattr(signals, "_EARLY", [])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as stop:
        return stop.code, err.getvalue()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    raise AssertionError(f"train.py {' '.join(argv)} ran: {err.getvalue()}")


def test_an_unwritable_job_directory_is_refused_in_one_line(tmp_path: Path, read_only_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra.run.dir, and hydra.sweep.dir with -m; under a read-only directory or under a file. Each fix
    proposed is a directory that can be written."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [([f"hydra.run.dir={read_only_dir}/job"], "hydra.run.dir", f"{read_only_dir}/job"),
             (["-m", f"hydra.sweep.dir={read_only_dir}/sweep", "trainer.max_steps=1,2"], "hydra.sweep.dir",
              f"{read_only_dir}/sweep"),
             ([f"hydra.run.dir={a_file}/job"], "hydra.run.dir", f"{a_file}/job")]
    for argv, key, path in cases:
        code, err = _refusal([*argv, *COMMON], monkeypatch)  # -m before the overrides, as Hydra parses them
        assert code == 2, (argv, err)
        assert err.startswith(f"error: {key} = {path}: the job directory cannot be created or written: "), err
        assert err.count("\n") == 1
        fix = err.split(f"; set {key}=")[1].split(" ")[0]
        assert unwritable_reason(fix) is None
    assert "is not a directory" in err
    assert unwritable_reason(read_only_dir) is not None
    assert unwritable_reason(read_only_dir / "a" / "b") is not None
    assert list(read_only_dir.iterdir()) == []  # the probe left nothing


def test_a_writable_job_directory_passes(tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "new" / "job"):
        assert unwritable_reason(path) is None
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # nothing created, no probe left
