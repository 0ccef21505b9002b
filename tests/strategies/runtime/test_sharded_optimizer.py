"""Optimizer state sharded across a stage's copies (``strategy.shard_optimizer``) changes memory, not training: per-step
losses and parameters equal the unsharded run's (fp32, 1e-6) for every synchronous schedule at D = 2, W = 2 and
Chimera at D = 4, W = 2, with AdamW's weight-decay groups, an LR schedule, clipping by the global norm and tied
weights; a rank's optimizer state is the unsharded figure over its copies (ZeRO §5.1's P_os), counted tensor by
tensor."""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_world
from layouts import pipeline_layout
from schedule_grids import synchronous, valid
from toy_model import ToyMLP, toy_batches

STEPS, B, LR, CLIP = 4, 2, 0.05, 0.5


def _train(rank: int, case: dict, shard: bool, width: int = 8) -> dict:
    """One run of ``case``: per-step losses, the parameters after the last step (by name), optimizer state bytes."""
    import torch.distributed as dist

    from pipeline_recipes.strategies.lightning.optim import linear, param_groups
    from pipeline_recipes.strategies.runtime.engine import build_engine

    D, N, W = case["D"], case["N"], case["W"]
    model = ToyMLP(layers=case.get("layers", 8), width=width, tied=case.get("tied", False))
    names = {id(p): n for n, p in model.named_parameters()}  # before remote layers are dropped
    settings = {k: case[k] for k in ("pipelines", "concat", "chunks", "grad_sync") if k in case}
    layout = pipeline_layout(case["schedule"], D, B, N, W, shard_optimizer=shard, **settings)
    engine = build_engine(model, layout, torch.device("cpu"), timeout_s=30.0)
    groups = param_groups(model, weight_decay=0.1)
    local = {id(p) for p in engine.local_parameters()}
    groups = [{**g, "params": [p for p in g["params"] if id(p) in local]} for g in groups]
    optimizer = engine.build_optimizer(lambda gs: torch.optim.AdamW(gs, lr=LR), groups)
    scheduler = linear(optimizer, warmup_steps=1, total_steps=STEPS)
    replica = engine.topology.replica_of(rank)
    losses = []
    for step, batch in enumerate(toy_batches(STEPS, W * N * B, width=width)):
        mine = {k: v[replica * N * B:(replica + 1) * N * B] for k, v in batch.items()}
        losses.append(engine.train_step(mine).item())
        if step == case.get("skip"):  # what nonfinite_loss=skip does with a step's gradients
            engine.drop_gradients()
        engine.clip_grad_norm_(CLIP)
        optimizer.step()
        scheduler.step()
    state = sum(t.numel() * t.element_size() for entry in optimizer.state.values() for t in entry.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    dist.barrier()
    return {"losses": losses, "state_bytes": state,
            "params": {names[id(p)]: p.detach().clone() for p in engine.local_parameters()}}


def _sharded_vs_whole(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        whole, sharded = _train(rank, case, False), _train(rank, case, True)
        err = max((sharded["params"][n] - p).abs().max().item() for n, p in whole["params"].items())
        out.append({"case": case, "param_err": err, "losses": sharded["losses"], "whole_losses": whole["losses"]})
    return out


def _cases(D: int, W: int) -> list[dict]:
    """Every synchronous schedule of the registry at its least valid N ≥ D (tied weights, both sync modes)."""
    out = []
    for spec in synchronous():
        n = next((n for n in range(D, 4 * D + 1) if valid(spec, D, n)), None)
        if n is None:
            continue
        out.append({"schedule": spec.name, "D": D, "N": n, "W": W, "tied": True})
    out.append({"schedule": "dapple", "D": D, "N": D, "W": W, "grad_sync": "eager", "skip": 1})
    out.append({"schedule": "chimera", "D": D, "N": 2 * D, "W": W, "grad_sync": "eager_opt"})
    return out


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            assert r["param_err"] < 1e-6, f"{r['case']}: parameters differ by {r['param_err']:.2e}"
            assert r["losses"] == pytest.approx(r["whole_losses"], abs=1e-6), r["case"]


@pytest.mark.slow
def test_sharded_optimizer_equals_unsharded_for_every_synchronous_schedule() -> None:
    """D = 2, W = 2: every synchronous schedule of the registry, tied weights, eager gradient sync, a skipped
    update (``nonfinite_loss=skip``)."""
    cases = _cases(2, 2)
    assert {c["schedule"] for c in cases} >= {"gpipe", "dapple", "chimera", "gems"}
    _check(run_world(4, _sharded_vs_whole, cases))


@pytest.mark.slow
def test_sharded_chimera_equals_unsharded_at_four_stages() -> None:
    """Chimera at D = 4, W = 2: 8 ranks, each stage in 4 copies (2 pipelines × 2 replicas)."""
    cases = [{"schedule": "chimera", "D": 4, "N": 4, "W": 2, "tied": True},
             {"schedule": "chimera", "D": 4, "N": 8, "W": 2, "concat": "forward_doubling"}]
    _check(run_world(8, _sharded_vs_whole, cases))


def _state_ratio(rank: int, world: int, cases: list[dict]) -> list[float]:
    return [_train(rank, case, True, width=64)["state_bytes"] / _train(rank, case, False, width=64)["state_bytes"]
            for case in cases]


def test_sharded_state_is_the_unsharded_over_the_copies() -> None:
    """A rank's Adam state, sharded, is its unsharded state over the copies of its stages plus padding (less than one
    element per copy and bucket): Chimera D = 2, W = 2 keeps 4 copies of each stage (≤ 0.30×), DAPPLE 2 (≤ 0.55×)."""
    ratios = run_world(4, _state_ratio, [{"schedule": "chimera", "D": 2, "N": 2, "W": 2, "tied": True},
                                         {"schedule": "dapple", "D": 2, "N": 2, "W": 2}])
    for rank, (chimera, dapple) in enumerate(ratios):
        assert math.isclose(chimera, 1 / 4, abs_tol=0.01) and chimera <= 0.30, (rank, chimera)
        assert math.isclose(dapple, 1 / 2, abs_tol=0.01) and dapple <= 0.55, (rank, dapple)
