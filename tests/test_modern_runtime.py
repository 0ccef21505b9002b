"""Correct means equivalent, for the schedules after Chimera: interleaved 1F1B, ZB-H1, ZB-H2, ZBV,
DualPipeV and Chimera + zero bubble run on gloo and equal single-process mini-batch SGD.

They exercise what the older schedules do not: several stages per worker (loop and V placement),
activations and gradients handed over locally between a worker's consecutive stages, backwards split
into input-gradient and weight-gradient passes, and overlapped pairs. The reference is the unsplit
model trained in one process (:func:`toy_model.train_sgd`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_world
from toy_model import ToyMLP, toy_batches, train_sgd

STEPS, B, LR = 3, 2, 0.05


def _pipeline_vs_reference(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    from strategies.engine import PipelineConfig, PipelineEngine
    from strategies.pipeline_model import sequential_loss

    out = []
    for case in cases:
        D, N = case["D"], case["N"]
        W = world // D
        model = ToyMLP(layers=case.get("layers", 8), tied=case.get("tied", False))
        reference = copy.deepcopy(model)
        batches = toy_batches(STEPS, W * N * B)
        ref_losses, ref_params = train_sgd(reference, lambda batch: sequential_loss(reference, batch), batches, LR)
        names = {id(p): n for n, p in model.named_parameters()}  # before remote layers are dropped
        config = PipelineConfig(case["schedule"], D, B, timeout_s=30.0, chunks=case.get("chunks"),
                                grad_sync=case.get("grad_sync", "end"), recompute=case.get("recompute", "none"))
        engine = PipelineEngine(model, config, W, torch.device("cpu"))
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


CASES = [
    # W = 1 × P = 4 and W = 2 × P = 2; N below, at and above P; tied weights across the V's two ends
    {"schedule": "interleaved_1f1b", "D": 4, "N": 4, "chunks": 2},
    {"schedule": "interleaved_1f1b", "D": 2, "N": 6, "chunks": 3, "layers": 6, "grad_sync": "eager"},
    {"schedule": "zb_h1", "D": 4, "N": 5},
    {"schedule": "zb_h1", "D": 2, "N": 3, "recompute": "always"},
    {"schedule": "zb_h2", "D": 4, "N": 8},
    {"schedule": "zb_h2", "D": 2, "N": 1},
    {"schedule": "zbv", "D": 4, "N": 8, "tied": True},
    {"schedule": "zbv", "D": 2, "N": 3, "recompute": "except_last", "grad_sync": "eager_opt"},
    {"schedule": "dualpipev", "D": 4, "N": 8},
    {"schedule": "dualpipev", "D": 2, "N": 5, "tied": True},
    {"schedule": "chimera_zb", "D": 4, "N": 4},
    {"schedule": "chimera_zb", "D": 2, "N": 6, "tied": True},
]


@pytest.mark.slow
def test_modern_schedules_equal_single_process_on_four_ranks() -> None:
    results = run_world(4, _pipeline_vs_reference, CASES)
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            label = {k: r[k] for k in r if k not in ("param_err", "losses", "ref_losses", "stages_here")}
            assert r["param_err"] < 1e-5, f"rank {rank} {label}: parameters differ by {r['param_err']:.2e}"
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), label
    # the placement really gave a worker several stages (loop: s, s + P; V: w, 2P − 1 − w)
    by_case = {i: results[0][i]["stages_here"] for i in range(len(CASES))}
    assert by_case[0] == [0, 4] and by_case[6] == [0, 7] and by_case[8] == [0, 7]
    assert by_case[1] == [0, 2, 4]
