"""A schedule added to the registry reaches every test grid with no edit to a test file.

A throwaway 1F1B variant (DAPPLE's generator under another name), an asynchronous one (PipeDream-2BW's)
and one with Chimera's choices (§3.5's concatenation, §3.6's pipeline counts) are registered through
:func:`register` for one test each, then removed. The grids of the NCCL replay, the runtime equivalence
tests, the viewer and the planner tests (tests/support/schedule_grids.py) must list them, the planner's own
search space and the viewer's command line must accept them, and the copy must run as its original.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pipeline_recipes.planner.predict import candidates
from pipeline_recipes.strategies.schedules import build_schedule, get_spec
from pipeline_recipes.strategies.schedules.registry import SCHEDULES, ScheduleSpec, register
import schedule_grids as grids


def _copy(original: str, name: str) -> ScheduleSpec:
    return replace(get_spec(original), name=name, aliases=(), description=f"a copy of {original} (test only)")


@pytest.fixture
def added(request: pytest.FixtureRequest) -> Iterator[ScheduleSpec]:
    """``request.param`` = (original, copy's name): the copy registered for the test, removed after it."""
    saved = dict(SCHEDULES)
    spec = register(_copy(*request.param))
    try:
        yield spec
    finally:
        SCHEDULES.clear()
        SCHEDULES.update(saved)


@pytest.mark.parametrize("added", [("dapple", "dapple_copy")], indirect=True)
def test_a_new_synchronous_schedule_reaches_every_grid(added: ScheduleSpec) -> None:
    name = added.name
    assert {(D, N) for n, D, N, options in grids.replay_cases() if n == name} == {
        (D, N) for D in (2, 3, 4, 8) for N in (max(D // 2, 1), D, 2 * D + 1)}  # 1F1B takes any N ≥ 1
    assert name in {c["schedule"] for c in grids.replica_cases()}
    for world, D, ns in ((2, 2, (2,)), (4, 4, (3, 9)), (4, 2, (2,))):
        assert [c["N"] for c in grids.equivalence_cases(world, D, ns) if c["schedule"] == name] == list(ns)
    assert [c for c in grids.viewer_cases() if c[0] == name] == [(name, 3, 3, {})]
    assert name in grids.default_planner_schedules()
    assert name not in {s.name for s in grids.asynchronous()}
    assert name in {c.strategy for c in candidates(4, 16, 6)}  # the planner itself follows the registry


@pytest.mark.parametrize("added", [("pipedream_2bw", "two_versions_copy")], indirect=True)
def test_a_new_asynchronous_schedule_reaches_every_grid(added: ScheduleSpec) -> None:
    name = added.name
    assert [(D, N) for n, D, N in grids.async_replay_cases() if n == name] == [(2, 2), (2, 3), (4, 4), (4, 5)]
    assert [(c["D"], c["N"]) for c in grids.async_equivalence_cases() if c["schedule"] == name] == [(4, 4), (2, 3)]
    assert name not in {c[0] for c in grids.replay_cases()}
    assert name not in grids.default_planner_schedules()  # not SGD: the planner compares it only when asked
    assert {c.strategy for c in candidates(4, 16, 6, schedules=(name,))} == {name}
    assert [c for c in grids.viewer_cases() if c[0] == name] == [(name, 3, 3, {})]


@pytest.mark.parametrize("added", [("chimera", "bidirectional_copy")], indirect=True)
def test_a_new_schedule_with_choices_is_swept_over_them(added: ScheduleSpec) -> None:
    """Chimera's rules under another name: even D only, 2f pipelines for f dividing D/2, every
    concatenation method."""
    name = added.name
    cases = [(D, N, tuple(sorted(o.items()))) for n, D, N, o in grids.replay_cases() if n == name]
    assert {D for D, _, _ in cases} == {2, 4, 8}
    for D, pipelines in ((2, {2}), (4, {2, 4}), (8, {2, 4})):
        for p in pipelines:
            for concat in grids.CONCATS:
                assert {N for d, N, o in cases if d == D and o == (("concat", concat), ("pipelines", p))} == {
                    max(D // 2, 1), D, 2 * D + 1}
    assert len(cases) == 3 * 3 * (1 + 2 + 2)


@pytest.mark.parametrize("added", [("dapple", "dapple_copy")], indirect=True)
def test_the_copy_runs_as_its_original(added: ScheduleSpec, capsys: pytest.CaptureFixture[str]) -> None:
    """What the grids feed: the registry builds the copy, the viewer draws it, the runtime's NCCL replay
    completes it (in one process, torch's fake backend)."""
    from cross_imports import import_test_module
    from test_schedule_viewer import run_main

    from pipeline_recipes.strategies.harness.nccl_replay import replay

    assert build_schedule(added.name, 3, 5).workers == build_schedule("dapple", 3, 5).workers
    code, out, _ = run_main([added.name, "--stages", "3", "--micro-batches", "5", "--json"], capsys)
    expected = json.loads(json.dumps(build_schedule("dapple", 3, 5).to_json()))
    assert code == 0 and json.loads(out)["workers"] == expected["workers"]
    replay(import_test_module("test_nccl_replay")._programs(added.name, 2, 3))
