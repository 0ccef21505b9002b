"""How a job's processes exit, so that a scheduler (SLURM, a shell, a CI) never reads a stop as success.

======  =====================================================================================
status  meaning
======  =====================================================================================
0       trained to the end (``status: ok``)
1       failed: a rank raised, died or hung, or a write failed (``status: failed``)
2       refused before launch: a setting, the data or a checkpoint cannot work (nothing ran)
3       diverged: the training loss stayed NaN/inf (``status: diverged``)
128+n   stopped by signal n at a step boundary (``status: stopped``): 143 SIGTERM (SLURM's notice,
        ``kill``, ``timeout``), 130 SIGINT (Ctrl-C), 138 SIGUSR1 (SLURM's ``--signal=USR1@<s>``)
======  =====================================================================================
"""

from __future__ import annotations

import signal

OK = 0
FAILED = 1
REFUSED = 2
DIVERGED = 3
SIGNAL_BASE = 128


def stopped(signum: int) -> int:
    """The exit status after a clean stop on signal ``signum``: 128 + its number, as a shell reports a
    process that the signal ended."""
    return SIGNAL_BASE + int(signum)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 64`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_returncode(code: int) -> str:
    """How a child process ended, from its return code (negative: killed by that signal), as a predicate:
    ``was killed by SIGKILL (signal 9: ...)``, ``ended with exit status 3``."""
    if code < 0:
        signum = -code
        how = f"was killed by {signal_name(signum)} (signal {signum}"
        if signum == signal.SIGKILL:
            how += ": kill -9, the out-of-memory killer, or a scheduler"
        return how + ")"
    if code > SIGNAL_BASE and code - SIGNAL_BASE < signal.NSIG:
        return f"ended with exit status {code} (stopped on {signal_name(code - SIGNAL_BASE)})"
    return f"ended with exit status {code}"
