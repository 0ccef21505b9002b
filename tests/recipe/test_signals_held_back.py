"""Stop signals are never lost to a process that is still starting (``core/signals.py``): a child started while
they are held back takes them once its handler is in place, and ``train.py``'s early record hands its signal on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pipeline_recipes.core import signals
from pipeline_recipes.core.signals import SignalRecord, early_signal, held_back, install_early

CHILD = """
import time
time.sleep(0.5)  # still starting: no handler yet
from pipeline_recipes.core.signals import SignalRecord
record = SignalRecord()
record.install()
print(record.signum, flush=True)
"""


def test_a_signal_to_a_child_that_is_still_starting_waits_for_its_handler() -> None:
    with held_back():
        child = subprocess.Popen([sys.executable, "-c", CHILD], text=True, stdout=subprocess.PIPE)
    child.send_signal(signal.SIGTERM)  # at once: the child has not even started Python's imports
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == str(int(signal.SIGTERM))


def test_without_holding_back_the_same_signal_kills_the_child() -> None:  # the control: the test above is not vacuous
    child = subprocess.Popen([sys.executable, "-c", CHILD], text=True, stdout=subprocess.PIPE)
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM


def test_the_early_record_hands_its_signal_to_the_launchers_record_once(monkeypatch: pytest.MonkeyPatch) -> None:
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    monkeypatch.setattr(signals, "_EARLY", [])  # a record left by another test in this process would be kept
    try:
        install_early()
        os.kill(os.getpid(), signal.SIGUSR1)  # handled before kill returns (the main thread signals itself)
        record = SignalRecord()
        record.install()
        assert early_signal() == signal.SIGUSR1 and early_signal() is None
        assert record.signum is None  # the launcher's record does not chain the early one's handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert record.signum == signal.SIGTERM and early_signal() is None
        record.restore()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
