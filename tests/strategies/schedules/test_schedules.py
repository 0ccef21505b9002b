"""Pure schedule tests: the papers' numbers (Chimera Table 2/3, Figures 2, 3, 7), over size grids."""

from __future__ import annotations

import itertools
import sys

import pytest

from pipeline_recipes.strategies.schedules import (
    CONCAT_METHODS, Action, DeadlockError, Schedule, best_concat, build_schedule, chimera, chimera_placement,
    concat_choices, dapple, gems, gpipe, parse_action, resolve_concat, simulate, validate,
)
from pipeline_recipes.strategies.schedules.messages import fifo_violations

GRID = [(d, n) for d in (1, 2, 3, 4, 5, 6, 8) for n in (1, 2, 3, 4, 5, 7, 8, 12, 16)]
EVEN_GRID = [(d, n) for d, n in GRID if d % 2 == 0]


def chimera_pipelines(d: int) -> list[int]:
    return [2 * f for f in range(1, d // 2 + 1) if (d // 2) % f == 0]


def test_no_torch_distributed_import() -> None:
    import subprocess

    code = "import pipeline_recipes.strategies.schedules, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", "schedules must stay pure Python"


# --- actions -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "action, text",
    [
        (Action("F", 0, 2, (0,)), "2F0"),
        (Action("B", 1, 2, (0,)), "2B0p1"),
        (Action("F", 0, 1, (4, 5)), "1F4+5"),
        (Action("B", 1, 1, (4,), 1), "1B4h1p1"),
    ],
)
def test_action_text_round_trip(action: Action, text: str) -> None:
    assert str(action) == text
    assert parse_action(text) == action


def test_every_generated_action_round_trips() -> None:
    for concat in CONCAT_METHODS:
        s = chimera(8, 16, 4, concat)
        for a in (a for acts in s.workers for a in acts):
            assert parse_action(str(a)) == a
            assert Action.from_json(a.to_json()) == a


@pytest.mark.parametrize("bad", ["", "F0", "2X0", "2F", "2B0h2", "2F0h1"])
def test_parse_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_action(bad)


def test_json_round_trip_keeps_schedule() -> None:
    s = chimera(4, 8, 2, "forward_doubling")
    data = s.to_json()
    assert set(data) == {"schedule", "stages", "micro_batches", "pipelines", "placement", "workers"}
    back = Schedule.from_json(data)
    assert back.workers == s.workers and back.placement == s.placement
    del data["placement"]  # JSON written before the placement was saved: read off the actions
    assert Schedule.from_json(data).placement == s.placement


def test_json_round_trip_keeps_a_pipeline_without_micro_batches() -> None:
    s = chimera(4, 1)  # one micro-batch: the up pipeline runs nothing, its placement is still saved
    assert Schedule.from_json(s.to_json()).placement == s.placement


# --- validity over grids -------------------------------------------------------------------

@pytest.mark.parametrize("d, n", GRID)
def test_gpipe_and_dapple_valid(d: int, n: int) -> None:
    for name in ("gpipe", "dapple"):
        validate(build_schedule(name, d, n))


@pytest.mark.parametrize("d, n", EVEN_GRID)
def test_chimera_valid_for_all_pipeline_counts_and_methods(d: int, n: int) -> None:
    for pipes, concat in itertools.product(chimera_pipelines(d), CONCAT_METHODS):
        s = validate(chimera(d, n, pipes, concat))
        assert s.pipelines == pipes
        assert sum(len(a.mbs) for acts in s.workers for a in acts if a.kind == "F") == n * d


# --- GPipe and DAPPLE (Chimera Table 2) ----------------------------------------------------

@pytest.mark.parametrize("d, n", GRID)
@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0)])
def test_gpipe_dapple_makespan(d: int, n: int, t_f: float, t_b: float) -> None:
    for name in ("gpipe", "dapple"):
        sim = simulate(build_schedule(name, d, n), t_f, t_b)
        assert sim.makespan == pytest.approx((n + d - 1) * (t_f + t_b))
        assert sim.bubble_ratio == pytest.approx((d - 1) / (n + d - 1))


@pytest.mark.parametrize("d, n", GRID)
def test_gpipe_dapple_activations(d: int, n: int) -> None:
    assert simulate(gpipe(d, n)).peak_activations == tuple([float(n)] * d)
    assert simulate(dapple(d, n)).peak_activations == tuple(float(min(d - s, n)) for s in range(d))


# --- GEMS (Chimera §2, Table 2) ------------------------------------------------------------

GEMS_D4_N4 = """\
P0: 0F0 0B0 3F1p1 3B1p1 0F2 0B2 3F3p1 3B3p1
P1: 1F0 1B0 2F1p1 2B1p1 1F2 1B2 2F3p1 2B3p1
P2: 2F0 2B0 1F1p1 1B1p1 2F2 2B2 1F3p1 1B3p1
P3: 3F0 3B0 0F1p1 0B1p1 3F2 3B2 0F3p1 0B3p1"""


def test_gems_golden_d4_n4() -> None:
    s = gems(4, 4)
    assert s.format() == GEMS_D4_N4
    assert s.placement == ((0, 1, 2, 3), (3, 2, 1, 0))  # two replicas in opposite directions


@pytest.mark.parametrize("d, n", EVEN_GRID)
def test_gems_table_2(d: int, n: int) -> None:
    """A micro-batch starts every 2D + 1 units (t_b = 2 t_f): makespan (N - 1)(2D + 1) + 3D, bubble ratio
    → (D - 1)/(D + 1/2); each worker holds two stages (2 Mθ) and one micro-batch of activations (Ma)."""
    s = validate(gems(d, n))
    sim = simulate(s, 1, 2)
    assert sim.makespan == (n - 1) * (2 * d + 1) + 3 * d
    assert sim.bubble_ratio == pytest.approx(1 - 3 * n / sim.makespan)
    assert sim.peak_activations == tuple([1.0] * d)
    assert all(len(s.stages_of(w)) == 2 for w in range(d))
    assert not fifo_violations(s)  # runs on NCCL too
    spans: dict[int, tuple[float, float]] = {}
    for t in (t for row in sim.timeline for t in row):
        lo, hi = spans.get(t.action.mb, (t.start, t.end))
        spans[t.action.mb] = (min(lo, t.start), max(hi, t.end))
    for start, _ in spans.values():  # at most two micro-batches active at any time
        assert sum(lo <= start < hi for lo, hi in spans.values()) <= 2


@pytest.mark.parametrize("d", [2, 4, 8, 16, 64])
@pytest.mark.slow
def test_gems_bubble_ratio_tends_to_table_2(d: int) -> None:
    assert simulate(gems(d, 400), 1, 2).bubble_ratio == pytest.approx((d - 1) / (d + 0.5), abs=2e-3)


# --- Chimera, N = D (Figure 3, Table 2, Table 3) -------------------------------------------

FIGURE_3 = """\
P0: 0F0 0F1 3F2p1 3B2p1 3F3p1 3B3p1 0B0 0B1
P1: 1F0 2F2p1 1F1 2F3p1 2B2p1 1B0 2B3p1 1B1
P2: 1F2p1 2F0 1F3p1 2F1 2B0 1B2p1 2B1 1B3p1
P3: 0F2p1 0F3p1 3F0 3B0 3F1 3B1 0B2p1 0B3p1"""


def test_chimera_figure_3_golden() -> None:
    s = chimera(4, 4)
    assert s.format() == FIGURE_3
    assert s.placement == ((0, 1, 2, 3), (3, 2, 1, 0))
    assert simulate(s, 1, 1).makespan == 10  # 2N + D - 2: D - 2 = 2 bubbles
    assert simulate(s, 1, 2).makespan == 16  # 3N + 2D - 4
    assert simulate(s, 1, 2).makespan / simulate(dapple(4, 4), 1, 2).makespan == pytest.approx(16 / 21)


@pytest.mark.parametrize("d", [2, 4, 6, 8, 10, 12, 16])
def test_chimera_two_pipelines_n_equals_d(d: int) -> None:
    s = chimera(d, d)
    equal, practical = simulate(s, 1, 1), simulate(s, 1, 2)
    assert equal.makespan == 2 * d + d - 2
    assert equal.bubble_ratio == pytest.approx((d - 2) / (2 * d + d - 2))
    assert practical.makespan == 3 * d + 2 * d - 4
    assert practical.bubble_ratio == pytest.approx((d - 2) / (3 * d / 2 + d - 2))
    peaks = equal.peak_activations
    assert min(peaks) == d / 2 + 1 and max(peaks) == d  # Table 2: [(D/2 + 1) Ma, D Ma]


@pytest.mark.parametrize("d", [4, 8, 12, 16])
def test_chimera_2f_pipelines_table_3(d: int) -> None:
    for pipes in chimera_pipelines(d):
        s = chimera(d, d, pipes)
        sim = simulate(s, 1, 1)
        assert sim.bubble_ratio == pytest.approx((d - pipes) / (pipes * d + d - pipes))
        assert min(sim.peak_activations) >= d - d / pipes + 1
        assert max(sim.peak_activations) <= d


def test_chimera_placement_of_figure_8() -> None:
    s = chimera(8, 8, 4)
    assert s.placement[1] == (4, 5, 6, 7, 0, 1, 2, 3)  # down pipeline 1 starts on worker i·D/f = 4
    assert s.placement[3] == tuple(7 - w for w in s.placement[1])  # its up pipeline is the reverse
    for w in range(8):
        assert len(s.stages_of(w)) == 4  # 2f stage copies per worker, all distinct


# --- Chimera, N > D and N < D (§3.5, Figure 7) ---------------------------------------------

def _chimera_pipe_of(d: int, n: int, pipes: int) -> dict[int, int]:
    """Chimera §3.5 deals micro-batches in basic units of D, each split into contiguous shares (§3.1,
    "as evenly as possible": the first shares one longer)."""
    pipe_of: dict[int, int] = {}
    for start in range(0, n, d):
        unit = list(range(start, min(start + d, n)))
        base, extra = divmod(len(unit), pipes)
        first = 0
        for p in range(pipes):
            size = base + (p < extra)
            pipe_of.update(dict.fromkeys(unit[first:first + size], p))
            first += size
    return pipe_of


def _plain_list_makespan(d: int, n: int, pipes: int) -> int | None:
    """The yardstick for direct concatenation, independent of the generator: at integer times (t_f = 1,
    t_b = 2) each idle worker starts one ready action, a backward before a forward, the deepest stage,
    then the oldest micro-batch first, and never holds more than D micro-batches of activations
    (Chimera Table 2's bound). None when this greedy rule deadlocks."""
    place, pipe_of = chimera_placement(d, pipes), _chimera_pipe_of(d, n, pipes)
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    busy, held, t = [0] * d, [0] * d, 0
    while len(b_end) < n * d:
        started = False
        for w in range(d):
            if busy[w] > t:
                continue
            ready = []
            for m in range(n):
                s = place[pipe_of[m]].index(w)
                if (s, m) not in f_end:
                    if held[w] < d and (s == 0 or f_end.get((s - 1, m), t + 1) <= t):
                        ready.append((1, -s, m, s))
                elif (s, m) not in b_end and f_end[(s, m)] <= t and (s == d - 1 or b_end.get((s + 1, m), t + 1) <= t):
                    ready.append((0, -s, m, s))
            if ready:
                backward, _, m, s = min(ready)
                if backward == 0:
                    b_end[(s, m)] = busy[w] = t + 2
                    held[w] -= 1
                else:
                    f_end[(s, m)] = busy[w] = t + 1
                    held[w] += 1
                started = True
        if not started and max(busy) <= t:
            return None
        t += 1
    return max(b_end.values())


def _lower_bound(d: int, n: int, pipes: int) -> int:
    """Every worker runs N forwards and N backwards (3N at t_b = 2 t_f); it starts no earlier than its
    shallowest stage s allows (s·t_f) and after its last backward, at stage s', s'·t_b remain."""
    place = chimera_placement(d, pipes)
    return 3 * n + max(3 * min(row.index(w) for row in place) for w in range(d))


def test_plain_list_scheduler_yardstick() -> None:
    """D = 4, N = 16 at t_b = 2 t_f: DAPPLE 57, the plain list scheduler 55."""
    assert simulate(dapple(4, 16), 1, 2).makespan == 57
    assert _plain_list_makespan(4, 16, 2) == 55


DIRECT_GRID = [(d, n, pipes) for d in (2, 4, 6, 8) for n in sorted({d + 1, 2 * d, 2 * d + 1, 3 * d, 4 * d})
               for pipes in chimera_pipelines(d) if pipes <= 4]


@pytest.mark.parametrize("d, n, pipes", DIRECT_GRID)
def test_direct_concatenation_at_practical_costs(d: int, n: int, pipes: int) -> None:
    """N > D, t_b = 2 t_f (§3.5, Figure 7b): no slower than the plain list scheduler under the same
    activation bound, no faster than the work allows, and no slower than DAPPLE for whole units; every
    micro-batch stays on the pipeline Chimera deals it to."""
    s = validate(chimera(d, n, pipes, "direct"))
    sim = simulate(s, 1, 2)
    assert max(sim.peak_activations) <= d
    assert {a.mb: a.pipe for acts in s.workers for a in acts} == _chimera_pipe_of(d, n, pipes)
    plain = _plain_list_makespan(d, n, pipes)
    assert plain is None or sim.makespan <= plain
    assert sim.makespan >= _lower_bound(d, n, pipes)
    if n % d == 0:
        assert sim.makespan <= simulate(dapple(d, n), 1, 2).makespan


CHIMERA_D4_N8 = """\
P0: 0F0 0F1 0F4 3F2p1 3B2p1 3F3p1 3B3p1 0B0 0F5 0B1 3F6p1 3B6p1 3F7p1 3B7p1 0B4 0B5
P1: 1F0 2F2p1 1F1 2F3p1 2B2p1 1B0 2B3p1 1B1 1F4 2F6p1 1F5 2F7p1 2B6p1 1B4 2B7p1 1B5
P2: 1F2p1 2F0 1F3p1 2F1 2B0 1B2p1 2B1 1B3p1 1F6p1 2F4 1F7p1 2F5 2B4 1B6p1 2B5 1B7p1
P3: 0F2p1 0F3p1 0F6p1 3F0 3B0 3F1 3B1 0B2p1 0F7p1 0B3p1 3F4 3B4 3F5 3B5 0B6p1 0B7p1"""


def test_direct_concatenation_golden_d4_n8() -> None:
    """The second unit's first forward (4) fills worker 0's wait for the first backwards; 29 time
    units at t_b = 2 t_f against DAPPLE's 33 (the first unit alone, Figure 3, takes 16)."""
    s = chimera(4, 8)
    assert s.format() == CHIMERA_D4_N8
    assert simulate(s, 1, 2).makespan == 29 <= _plain_list_makespan(4, 8, 2)
    # worker 0 sends activation 4 before gradients 2p1 and 3p1, worker 1 uses it after them (and the mirror
    # image on pair 3 → 2): two of the six communicating pairs consume out of send order; the runtime's
    # rounds receive in send order (tests/strategies/schedules/test_messages.py)
    assert fifo_violations(s) == [(0, 1), (3, 2)]


def test_best_concat_is_the_fastest_simulated_method() -> None:
    """strategy.concat=auto: the fastest of the methods that apply, ties to fewer activations, then direct."""
    for d, n, b in [(4, 8, 1), (4, 8, 2), (4, 16, 2), (8, 16, 2), (6, 18, 1), (4, 4, 2), (2, 4, 2)]:
        methods = concat_choices(d, n, b)
        sims = {m: simulate(chimera(d, n, 2, m), 1, 2) for m in methods}
        fastest = min(sim.makespan for sim in sims.values())
        tied = [m for m in CONCAT_METHODS if m in sims and sims[m].makespan == fastest]
        expected = min(tied, key=lambda m: max(sims[m].peak_activations))
        assert best_concat(d, n, 2, b) == expected, (d, n, b)
    assert concat_choices(4, 4, 2) == ("direct",)  # one basic unit: nothing to concatenate
    assert concat_choices(4, 6, 2) == ("direct", "backward_halving")  # no full unit of 2D to double
    assert concat_choices(4, 8, 1) == ("direct", "forward_doubling")  # an odd B cannot be halved
    assert best_concat(2, 4, 2, 2) == "direct"  # D = 2: all three take 12, the tie goes to direct
    assert best_concat(4, 8, 2, 1) == "forward_doubling"  # 28 against direct's 29
    assert best_concat(4, 8, 2, 2) == "backward_halving"  # 28 as well, with half the activations
    # measured costs per method: slow halves make halving lose
    slow_halves = {"direct": (1.0, 2.0, 0.0), "forward_doubling": (1.5, 2.0, 0.0), "backward_halving": (1.0, 3.0, 0.0)}
    assert best_concat(4, 8, 2, 2, costs=slow_halves.__getitem__) == "direct"
    assert resolve_concat("chimera", 4, 8, None, 2, "auto") == "backward_halving"
    assert resolve_concat("dapple", 4, 8, None, 2, "auto") == "direct"
    assert resolve_concat("chimera", 4, 8, None, 2, "forward_doubling") == "forward_doubling"


def test_concat_auto_simulates_the_schedule_it_builds() -> None:
    """Chimera + zero bubble picks its method from its own simulated schedules, not plain Chimera's: its
    deferred weight gradients fill other bubbles (D = 8, N = 16: direct 51 against halving's 52, where
    plain Chimera's halving takes 59 against direct's 65)."""
    from pipeline_recipes.strategies.schedules import build_schedule

    for d, n, b in [(4, 8, 2), (8, 16, 2), (4, 16, 2), (4, 12, 1)]:
        sims = {m: simulate(build_schedule("chimera_zb", d, n, concat=m), 1, 2) for m in concat_choices(d, n, b)}
        fastest = min(sim.makespan for sim in sims.values())
        tied = [m for m in CONCAT_METHODS if m in sims and sims[m].makespan == fastest]
        expected = min(tied, key=lambda m: max(sims[m].peak_activations))
        assert resolve_concat("chimera_zb", d, n, None, b, "auto") == expected, (d, n, b)
    assert resolve_concat("chimera", 8, 16, None, 2, "auto") == "backward_halving"
    assert resolve_concat("chimera_zb", 8, 16, None, 2, "auto") == "direct"


@pytest.mark.parametrize("d", [4, 6, 8])
def test_n_equals_2d_methods_at_practical_costs(d: int) -> None:
    n = 2 * d
    dapple_time = simulate(dapple(d, n), 1, 2).makespan
    direct = simulate(chimera(d, n, 2, "direct"), 1, 2)
    doubling = simulate(chimera(d, n, 2, "forward_doubling"), 1, 2)
    halving = simulate(chimera(d, n, 2, "backward_halving"), 1, 2)
    assert direct.makespan <= dapple_time
    # Figure 7(d): no intermediate bubbles, D - 2 bubbles of one backward each (t_b = 2 t_f).
    ideal = 3 * n + (d - 2) * 2
    assert doubling.makespan == ideal
    assert halving.makespan <= ideal
    assert doubling.makespan < direct.makespan and halving.makespan < direct.makespan
    assert max(doubling.peak_activations) <= 2 * d  # doubled forwards: twice the activations
    assert max(halving.peak_activations) <= 2 * d


@pytest.mark.parametrize("d, n", [(4, 1), (4, 2), (4, 3), (6, 5), (8, 7), (2, 1), (4, 5), (6, 7), (4, 9)])
def test_uneven_micro_batch_counts(d: int, n: int) -> None:
    s = validate(chimera(d, n))
    per_pipe = [sum(1 for a in s.workers[s.worker_of(p, 0)] if a.kind == "F" and a.pipe == p and a.stage == 0)
                for p in range(s.pipelines)]
    assert sum(per_pipe) == n and max(per_pipe) - min(per_pipe) <= 1  # "as evenly as possible" (§3.1)
    assert max(simulate(s).peak_activations) <= d
    if n < d:  # fewer micro-batches than stages: two directions still beat one
        assert simulate(s, 1, 2).makespan <= simulate(dapple(d, n), 1, 2).makespan


def test_single_micro_batch_runs_on_one_pipeline() -> None:
    s = chimera(4, 1)
    pipes = {a.pipe for acts in s.workers for a in acts}
    assert pipes == {0}


# --- validation and bad input --------------------------------------------------------------

def _replace(s: Schedule, worker: int, acts: list[Action]) -> Schedule:
    workers = list(s.workers)
    workers[worker] = tuple(acts)
    return Schedule(s.name, s.stages, s.micro_batches, s.placement, tuple(workers))


def test_validate_reports_backward_before_forward_with_grid() -> None:
    s = dapple(2, 2)
    acts = list(s.workers[1])
    acts[0], acts[1] = acts[1], acts[0]  # B before F on the last stage
    with pytest.raises(ValueError) as err:
        validate(_replace(s, 1, acts))
    assert "before its forward" in str(err.value) and ">1B0<" in str(err.value) and "P1" in str(err.value)


def test_validate_reports_wrong_worker() -> None:
    s = gpipe(2, 1)
    with pytest.raises(ValueError, match="runs on worker 0"):
        validate(_replace(s, 0, [Action("F", 0, 0, (0,)), Action("F", 0, 1, (0,)), Action("B", 0, 0, (0,))]))


def test_validate_reports_missing_backward() -> None:
    s = gpipe(2, 2)
    with pytest.raises(ValueError, match="needs one backward"):
        validate(_replace(s, 0, list(s.workers[0])[:-1]))


def test_validate_reports_deadlock_with_marked_grid() -> None:
    s = gpipe(2, 2)
    # Worker 0 waits for 0B1 before 0B0, worker 1 does B1 after B0: fine; now make a cycle:
    w0 = [Action("F", 0, 0, (0,)), Action("B", 0, 0, (0,)), Action("F", 0, 0, (1,)), Action("B", 0, 0, (1,))]
    w1 = [Action("F", 0, 1, (1,)), Action("B", 0, 1, (1,)), Action("F", 0, 1, (0,)), Action("B", 0, 1, (0,))]
    bad = Schedule("gpipe", 2, 2, s.placement, (tuple(w0), tuple(w1)))
    with pytest.raises(DeadlockError) as err:
        validate(bad)
    assert ">0B0<" in str(err.value) and ">1F1<" in str(err.value)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: chimera(3, 4), "chimera needs stages to be even"),
        (lambda: gems(5, 4), "gems needs stages to be even (each worker holds one stage of each of its two "
                             "replicas), got stages = 5; use stages = 4 or 6"),
        (lambda: build_schedule("gems", 4, 4, pipelines=4), "gems runs exactly 2 pipelines"),
        (lambda: chimera(8, 8, 6), "choose one of [2, 4, 8]"),
        (lambda: chimera(4, 4, 2, "tripling"), "concat = 'tripling' is not a concatenation method"),
        (lambda: gpipe(0, 4), "stages must be a positive integer"),
        (lambda: dapple(4, 0), "micro_batches must be a positive integer"),
        (lambda: build_schedule("zero_bubble", 4, 4), "unknown schedule"),
        (lambda: build_schedule("gpipe", 4, 4, pipelines=2), "leave pipelines unset"),
    ],
)
def test_bad_sizes_raise_clear_errors(call, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        call()
    assert fragment in str(err.value)


def test_simulate_per_stage_costs_and_comm() -> None:
    s = dapple(2, 2)
    base = simulate(s, [1.0, 1.0], [2.0, 2.0])
    slow_last = simulate(s, [1.0, 3.0], [2.0, 2.0])
    assert slow_last.makespan > base.makespan
    assert simulate(s, 1, 2, t_comm=0.5).makespan > base.makespan
    with pytest.raises(ValueError, match="t_f must be"):
        simulate(s, [1.0], 2.0)


def test_overlapped_pairs_are_independent_pairs() -> None:
    from pipeline_recipes.strategies.schedules.actions import B, F, overlapped

    dependent = Schedule("t", 1, 1, ((0,),), ((F(0, 0), overlapped(B(0, 0))),))
    with pytest.raises(ValueError, match="needs 0F0, so the two cannot run overlapped"):
        validate(dependent)
    chain = Schedule("t", 1, 2, ((0,),), ((F(0, 0), overlapped(F(0, 1)), overlapped(B(0, 0)), B(0, 1)),))
    with pytest.raises(ValueError, match="chain three overlapped actions"):
        validate(chain)
