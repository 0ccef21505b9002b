"""Why a plan wins: each best layout's predicted step split into compute, bubble, messages and unhidden collectives,
and its fullest rank's peak into weights, gradients, optimizer state and activations. Expected figures by hand from
the synthetic costs (layer times, parameter counts, message sizes) and the schedules' textbook bubbles."""

from __future__ import annotations

import pytest

from pipeline_recipes.planner.costs import AlphaBeta
from pipeline_recipes.planner.memory import Budget
from pipeline_recipes.planner.model_costs import CommCosts, uniform_costs
from pipeline_recipes.planner.predict import Candidate, predict_time, time_split
from pipeline_recipes.planner.recommend import best_per_schedule, plan_all

PARAMS = 1000  # fp32 parameters per layer


def _costs(p2p_s: float = 0.0, allreduce_beta: float = 0.0):
    comm = CommCosts(AlphaBeta(p2p_s, 0.0), AlphaBeta(0.0, allreduce_beta))
    return uniform_costs(8, t_f=1.0, t_b=2.0, params=PARAMS, comm=comm)


@pytest.mark.parametrize("name, W, D, N", [("gpipe", 1, 4, 4), ("dapple", 2, 4, 8), ("chimera", 1, 4, 4),
                                          ("zbv", 1, 2, 4), ("pipedream_2bw", 1, 4, 4), ("chimera", 2, 2, 4)])
def test_the_step_and_the_peak_split_into_parts_that_sum_to_them(name: str, W: int, D: int, N: int) -> None:
    costs = _costs(p2p_s=0.05, allreduce_beta=1e-4)
    plans = plan_all(costs, W * D, W * N, Budget(per_rank=10**12), schedules=[name], recompute=["none"],
                     shard_optimizer=[False], workers=1)
    best = best_per_schedule(plans, costs)[name]
    assert sum(best["time_split"].values()) == pytest.approx(best["step_s"], rel=1e-12)
    assert all(v >= 0 for v in best["time_split"].values()), best["time_split"]
    assert sum(best["memory_split"].values()) == pytest.approx(best["peak_bytes"], abs=1)
    assert all(v >= 0 for v in best["memory_split"].values()), best["memory_split"]


def test_gpipe_without_messages_or_copies_is_its_textbook_bubble() -> None:
    """GPipe, D = 4, N = 4, 2 layers per stage: t_f = 2, t_b = 4 per stage; the step is (N + D − 1)·6 = 42 s of which
    N·6 = 24 compute and (D − 1)·6 = 18 bubble (GPipe §2.3); no messages, no copies to synchronise."""
    costs = _costs()
    cand = Candidate.of("gpipe", 1, 4, 1, 4)
    split = time_split(costs, cand, predict_time(costs, cand))
    assert split["bubble_s"] == pytest.approx(18.0, rel=1e-6)
    assert split["p2p_s"] == 0.0 and split["allreduce_s"] == pytest.approx(0.0, abs=1e-9)
    assert split["compute_s"] == pytest.approx(24.0, rel=1e-3)  # plus AdamW's step and the runtime's fixed cost


def test_messages_show_up_as_p2p_and_replicas_as_allreduce() -> None:
    """Each message costs 0.05 s: the step grows by what the messages add on the critical path, and that is p2p_s;
    two replicas add an all-reduce of each stage's 2·1000·4 bytes, not hidden at grad_sync=end."""
    free, priced = _costs(allreduce_beta=1e-4), _costs(p2p_s=0.05, allreduce_beta=1e-4)
    one = Candidate.of("dapple", 1, 4, 1, 4)
    added = predict_time(priced, one).iteration_s - predict_time(free, one).iteration_s
    assert time_split(priced, one, predict_time(priced, one))["p2p_s"] == pytest.approx(added, rel=1e-6)
    two = Candidate.of("dapple", 2, 4, 1, 4)
    split = time_split(priced, two, predict_time(priced, two))
    assert split["allreduce_s"] == pytest.approx(predict_time(priced, two).sync_s, rel=1e-6) and split["allreduce_s"] > 0


def test_the_memory_split_counts_a_stage_s_weights_gradients_and_moments() -> None:
    """DAPPLE W = 2, D = 4: each rank holds 2 layers of 1000 fp32 parameters: 8000 bytes of weights, as many of
    gradients, twice that of AdamW moments; sharded over the 2 replicas, half the moments."""
    costs = _costs()
    for shard, moments in ((False, 16000.0), (True, 8000.0)):
        plans = plan_all(costs, 8, 8, Budget(per_rank=10**12), schedules=["dapple"], recompute=["none"],
                         shard_optimizer=[shard], workers=1)
        split = best_per_schedule([p for p in plans if p.candidate.D == 4], costs)["dapple"]["memory_split"]
        assert (split["weights"], split["gradients"], split["optimizer"]) == (8000.0, 8000.0, moments)
