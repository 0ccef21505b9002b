"""PipeDream-2BW and PipeDream (Chimera Table 2): no-flush schedules, weight stashing, delayed updates.

These are not mini-batch SGD, so the reference is their update rule run in one process: the
gradient of step t is computed on the weights live at step t and applied by stage s at the end of
step t + delay(s) (2BW: delay 1, ``w(t+1) = w(t) - ν·∇f(w(t-1))``; PipeDream: delay D - 1 - s).
The pipeline matches it only if every backward used its forward's weight version.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_world
from pipeline_recipes.strategies.runtime.executor import WindowPlans
from pipeline_recipes.strategies.runtime.late_loss import LateLosses
from pipeline_recipes.strategies.schedules import build_schedule, dapple, simulate, validate
from pipeline_recipes.strategies.schedules.comm import comm_plan, unconsumed_messages
from pipeline_recipes.strategies.schedules.messages import Message
from pipeline_recipes.strategies.schedules.asynchronous import (
    run, stashed_versions, steady_step, version_of, weight_delay, window,
)
from schedule_grids import async_equivalence_cases, asynchronous, micro_batches
from toy_model import ToyMLP, toy_batches

B, LR, MOMENTUM = 2, 0.05, 0.9


# -- schedules (pure) --------------------------------------------------------------------------

@pytest.mark.parametrize("name, d, n", [(s.name, d, n) for s in asynchronous() for d in (1, 2, 3, 4, 5, 8)
                                         for n in micro_batches(s, d, (d, d + 1, 2 * d + 3))])
def test_windows_are_one_no_flush_1f1b_stream(name: str, d: int, n: int) -> None:
    """T windows back to back (plus the drain) are DAPPLE over T·N micro-batches with no flush in between."""
    steps = 4
    joined = [sum((window(name, d, n, t).workers[s] for t in range(steps)), ()) for s in range(d)]
    full = validate(run(name, d, n, steps))
    assert [list(w[: len(j)]) for w, j in zip(full.workers, joined)] == [list(j) for j in joined]
    assert full.workers == dapple(d, steps * n).workers
    for t in range(steps):  # every forward of step t runs in window t, on version t
        forwards = {a.mb for acts in window(name, d, n, t).workers for a in acts if a.kind == "F"}
        assert forwards == set(range(t * n, (t + 1) * n))
        assert {version_of(m, n) for m in forwards} == {t}


@pytest.mark.parametrize("d", [2, 4, 8])
def test_table_2_bubbles_and_weight_versions(d: int) -> None:
    """Bubble ratio ≈ 0 (only the first fill and last drain of the whole run), 2BW stashes 2 Mθ,
    PipeDream [Mθ, D·Mθ]; activations [Ma, D·Ma] for both."""
    for name, n in (("pipedream_2bw", d), ("pipedream", 1)):
        steps = 200
        sim = simulate(run(name, d, n, steps), 1, 2)
        assert sim.bubble_ratio == pytest.approx((d - 1) / (steps * n + d - 1))
        assert sim.bubble_ratio < 0.04
        assert sim.peak_activations == tuple(float(min(d - s, steps * n)) for s in range(d))
    assert max(stashed_versions("pipedream_2bw", d, d)) == 2
    assert stashed_versions("pipedream", d, 1) == tuple(range(d, 0, -1))
    assert [weight_delay("pipedream", s, d) for s in range(d)] == list(range(d - 1, -1, -1))
    assert {weight_delay("pipedream_2bw", s, d) for s in range(d)} == {1}


def test_the_gradients_that_cross_a_step_boundary_arrive_in_the_window_that_sends_them() -> None:
    """Window 1 of D = 4, N = 4 (micro-batches 4-7): stage s's last backward there is of micro-batch
    7 - (D - 1 - s); the next stage's gradient for the micro-batch after it is sent in this window
    (stage s + 1 is one micro-batch further) and consumed in the next: 0B5, 1B6, 2B7."""
    now = window("pipedream_2bw", 4, 4, 1)
    assert [sorted(unconsumed_messages(now, w)) for w in range(4)] == [
        [Message("grad", 0, 1, 5)], [Message("grad", 0, 2, 6)], [Message("grad", 0, 3, 7)], []]
    before = window("pipedream_2bw", 4, 4, 0)
    for w in range(4):  # the window's last round receives them
        plan = comm_plan(now, w, carried_in=unconsumed_messages(before, w))
        assert {t.message for t in plan.rounds[-1].recvs} == set(unconsumed_messages(now, w))


@pytest.mark.parametrize("name, d, n", [(s.name, d, n) for s in asynchronous() for d in (2, 3, 5, 8)
                                         for n in micro_batches(s, d, (d, d + 1) if d < 8 else (d,))])
def test_window_plans_derived_once_equal_the_plans_derived_every_step(name: str, d: int, n: int) -> None:
    """A window's rounds come from the cache (the steady window's plan renumbered) exactly as
    :func:`comm_plan` derives them for that window afresh, and only the windows up to the steady one
    derive their own."""
    steps = steady_step(name, d, n) + 4
    for w in range(d):
        plans, carried = WindowPlans(w), frozenset()
        for t in range(steps):
            now = window(name, d, n, t)
            assert plans(now, carried) == comm_plan(now, w, carried_in=carried), (w, t)
            carried = unconsumed_messages(now, w)
        assert len(plans) <= steady_step(name, d, n) + 1


class _Work:
    """A started all-reduce of one rank: records the step it started in and the step it was waited in."""

    def __init__(self, started: int, clock: list[int]) -> None:
        self.started, self.clock, self.waited = started, clock, None

    def wait(self) -> None:
        assert self.waited is None, "an all-reduce waited twice"
        self.waited = self.clock[0]


@pytest.mark.parametrize("d, n", [(2, 2), (4, 4), (4, 1), (5, 1), (8, 1), (8, 8), (8, 16)])
def test_late_losses_come_lag_steps_late_from_all_reduces_started_half_the_lag_before(d: int, n: int) -> None:
    """Step t returns step t - lag's loss (the first step its own, lag = ceil((D - 1) / N)); the
    losses of a few consecutive steps share one all-reduce, started at least lag - lag // 2 steps
    before it is waited (the last stage trails the first by at most half the lag), and flush gives
    the rest."""
    lag, steps, clock, works = max(1, -(-(d - 1) // n)), 40, [0], []

    def all_reduce(losses: torch.Tensor) -> _Work:
        works.append(_Work(clock[0], clock))
        return works[-1]

    late = LateLosses(d, all_reduce)
    for t in range(steps):
        clock[0] = t
        late.add(t, torch.tensor(float(t)), n)
        loss, at = late.report(t, n)
        assert at == max(0, t - lag) and loss.item() == at
    clock[0] = steps
    rest = late.flush()
    assert [at for at, _ in rest] == list(range(steps - lag, steps)) and [x.item() for _, x in rest] == [float(a) for a, _ in rest]
    per = max(1, lag // 2)
    assert late.reductions == len(works) == 1 + -(-(steps - 1) // per)
    assert all(w.waited is not None for w in works)
    assert all(w.waited - w.started >= lag - per for w in works[1:] if w.waited < steps)


@pytest.mark.parametrize("call, fragment", [
    (lambda: build_schedule("pipedream_2bw", 4, 3), "N ≥ D"),
    (lambda: build_schedule("pipedream", 4, 2), "N must be 1"),
    (lambda: window("pipedream", 4, 1, -1), "step must be a non-negative integer"),
    (lambda: weight_delay("gpipe", 0, 2), "unknown asynchronous schedule"),
])
def test_bad_settings_raise(call, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call()


def test_a_backward_uses_its_forwards_version_after_the_update() -> None:
    """Weight stashing in one process: forward on version 0, update the live weights, backward:
    the gradient is the one at version 0's weights, and the live parameters got none."""
    from pipeline_recipes.strategies.runtime.versions import WeightVersions

    layer = torch.nn.Linear(3, 1, bias=False)
    versions = WeightVersions("pipedream_2bw", 1, {0: [layer]})
    x = torch.ones(2, 3)
    versions.begin_step(0)
    with versions.forward_weights(0):
        out = layer(x).square().sum()
    before = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.add_(1.0)  # the optimizer moved on
    out.backward()
    expected = 2 * (x @ before.T).sum() * torch.ones(1, 3) * 1.0  # d/dw sum((xw)^2) over 2 equal rows
    assert layer.weight.grad is None
    assert torch.allclose(versions.versions[0][0][id(layer.weight)].grad, expected)


# -- runtime against the update rule (gloo) ----------------------------------------------------------

def _reference(name: str, model: ToyMLP, D: int, batches: list[dict],
               clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The asynchronous update rule in one process (same optimizer, same data); ``clip``: each
    stage's due gradient scaled to at most that norm on its own (tied parameters as one group)."""
    from pipeline_recipes.strategies.runtime.engine import even_partition
    from pipeline_recipes.core.pipeline_model import sequential_loss

    delay_of: dict[int, int] = {}  # a parameter on several stages (tied) takes the largest delay
    stages_of: dict[int, set[int]] = {}
    for s, r in enumerate(even_partition(len(model.layers), D)):
        for p in (p for i in r for p in model.layers[i].parameters()):
            delay_of[id(p)] = max(delay_of.get(id(p), 0), weight_delay(name, s, D))
            stages_of.setdefault(id(p), set()).add(s)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    grads: list[list[torch.Tensor]] = []
    losses = []
    for t, batch in enumerate(batches):
        opt.zero_grad()
        loss = sequential_loss(model, batch)
        losses.append(loss.item())
        grads.append([g.detach().clone() for g in torch.autograd.grad(loss, params)])
        for i, p in enumerate(params):
            due = t - delay_of[id(p)]
            p.grad = grads[due][i].clone() if due >= 0 else None
        if clip is not None:
            groups: dict[object, list[torch.Tensor]] = {}
            for p in params:
                if p.grad is not None:
                    key = "tied" if len(stages_of[id(p)]) > 1 else min(stages_of[id(p)])
                    groups.setdefault(key, []).append(p.grad)
            for grads_of_group in groups.values():
                norm = torch.stack([g.square().sum() for g in grads_of_group]).sum().sqrt()
                for g in grads_of_group:
                    g.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _pipeline_vs_rule(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    out = []
    for case in cases:
        name, D, N, steps = case["schedule"], case["D"], case["N"], case["steps"]
        W = world // D
        model = ToyMLP(layers=8, tied=case.get("tied", False))
        batches = toy_batches(steps, W * N * B)
        if case.get("repeat"):  # one mini-batch over and over: the loss must fall (convergence)
            batches = [batches[0]] * steps
        ref_losses, ref_params = _reference(name, copy.deepcopy(model), D, batches, case.get("clip"))
        names = {id(p): n for n, p in model.named_parameters()}
        engine = build_engine(model, derive_layout(name, W * D, D, W * N * B, B=B), torch.device("cpu"), timeout_s=30.0)
        opt = torch.optim.SGD(engine.local_parameters(), lr=LR, momentum=MOMENTUM)
        replica = engine.topology.replica_of(rank)
        losses: dict[int, float] = {}  # by step: the loss comes one step late (no per-step line-up)
        stashed, reported = [], []
        for batch in batches:
            mine = {k: v[replica * N * B:(replica + 1) * N * B] for k, v in batch.items()}
            opt.zero_grad()
            losses[engine.steps_taken] = float("nan")
            value = engine.train_step(mine).item()
            reported.append(engine.loss_step)
            losses[engine.loss_step] = value
            if case.get("clip"):
                engine.clip_grad_norm_(case["clip"])
            opt.step()
            if case.get("eval"):  # a forward-only pass between steps leaves the stream in flight untouched
                engine.eval_step(mine)
            stashed.append(1 + max(engine.versions.in_memory(s) for s in engine.local_stages))  # + live
        for at, value in engine.flush_losses():  # the last steps' losses, waited for at the end
            losses[at] = value.item()
        lag = max(1, -(-(D - 1) // N))  # the first step reports its own, step t reports t - lag
        assert reported == [max(0, t - lag) for t in range(len(batches))], reported
        err = max((p.detach() - ref_params[names[id(p)]]).abs().max().item() for p in engine.local_parameters())
        out.append({**case, "err": err, "losses": [losses[t] for t in range(len(batches))], "ref_losses": ref_losses,
                    "stashed": max(stashed)})
        dist.barrier()
    return out


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            label = f"{r['schedule']} D={r['D']} N={r['N']}"
            assert r["err"] < 1e-5, f"{label}: parameters differ from the update rule by {r['err']:.2e}"
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), label
            if r.get("repeat"):
                assert r["losses"][-1] < 0.9 * r["losses"][0], f"{label}: did not train: {r['losses']}"


@pytest.mark.slow
def test_async_pipelines_follow_their_update_rule_on_four_ranks() -> None:
    """W = 1 × D = 4 and W = 2 × D = 2, for 8 steps (past the warm-up, with delayed updates): every
    asynchronous schedule of the registry (tests/support/schedule_grids.py), then weight tying, clipping and
    convergence on PipeDream-2BW and PipeDream."""
    cases = async_equivalence_cases(steps=8) + [  # every asynchronous schedule of the registry, then options
        {"schedule": "pipedream_2bw", "D": 4, "N": 5, "steps": 8, "eval": True},
        {"schedule": "pipedream", "D": 4, "N": 1, "steps": 8, "tied": True},
        {"schedule": "pipedream_2bw", "D": 4, "N": 4, "steps": 6, "tied": True},
        {"schedule": "pipedream_2bw", "D": 4, "N": 4, "steps": 6, "tied": True, "clip": 0.05},
        {"schedule": "pipedream", "D": 2, "N": 1, "steps": 6, "clip": 0.05},
        {"schedule": "pipedream_2bw", "D": 4, "N": 4, "steps": 30, "repeat": True},
        {"schedule": "pipedream", "D": 4, "N": 1, "steps": 30, "repeat": True},
    ]
    results = run_world(4, _pipeline_vs_rule, cases)
    _check(results)
    by_rank0 = {(r["schedule"], r["D"], r["N"]): r["stashed"] for r in results[0]}
    assert by_rank0[("pipedream", 4, 1)] == 4  # stage 0 keeps D versions
    assert by_rank0[("pipedream_2bw", 4, 4)] == 2
