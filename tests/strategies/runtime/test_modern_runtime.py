"""Correct means equivalent, for the schedules after Chimera: interleaved 1F1B, ZB-H1, ZB-H2, ZBV,
DualPipeV and Chimera + zero bubble run on gloo and equal single-process mini-batch SGD.

They exercise what the older schedules do not: several stages per worker (loop and V placement),
activations and gradients handed over locally between a worker's consecutive stages, backwards split
into input-gradient and weight-gradient passes, and overlapped pairs. The reference is the unsplit
model trained in one process (the same worker as tests/strategies/runtime/test_runtime_equivalence.py, whose grid runs
every schedule of the registry); the cases here pin options to placements: tied weights across the V's
two ends, recomputation of split backwards, three chunks, eager gradient sync with replicas.
"""

from __future__ import annotations

import pytest

from distributed import run_world
from test_runtime_equivalence import _check, _pipeline_vs_reference

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
    _check(results)
    # the placement really gave a worker several stages (loop: s, s + P, …; V: w, 2P − 1 − w)
    here = [r["stages_here"] for r in results[0]]
    assert (here[0], here[1], here[6], here[8]) == ([0, 4], [0, 2, 4], [0, 7], [0, 7])
