"""The planner's predictions spread over the machine's cores.

Building, validating and simulating schedules is pure Python, one core's work per layout. Forked
processes inherit the profile and the schedule caches already built, so a search hands each process a
group of layouts (those on one schedule together: each builds it once) and gets back small results.
Where processes cannot fork (not Linux) or the work is small, everything runs in this process.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PARALLEL_ITEMS = 64  # fewer layouts than this take well under a second: no processes


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def workers_for(items: int, workers: int | None = None) -> int:
    """``workers``, or by default one process per available core for ``items`` ≥ ``PARALLEL_ITEMS`` where
    processes fork (Linux), else 1 (run here)."""
    if not sys.platform.startswith("linux"):
        return 1
    if workers is None:
        return available_cores() if items >= PARALLEL_ITEMS else 1
    return max(1, workers)


def planner_pool(workers: int) -> AbstractContextManager[Executor | None]:
    """A pool of ``workers`` forked processes, or ``None`` (run here) for one."""
    if workers <= 1:
        return nullcontext(None)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))


def map_groups(pool: Executor | None, fn: Callable[[Sequence[T]], list[R]],
               groups: Sequence[Sequence[T]]) -> list[list[R]]:
    """``fn`` of every group, in order, on ``pool`` (or here): the largest groups go first, so the
    processes end together."""
    if pool is None:
        return [fn(group) for group in groups]
    order = sorted(range(len(groups)), key=lambda k: len(groups[k]), reverse=True)
    jobs: dict[int, Any] = {k: pool.submit(fn, groups[k]) for k in order}
    return [jobs[k].result() for k in range(len(groups))]


def map_grouped(fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], key: Callable[[T], Hashable],
                workers: int) -> list[R]:
    """``fn`` over ``items`` (one result per item, in the items' order), items of equal ``key`` handed to
    the same process together (``workers`` forked processes, or here for one)."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for k, item in enumerate(items):
        groups[key(item)].append(k)
    indices = list(groups.values())
    with planner_pool(workers) as pool:
        results = map_groups(pool, fn, [[items[k] for k in group] for group in indices])
    out: list[Any] = [None] * len(items)
    for group, values in zip(indices, results):
        for k, value in zip(group, values):
            out[k] = value
    return out
