"""Pure tests of the modern schedules (interleaved 1F1B, ZB-H1, ZB-H2, ZB-V, DualPipeV, Chimera + zero
bubble): size grids (and every schedule of the registry: validated, simulated, round-tripped), golden
orders from torch.distributed.pipelining (torch 2.13) built without processes, the papers' bubble and
memory formulas through the simulator, and small golden timelines.

Costs: the zero-bubble papers' T_F = T_B = T_W (their B is our I) is ``simulate(s, 1, 2, t_w=1)``; for
schedules with several stages per worker the costs are per stage (chunk).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from pipeline_recipes.strategies.schedules import (Schedule, build_schedule, chimera, dapple, get_spec, parse_action,
                                                   peak_activations, simulate, specs, validate)
from pipeline_recipes.strategies.schedules.actions import Action
from pipeline_recipes.strategies.schedules.dualpipe import dualpipev
from pipeline_recipes.strategies.schedules.graph import dependencies, index_actions
from pipeline_recipes.strategies.schedules.interleaved import interleaved_1f1b
from pipeline_recipes.strategies.schedules.render import ascii_chart
from pipeline_recipes.strategies.schedules.simulate import Simulation, action_cost
from pipeline_recipes.strategies.schedules.zero_bubble import (
    chimera_zb, defer_weight_gradients, split_backwards, zb_h1, zb_h2, zbv,
)
from schedule_grids import micro_batches, variants

WORKERS = (1, 2, 3, 4, 5, 8)
MICRO_BATCHES = (1, 2, 3, 4, 5, 7, 8, 12, 16)
UNIT = (1.0, 2.0)  # t_f, t_b with t_w = 1: the zero-bubble paper's T_F = T_B = T_W


def unit(schedule: Schedule) -> Simulation:
    return simulate(schedule, *UNIT, t_w=1.0)


def inner_idle(sim: Simulation) -> list[float]:
    """Per worker, idle time between its first action's start and its last action's end."""
    return [row[-1].end - row[0].start - sum(t.end - t.start for t in row) for row in sim.timeline]


def interleaved_sizes() -> list[tuple[int, int, int]]:
    out = []
    for p in WORKERS:
        for v in (2, 3):
            for n in MICRO_BATCHES:
                if n % max(1, n // p) == 0:  # torch's rounds rule (see interleaved.py)
                    out.append((p, v, n))
    return out


def all_schedules() -> list[tuple[str, Callable[[], Schedule]]]:
    cases: list[tuple[str, Callable[[], Schedule]]] = []
    for p, v, n in interleaved_sizes():
        cases.append((f"interleaved_1f1b-P{p}-v{v}-N{n}", lambda p=p, v=v, n=n: interleaved_1f1b(p, v, n)))
    for p in WORKERS:
        for n in MICRO_BATCHES:
            cases += [(f"zb_h1-P{p}-N{n}", lambda p=p, n=n: zb_h1(p, n)),
                      (f"zb_h2-P{p}-N{n}", lambda p=p, n=n: zb_h2(p, n)),
                      (f"zbv-P{p}-N{n}", lambda p=p, n=n: zbv(p, n))]
        for n in (2 * p, 2 * p + 1, 3 * p, 4 * p + 3):
            cases.append((f"dualpipev-P{p}-N{n}", lambda p=p, n=n: dualpipev(p, n)))
    for d in (2, 4, 6):
        for n in (1, 3, d, d + 1, 2 * d):
            for concat in ("direct", "forward_doubling", "backward_halving"):
                cases.append((f"chimera_zb-D{d}-N{n}-{concat}", lambda d=d, n=n, c=concat: chimera_zb(d, n, 2, c)))
    cases.append(("chimera_zb-D8-N8-4pipes", lambda: chimera_zb(8, 8, 4)))
    return cases


# --- every schedule: valid, simulated, round-trips ---------------------------------------------

def test_no_torch_import() -> None:
    import subprocess
    import sys

    code = ("import pipeline_recipes.strategies.schedules.interleaved, pipeline_recipes.strategies.schedules.zero_bubble, "
            "pipeline_recipes.strategies.schedules.dualpipe, sys; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", "schedule generators must stay pure Python"


def test_the_registry_builds_these_generators() -> None:
    """The registry's specs are the only table of the generators: each builds what its module's function does."""
    for name, generator in (("zb_h1", zb_h1), ("zb_h2", zb_h2), ("zbv", zbv), ("dualpipev", dualpipev)):
        assert get_spec(name).generator(4, 8) == generator(4, 8), name
    assert build_schedule("chimera_zb", 4, 8) == chimera_zb(4, 8, 2)
    assert build_schedule("zbv", 2, 4) == zbv(2, 4) and build_schedule("interleaved_1f1b", 2, 4, chunks=2).stages == 4
    assert build_schedule("interleaved_1f1b", 2, 4, chunks=2) == interleaved_1f1b(2, 2, 4)


def registry_schedules() -> list[tuple[str, Callable[[], Schedule]]]:
    """Every schedule of the registry at D ∈ {2, 3, 4}, N ∈ {1, D, 2D + 1} and each of its choices, where
    its rules allow (a schedule added to the registry is checked here with no edit)."""
    cases: list[tuple[str, Callable[[], Schedule]]] = []
    for spec in specs():
        for d in (2, 3, 4):
            for options in variants(spec, d):
                for n in micro_batches(spec, d, (1, d, 2 * d + 1), **options):
                    label = "-".join([spec.name, f"D{d}", f"N{n}", *map(str, options.values())])
                    cases.append((label, lambda s=spec.name, d=d, n=n, o=options: build_schedule(
                        s, d, n, o.get("pipelines"), o.get("concat", "direct"), chunks=o.get("chunks"))))
    return cases


@pytest.mark.parametrize("build", [b for _, b in all_schedules() + registry_schedules()],
                         ids=[i for i, _ in all_schedules() + registry_schedules()])
def test_valid_simulated_and_round_trips(build: Callable[[], Schedule]) -> None:
    s = build()
    assert validate(s) is s
    sim = simulate(s, 1.0, 2.0)
    busy = sum(action_cost(a, [1.0] * s.stages, [2.0] * s.stages) for acts in s.workers for a in acts)
    assert sum(sim.busy) == pytest.approx(busy) and sim.makespan > 0
    data = json.loads(json.dumps(s.to_json()))
    restored = Schedule.from_json(data)
    assert (restored.workers, restored.placement, restored.stages) == (s.workers, s.placement, s.stages)
    for action in (a for acts in s.workers for a in acts):
        assert parse_action(str(action)) == action and str(parse_action(str(action))) == str(action)
        assert Action.from_json(action.to_json()).overlap == action.overlap


@pytest.mark.parametrize("p", WORKERS)
def test_placements(p: int) -> None:
    s = interleaved_1f1b(p, 3, 3 * p)
    assert s.placement == (tuple(st % p for st in range(3 * p)),) and s.stages == 3 * p
    assert all(s.stages_of(w) == (w, w + p, w + 2 * p) for w in range(p))
    for v_schedule in (zbv(p, 2 * p), dualpipev(p, 2 * p)):
        assert v_schedule.stages == 2 * p
        assert all(v_schedule.stages_of(w) == (w, 2 * p - 1 - w) for w in range(p))  # a V
    assert zb_h1(p, 4).placement == zb_h2(p, 4).placement == (tuple(range(p)),)


# --- golden orders: torch.distributed.pipelining (torch 2.13), built without processes ----------

def torch_order(cls_name: str, workers: int, local_stages: int, micro_batches: int) -> list[list[str]] | None:
    """Each rank's compute actions in our text form, from torch's ``pipeline_order``; ``None`` where torch
    refuses the size. Stage objects are stand-ins carrying what the constructors read; an overlapped
    forward/backward pair ``OVERLAP_F_B`` becomes our forward followed by ``&`` backward."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    stages = [SimpleNamespace(num_stages=workers * local_stages, group_size=workers, group_rank=0, submod=None,
                              stage_index_to_group_rank=None) for _ in range(local_stages)]
    try:
        order = getattr(schedules, cls_name)(stages, micro_batches).pipeline_order
    except ValueError:
        return None
    rows = []
    for rank in range(workers):
        row = []
        for a in order[rank]:
            if a is None:
                continue
            if a.computation_type == schedules.OVERLAP_F_B:
                f, b = a.sub_actions
                row += [f"{f.stage_index}F{f.microbatch_index}", f"&{b.stage_index}{b.computation_type.value}"
                                                                 f"{b.microbatch_index}"]
            else:
                row.append(f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}")
        rows.append(row)
    return rows


def ours(s: Schedule) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in s.workers]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_interleaved_1f1b_matches_torch(p: int) -> None:
    """Same order as torch's ScheduleInterleaved1F1B, and the same sizes refused (its rounds rule)."""
    for v in (2, 3):
        for n in range(1, 3 * p + 3):
            expected = torch_order("ScheduleInterleaved1F1B", p, v, n)
            if expected is None:
                with pytest.raises(ValueError, match="rounds"):
                    interleaved_1f1b(p, v, n)
            else:
                assert ours(interleaved_1f1b(p, v, n)) == expected, (p, v, n)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zb_h1_matches_torch_zero_bubble_with_one_stage_per_rank(p: int) -> None:
    """torch's ScheduleInterleavedZeroBubble ("ZB1P") with one stage per rank is ZB-H1. torch refuses the N
    that do not split into its interleaving rounds even with one stage per rank, where rounds change
    nothing; those N are checked against the paper's formulas below instead."""
    compared = 0
    for n in range(1, 3 * p + 3):
        expected = torch_order("ScheduleInterleavedZeroBubble", p, 1, n)
        if expected is not None:
            assert ours(zb_h1(p, n)) == expected, (p, n)
            compared += 1
    assert compared >= p + 2


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zbv_matches_torch(p: int) -> None:
    for n in range(1, 3 * p + 3):
        assert ours(zbv(p, n)) == torch_order("ScheduleZBVZeroBubble", p, 2, n), (p, n)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_dualpipev_matches_torch(p: int) -> None:
    for n in range(2 * p, 4 * p + 3):
        assert ours(dualpipev(p, n)) == torch_order("ScheduleDualPipeV", p, 2, n), (p, n)
    assert torch_order("ScheduleDualPipeV", p, 2, 2 * p - 1) is None  # both need N ≥ 2P
    with pytest.raises(ValueError, match=f"got N = {2 * p - 1} .* < 2·D = {2 * p}"):
        dualpipev(p, 2 * p - 1)


# --- the papers' formulas ----------------------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0)])
def test_interleaved_bubble_is_1f1b_bubble_over_v(p: int, v: int, t_f: float, t_b: float) -> None:
    """Megatron-LM §2.2.2: bubble time (P − 1)(t_F + t_B)/v, t_F and t_B a worker's whole share of the model.
    Each of the v chunks costs t_f = t_F/v and t_b = t_B/v; every worker is busy v·N·(t_f + t_b); bubble =
    makespan − that (each worker's idle time within the flushed iteration), for N a multiple of P."""
    for n in (p, 2 * p, 3 * p):
        sim = simulate(interleaved_1f1b(p, v, n), t_f, t_b)
        work = v * n * (t_f + t_b)
        assert all(b == pytest.approx(work) for b in sim.busy)
        bubble = sim.makespan - work
        assert bubble == pytest.approx((p - 1) * (v * t_f + v * t_b) / v)
        one_f_one_b = simulate(dapple(p, n), v * t_f, v * t_b)  # the same model, one stage per worker
        assert (one_f_one_b.makespan - n * v * (t_f + t_b)) / bubble == pytest.approx(v)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("t_f, t_i, t_w", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 2.0, 1.0), (2.0, 1.0, 1.0)])
def test_zb_h1_bubble_and_memory(p: int, t_f: float, t_i: float, t_w: float) -> None:
    """Zero Bubble Pipeline Parallelism §2.1: bubble (P − 1)(T_F + T_B − T_W) (their B = our I), a third
    of 1F1B's (P − 1)(T_F + T_B + T_W) at equal costs, for T_W ≤ T_F, T_B and N ≥ P; peak activations
    at most 1F1B's (P micro-batches on the first worker; here P on every worker)."""
    for n in (p, p + 1, 2 * p, 3 * p):
        s = zb_h1(p, n)
        sim = simulate(s, t_f, t_i + t_w, t_w=t_w)
        assert sim.makespan - n * (t_f + t_i + t_w) == pytest.approx((p - 1) * (t_f + t_i - t_w))
        one_f_one_b = simulate(dapple(p, n), t_f, t_i + t_w)
        assert one_f_one_b.makespan - n * (t_f + t_i + t_w) == pytest.approx((p - 1) * (t_f + t_i + t_w))
        assert max(sim.peak_activations) <= max(peak_activations(dapple(p, n)))
        assert sim.peak_activations == tuple([float(p)] * p)  # the same in-flight count on every stage


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zb_h2_zero_bubble_at_twice_1f1b_memory(p: int) -> None:
    """§2.2: with 2P − 1 micro-batches in flight on the first worker (about twice 1F1B's P), no worker idles
    between its first and last action at T_F = T_B = T_W once N ≥ 2P − 1; the only idle time is the fill
    and drain (P − 1)·T_F of the parallelogram, which post-validated optimizer steps (§4) overlap with
    the next iteration."""
    for n in (2 * p - 1, 2 * p, 3 * p + 1):
        sim = unit(zb_h2(p, n))
        assert inner_idle(sim) == [0.0] * p
        assert sim.makespan == 3 * n + (p - 1)
        assert max(sim.peak_activations) == 2 * p - 1 <= 2 * max(peak_activations(dapple(p, n)))
        assert sim.makespan <= unit(zb_h1(p, n)).makespan
        assert sum(inner_idle(unit(zb_h1(p, n)))) > 0  # ZB-H1 keeps bubbles inside its iteration


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zbv_zero_bubble_at_1f1b_memory(p: int) -> None:
    """§6: ZB-V, zero bubble at T_F = T_B = T_W with 1F1B's activation memory. A worker's two chunks hold
    2P chunk activations = P micro-batches of the worker's layers, 1F1B's P; no idle time between a worker's
    first and last action once N ≥ 2P − 1, only the (P − 1)·t_f fill and drain."""
    for n in (2 * p - 1, 2 * p, 3 * p + 1):
        sim = unit(zbv(p, n))
        assert inner_idle(sim) == [0.0] * p
        assert sim.makespan == 6 * n + (p - 1)  # 2 chunks × (F + I + W) per micro-batch
        assert max(sim.peak_activations) / 2 == max(peak_activations(dapple(p, n))) == p


def simulate_overlapped_pairs(schedule: Schedule, t_f: float, t_b: float, t_w: float, t_pair: float) -> list[float]:
    """Per-worker idle time when each overlapped pair runs as one unit of ``t_pair`` whose two results are
    ready together at its end — the report's F&B. (``simulate`` runs a pair's two actions one after the
    other, which frees the forward's output before the backward ends.)"""
    known = index_actions(a for acts in schedule.workers for a in acts)
    costs = ([t_f] * schedule.stages, [t_b] * schedule.stages, [t_w] * schedule.stages)
    units: list[list[list[Action]]] = []
    for acts in schedule.workers:
        groups: list[list[Action]] = []
        for a in acts:
            groups[-1].append(a) if a.overlap else groups.append([a])
        units.append(groups)
    end: dict[Action, float] = {}
    free, busy, position = [0.0] * len(units), [0.0] * len(units), [0] * len(units)
    while any(position[w] < len(g) for w, g in enumerate(units)):
        progressed = False
        for w, groups in enumerate(units):
            while position[w] < len(groups):
                group = groups[position[w]]
                deps = [d for a in group for d in dependencies(a, known, schedule.stages) if d not in group]
                if any(d not in end for d in deps):
                    break
                start = max([end[d] for d in deps] + [free[w]])  # type: ignore[index]
                cost = t_pair if len(group) == 2 else action_cost(group[0], *costs)
                for a in group:
                    end[a] = start + cost
                free[w], busy[w], position[w], progressed = start + cost, busy[w] + cost, position[w] + 1, True
        assert progressed
    return [max(free) - b for b in busy]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_dualpipev_bubble_and_memory_of_the_report(p: int) -> None:
    """DeepSeek-V3 report §3.2.1, Table 2 (DualPipe; its V variant with PP = 2P stages on P workers):
    bubble (PP/2 − 1)(F&B + B − 3W) and PP + 1 stage activations per device, F&B the time of an
    overlapped forward/backward pair. With t_f = 1, t_b = 2, t_w = 1 and the pair costing t_pair, the
    worst worker idles exactly (P − 1)(t_pair + 2 − 3)."""
    for n in (2 * p, 2 * p + 3, 4 * p):
        s = dualpipev(p, n)
        for t_pair in (2.0, 2.5, 3.0):
            idle = simulate_overlapped_pairs(s, 1.0, 2.0, 1.0, t_pair)
            assert max(idle) == pytest.approx((p - 1) * (t_pair + 2.0 - 3.0))
        assert max(peak_activations(s)) == 2 * p + 1
        pairs = sum(a.overlap for acts in s.workers for a in acts)
        assert pairs == sum(2 * (n - 2 * p + r + 1) - (r == p - 1) + (p - 1 - r) for r in range(p))


# --- deferring weight gradients; Chimera + zero bubble ----------------------------------------

def test_split_backwards_is_b_as_i_then_w() -> None:
    s = split_backwards(dapple(4, 6))
    assert validate(s) and {a.kind for acts in s.workers for a in acts} == {"F", "I", "W"}
    assert " ".join(map(str, s.workers[0][:8])) == "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1"  # 1F1B's order, B = I W
    assert sum(unit(s).busy) == sum(unit(dapple(4, 6)).busy)


@pytest.mark.parametrize("d, n", [(2, 2), (2, 6), (4, 4), (4, 8), (4, 9), (6, 6), (6, 12), (8, 8), (8, 16)])
def test_chimera_zb_fills_bubbles_within_chimera_memory(d: int, n: int) -> None:
    """Every B of Chimera becomes I + W; W's move into idle time at t_f = 1, t_b = 2 (W = 1). Bound: each
    worker's peak activations stay Chimera's own (≤ D, Chimera Table 2), so the variant costs no memory."""
    base, zb = chimera(d, n), chimera_zb(d, n)
    assert peak_activations(zb) == peak_activations(base) and max(peak_activations(zb)) <= d
    assert unit(zb).makespan <= unit(base).makespan
    if d >= 4:
        assert unit(zb).makespan < unit(base).makespan
    assert all(a.kind != "B" for acts in zb.workers for a in acts)
    # the forwards and input gradients keep Chimera's order; only the W's moved
    for before, after in zip(split_backwards(base).workers, zb.workers):
        assert [a for a in before if a.kind != "W"] == [a for a in after if a.kind != "W"]


def test_chimera_zb_figure_3_size() -> None:
    """D = N = 4 (Chimera Figure 3): 16 time units at t_b = 2 t_f, 13 with the W's deferred."""
    assert (unit(chimera(4, 4)).makespan, unit(chimera_zb(4, 4)).makespan) == (16, 13)


def test_defer_weight_gradients_respects_the_bound() -> None:
    base = dapple(4, 8)
    deferred = defer_weight_gradients(base)
    assert peak_activations(deferred) == peak_activations(base)
    roomy = defer_weight_gradients(base, max_activations=8)
    assert max(peak_activations(roomy)) <= 8 and unit(roomy).makespan <= unit(deferred).makespan
    with pytest.raises(ValueError, match="raise max_activations to at least 4"):
        defer_weight_gradients(base, max_activations=3)
    with pytest.raises(ValueError, match="one per worker"):
        defer_weight_gradients(base, max_activations=[4, 4])


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "call, fragments",
    [
        (lambda: interleaved_1f1b(4, 2, 9), ["N = 9", "rounds = max(1, N // P) = 2", "N mod P = 0", "N = 8 or N = 10"]),
        (lambda: interleaved_1f1b(4, 1, 8), ["chunks (v)", "got 1", "dapple"]),
        (lambda: interleaved_1f1b(0, 2, 8), ["workers (P)", "got 0"]),
        (lambda: zb_h1(4, 0), ["micro_batches (N)", "got 0"]),
        (lambda: zb_h2(2.5, 4), ["workers (P)", "2.5"]),
        (lambda: zbv(3, -1), ["micro_batches (N)", "-1"]),
        (lambda: dualpipev(4, 7), ["micro_batches (N)", "got N = 7", "2·D = 8", "zbv"]),
        (lambda: chimera_zb(3, 4), ["needs stages to be even", "stages = 2 or 4"]),
    ],
)
def test_bad_sizes_raise_clear_errors(call: Callable[[], Schedule], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value)


# --- small golden timelines (simulate(s, 1, 2, t_w=1)) ----------------------------------------

GOLDEN = {
    "interleaved_1f1b P=2 v=2 N=4": (lambda: interleaved_1f1b(2, 2, 4), simulate, """\
t  0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27
P0 |F0|F1|F0|F1|F2...|B0===|F3|B1===|F2|B0===|F3|B1===...|B2===...|B3===|B2===|B3===|
P1 ...|F0|F1|F0|B0===|F1|B1===|F2|B0===|F3|B1===|F2|B2===|F3|B3===|B2===|B3===......|"""),
    "zb_h1 P=3 N=4": (lambda: zb_h1(3, 4), unit, """\
t  0  1  2  3  4  5  6  7  8  9  10 11 12 13 14
P0 |F0|F1|F2......|I0|W0|F3|I1|W1|I2|W2|I3|W3|
P1 ...|F0|F1...|I0|F2|I1|W0|F3|I2|W1|I3|W2|W3|
P2 ......|F0|I0|F1|I1|F2|I2|W0|F3|I3|W1|W2|W3|"""),
    "zb_h2 P=3 N=5": (lambda: zb_h2(3, 5), unit, """\
t  0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17
P0 |F0|F1|F2|F3|F4|I0|W0|I1|W1|I2|W2|I3|W3|I4|W4......|
P1 ...|F0|F1|F2|I0|F3|I1|F4|I2|W0|I3|W1|I4|W2|W3|W4...|
P2 ......|F0|I0|F1|I1|F2|I2|F3|I3|F4|I4|W0|W1|W2|W3|W4|"""),
    "zbv P=2 N=3": (lambda: zbv(2, 3), unit, """\
t  0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19
P0 |F0|F1|F2|F0|I0|W0|F1|I1|W1|I0|W0|F2|I2|W2|I1|W1|I2|W2...|
P1 ...|F0|F0|F1|F1|I0|W0|F2|I0|W0|F2|I1|W1|I1|I2|I2|W1|W2|W2|"""),
    "dualpipev P=2 N=4": (lambda: dualpipev(2, 4), unit, """\
t  0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25
P0 |F0|F1|F2|F0|I0|W0|F1|F3|B1===|F2|B0===|B2===|F3...|B1===|B3===|I2|W2|I3|W3|
P1 ...|F0|F0|F1|F1|F2|B0===|F2|B0===|F3|B1===|F3|B1===|B2===|B2===|I3|I3|W3|W3|"""),
    "chimera_zb D=4 N=4": (lambda: chimera_zb(4, 4), unit, """\
t  0    1    2    3    4    5    6    7    8    9    10   11   12   13
P0 |F0  |F1  .....|F2p1|I2p1|W2p1|F3p1|I3p1|I0--|W3p1|I1--|W0~~|W1~~|
P1 .....|F0  |F2p1|F1  |F3p1|I2p1|I0--|W2p1|I3p1|I1--|W0~~|W3p1|W1~~|
P2 .....|F2p1|F0  |F3p1|F1  |I0--|I2p1|W0~~|I1--|I3p1|W2p1|W1~~|W3p1|
P3 |F2p1|F3p1.....|F0  |I0--|W0~~|F1  |I1--|I2p1|W1~~|I3p1|W2p1|W3p1|"""),
}

GOLDEN_ORDERS = {
    "zbv P=2 N=3": "P0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2\n"
                   "P1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    "dualpipev P=2 N=4": "P0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 &3B1 3F2 &0B0 3B2 3F3 &0B1 3B3 0I2 0W2 0I3 0W3\n"
                         "P1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 &1B0 1F3 &2B1 2F3 &1B1 2B2 1B2 2I3 1I3 2W3 1W3",
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_timelines(name: str) -> None:
    build, run, expected = GOLDEN[name]
    s = build()
    chart = ascii_chart(run(s) if run is unit else run(s, 1.0, 2.0))
    assert "\n".join(chart.splitlines()[: 1 + s.num_workers]) == expected
    if name in GOLDEN_ORDERS:
        assert s.format() == GOLDEN_ORDERS[name]
