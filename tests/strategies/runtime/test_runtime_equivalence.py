"""Correct means equivalent: pipeline steps on gloo equal single-process mini-batch SGD, for every
synchronous schedule of the registry (the grid: tests/support/schedule_grids.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_world
from layouts import pipeline_layout
from schedule_grids import equivalence_cases
from toy_model import ToyMLP, toy_batches, train_sgd

STEPS, B, LR = 3, 2, 0.05


def _reference(model: ToyMLP, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    from pipeline_recipes.core.pipeline_model import sequential_loss

    return train_sgd(model, lambda batch: sequential_loss(model, batch), batches, LR)


def _pipeline_vs_reference(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    from pipeline_recipes.strategies.runtime.engine import build_engine

    out = []
    for case in cases:
        D, N = case["D"], case["N"]
        W = world // D
        model = ToyMLP(layers=case.get("layers", 8), tied=case.get("tied", False))
        reference = copy.deepcopy(model)
        batches = toy_batches(STEPS, W * N * B)
        ref_losses, ref_params = _reference(reference, batches)
        names = {id(p): n for n, p in model.named_parameters()}  # before remote layers are dropped
        layout = pipeline_layout(case["schedule"], D, B, N, W, pipelines=case.get("pipelines"),
                                 concat=case.get("concat", "direct"), grad_sync=case.get("grad_sync", "end"),
                                 recompute=case.get("recompute", "none"), chunks=case.get("chunks"))
        engine = build_engine(model, layout, torch.device("cpu"), timeout_s=30.0)
        opt = torch.optim.SGD(engine.local_parameters(), lr=LR, momentum=0.9)
        replica = engine.topology.replica_of(rank)
        losses = []
        for batch in batches:
            mine = {k: v[replica * N * B:(replica + 1) * N * B] for k, v in batch.items()}
            losses.append(engine.train_step(mine).item())
            opt.step()
        err = max((p.detach() - ref_params[names[id(p)]]).abs().max().item() for p in engine.local_parameters())
        out.append({**case, "param_err": err, "losses": losses, "ref_losses": ref_losses,
                    "stages_here": sorted(engine.local_stages)})
        dist.barrier()
    return out


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            label = {k: r[k] for k in r if k not in ("param_err", "losses", "ref_losses", "stages_here")}
            assert r["param_err"] < 1e-5, f"{label}: parameters differ by {r['param_err']:.2e}"
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), label


@pytest.mark.slow
def test_every_schedule_equals_single_process_on_two_ranks() -> None:
    """Every synchronous schedule of the registry at D = 2, N = D."""
    _check(run_world(2, _pipeline_vs_reference, equivalence_cases(2, 2, (2,))))


@pytest.mark.slow
def test_every_schedule_equals_single_process_on_four_ranks() -> None:
    """Every synchronous schedule of the registry at W = 1 × D = 4 (N < D and N > D) and W = 2 × D = 2
    (N = D), plus Chimera's variants and tied weights."""
    extra = [
        {"schedule": "chimera", "D": 4, "N": 4, "pipelines": 4},
        {"schedule": "chimera", "D": 4, "N": 8, "concat": "forward_doubling"},
        {"schedule": "chimera", "D": 2, "N": 4, "concat": "backward_halving"},
        {"schedule": "chimera", "D": 4, "N": 8, "concat": "auto"},  # the engine resolves it (best_concat)
        {"schedule": "dapple", "D": 4, "N": 4, "tied": True},
        {"schedule": "chimera", "D": 2, "N": 2, "tied": True},
        {"schedule": "gpipe", "D": 4, "N": 3, "layers": 6},
    ]
    grid = equivalence_cases(4, 4, (3, 9)) + equivalence_cases(4, 2, (2,))
    _check(run_world(4, _pipeline_vs_reference, grid + extra))
