"""Run a function on N local processes (gloo on CPU, or NCCL with one GPU per rank) and collect each rank's return value.

For benchmarks and scripts (``scripts/bench.py``): ``run_world(4, fn, *args)`` spawns 4 ranks
(``torch.multiprocessing``, spawn context), each with one intra-op thread by default, runs
``fn(rank, world_size, *args)`` inside an initialised gloo process group and returns the results
by rank. The group ends with a barrier and ``destroy_process_group`` (gloo aborts some plain
exits otherwise). ``fn`` must be importable by the children (a module-level function).
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S


class WorldError(RuntimeError):
    """A rank raised, or the world did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, threads: int, backend: str, fn: Callable, args: tuple, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), device_id=device_id)
    except BaseException:  # before fn ran: run_world may start the world again on another port
        queue.put((rank, "init", traceback.format_exc()))
        raise
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report, then let the others time out
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def run_world(
    world_size: int, fn: Callable, *args: Any, timeout: float = 600, threads: int = 1, backend: str = "gloo"
) -> list[Any]:
    """Spawn ``world_size`` ranks running ``fn(rank, world_size, *args)``; return results by rank."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    for attempt in range(PORT_ATTEMPTS):
        results, errors = _run_once(world_size, fn, args, timeout, threads, backend)
        # free_port() only finds a port that was free: another process (a parallel test worker) may take it
        # before rank 0 listens; nothing ran yet then, so the world starts again on another port
        if not _port_taken(errors) or attempt == PORT_ATTEMPTS - 1:
            break
    if errors:
        raise WorldError("\n".join(errors))
    return [results[r] for r in range(world_size)]


PORT_ATTEMPTS = 3
PORT_TAKEN = "EADDRINUSE"  # in the rendezvous error of a rank whose port another process took


def _port_taken(errors: list[str]) -> bool:
    return any(PORT_TAKEN in e for e in errors)


def _run_once(world_size: int, fn: Callable, args: tuple, timeout: float, threads: int,
              backend: str) -> tuple[dict[int, Any], list[str]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, threads, backend, fn, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    errors: list[str] = []
    try:
        results, errors = _collect(queue, procs, timeout)
    finally:
        for p in procs:  # after a failure the others are stuck waiting for the failed rank: end them
            p.join(timeout=2 if errors else 30)
            if p.is_alive():
                p.kill()
    return results, errors


def _collect(queue: Any, procs: list, timeout: float) -> tuple[dict[int, Any], list[str]]:
    """Every rank's report (result or traceback), until all reported, one died without reporting
    (no waiting for the timeout then), or ``timeout`` seconds passed."""
    results: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout

    def take(wait: float) -> bool:
        try:
            rank, status, value = queue.get(timeout=wait)
        except queue_module.Empty:
            return False
        reported.add(rank)
        if status == "ok":
            results[rank] = value
        else:  # "error" (fn raised) or "init" (the process group did not start)
            errors.append(f"rank {rank}:\n{value}")
        return True

    while len(reported) < len(procs):
        if take(min(1.0, max(deadline - time.monotonic(), 0.01))):
            if _port_taken(errors):  # the world never started: the others wait in vain
                break
            continue
        dead = {r: p.exitcode for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)}
        if dead:  # its last report may still be in flight: a short grace, then stop
            grace = time.monotonic() + 2.0
            while not reported >= set(dead) and time.monotonic() < grace:
                take(0.2)
            silent = sorted(set(dead) - reported)
            if silent:
                errors.append(f"ranks {silent} exited with codes {[dead[r] for r in silent]} without a result")
            if errors:
                break
        elif time.monotonic() >= deadline:
            errors.append(f"no answer within {timeout:.0f}s from ranks {sorted(set(range(len(procs))) - reported)}")
            break
    return results, errors
