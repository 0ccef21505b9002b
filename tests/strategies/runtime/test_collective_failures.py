"""A peer lost inside a collective is named like a lost p2p peer: which rank, whether its connection closed or it
timed out, after how long; not gloo's message, which names no rank.

Three gloo ranks on CPU; one of them (the victim) dies with ``os._exit`` or sleeps through the collective while the
others wait in the gradient all-reduce (:class:`GradientSynchronizer`) or the metrics all-gather (the collective of
:mod:`pipeline_recipes.recipe.worker.metrics`). Each survivor writes what it raised to a file (the harness of
``tests/support/distributed.py`` stops a world at its first dead rank, before the survivors could say anything). The
expected rank, the timeout and the victim's delay are the test's own settings."""

from __future__ import annotations

import importlib
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from distributed import free_port
from pipeline_recipes.core.transport import (PeerClosedError, PeerTimeoutError, lost_how, peer_lost,
                                             transport_said)

WORLD = 3
TIMEOUT_S = 4.0  # the groups' timeout: a stalled victim is waited for this long
DIES_AFTER_S = 1.0  # a dying victim exits this long after the survivors started waiting
STALL_S = 30.0
# gloo's own words, as it said them on this machine (torch 2.13, 3 ranks on one host)
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:15569: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "4000ms for recv operation to complete")


# -- the rule, without processes ----------------------------------------------------------------


def test_a_closed_connection_and_a_timeout_are_said_with_the_rank_and_the_time() -> None:
    closed = peer_lost([1], 0, "the gradient all-reduce of stage 0", 1.04, 4.0, RuntimeError(GLOO_RESET))
    assert isinstance(closed, PeerClosedError) and closed.consequence
    assert str(closed) == ("the connection to rank 1 closed after 1.0s while rank 0 waited for the gradient "
                           "all-reduce of stage 0: the peer exited, crashed or was killed (Read error "
                           "[127.0.0.1]:15569: Connection reset by peer)")
    late = peer_lost([1, 3], 2, "the metrics all-gather", 4.01, 4.0, RuntimeError(GLOO_TIMEOUT))
    assert isinstance(late, PeerTimeoutError)
    assert str(late).startswith("rank 1 or rank 3 stopped answering: rank 2 waited 4s for the metrics all-gather, "
                                "the limit of 4s (strategy.timeout_s)")
    assert str(late).endswith("(Timed out waiting 4000ms for recv operation to complete)")


@pytest.mark.parametrize("said, waited, how", [
    (GLOO_RESET, 0.5, "closed"),
    (GLOO_RESET, 3.9, "timed out"),  # at the limit: a peer's own timeout closed its connections
    (GLOO_TIMEOUT, 1.0, "timed out"),  # gloo's clock started before this wait
    ("something else", 0.5, "closed"),
])
def test_how_a_peer_was_lost(said: str, waited: float, how: str) -> None:
    assert lost_how(RuntimeError(said), waited, 4.0) == how


def test_the_transport_words_keep_the_cause_only() -> None:
    assert transport_said(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:15569: Connection reset by peer"


# -- three processes -----------------------------------------------------------------------------


def _grad_all_reduce(rank: int) -> None:
    from pipeline_recipes.strategies.runtime.grad_sync import GradientSynchronizer  # imported in _rank already

    group = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=TIMEOUT_S))
    layer = nn.Linear(4, 4)
    sync = GradientSynchronizer({0: list(layer.parameters())}, {0: group}, [], None, timedelta(seconds=TIMEOUT_S))
    sync.zero_grad(list(layer.parameters()))
    layer(torch.ones(2, 4)).sum().backward()
    _victim_acts(rank)
    sync.finish()


def _metrics_all_gather(rank: int) -> None:
    from pipeline_recipes.recipe.worker.metrics import _all_gather_rows  # imported in _rank already

    _victim_acts(rank)
    _all_gather_rows(torch.full((3,), float(rank), dtype=torch.float64))


COLLECTIVES = {"grad": _grad_all_reduce, "metrics": _metrics_all_gather}
MODULES = {"grad": "pipeline_recipes.strategies.runtime.grad_sync", "metrics": "pipeline_recipes.recipe.worker.metrics"}


def _victim_acts(rank: int) -> None:
    how = os.environ["COLLECTIVE_TEST_HOW"]
    if rank != int(os.environ["COLLECTIVE_TEST_VICTIM"]):
        return
    if how == "dies":
        time.sleep(DIES_AFTER_S)
        os._exit(3)  # no report, no traceback: as a killed or crashed process
    time.sleep(STALL_S)
    os._exit(0)


def _rank(rank: int, port: int, collective: str, how: str, victim: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COLLECTIVE_TEST_HOW=how,
                      COLLECTIVE_TEST_VICTIM=str(victim))
    torch.set_num_threads(1)
    importlib.import_module(MODULES[collective])  # before the clock starts (Lightning: seconds per process)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    started = time.monotonic()
    try:
        COLLECTIVES[collective](rank)
        said = "no error"
    except Exception as err:  # noqa: BLE001 - what the rank raised is the result
        said = f"{type(err).__name__}: {err}"
    total = time.monotonic() - started
    Path(out, f"rank{rank}.txt").write_text(f"{total:.3f}\n{said}")
    os._exit(0)  # the group is broken: no teardown (a barrier would wait for the lost rank)


def _run(tmp_path: Path, collective: str, how: str, victim: int) -> dict[int, tuple[float, str]]:
    """Every survivor's (seconds from the collective's start to its error being raised, the error)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, collective, how, victim, str(tmp_path))) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 300  # spawning and importing Lightning take minutes on 2 loaded cores
    try:
        for r, proc in enumerate(procs):
            if r != victim:
                proc.join(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    out = {}
    for r in range(WORLD):
        if r != victim:
            text = (tmp_path / f"rank{r}.txt").read_text()
            total, said = text.split("\n", 1)
            out[r] = (float(total), said)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("collective, victim", [("grad", 1), ("grad", 0), ("metrics", 2)])
def test_a_peer_that_dies_inside_a_collective_is_named_closed_with_the_seconds(
        tmp_path: Path, collective: str, victim: int) -> None:
    """Victim 0 also held the job's store (the default group's): its end is what names it then."""
    what = {"grad": "the gradient all-reduce of stage 0", "metrics": "the metrics all-gather"}[collective]
    for rank, (total, said) in _run(tmp_path, collective, "dies", victim).items():
        found = re.fullmatch(rf"PeerClosedError: the connection to rank {victim} closed after (\d+\.\d)s while "
                             rf"rank {rank} waited for {what}: the peer exited, crashed or was killed \((.*)\)", said)
        assert found, said
        seconds = float(found.group(1))
        assert DIES_AFTER_S - 0.1 <= seconds <= total + 0.05 and seconds < 0.9 * TIMEOUT_S, said  # said to 0.1 s
        assert "gloo/transport" not in said  # gloo's words, without its source location


@pytest.mark.slow
@pytest.mark.parametrize("collective", ["grad", "metrics"])
def test_a_peer_that_stalls_before_a_collective_is_named_timed_out_at_the_limit(
        tmp_path: Path, collective: str) -> None:
    what = {"grad": "the gradient all-reduce of stage 0", "metrics": "the metrics all-gather"}[collective]
    for rank, (total, said) in _run(tmp_path, collective, "stalls", 1).items():
        assert said.startswith(f"PeerTimeoutError: rank 1 stopped answering: rank {rank} waited 4s for {what}, "
                               "the limit of 4s (strategy.timeout_s); the peer hung"), said
        assert TIMEOUT_S <= total < TIMEOUT_S + 10, said
