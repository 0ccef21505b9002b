"""Planner (Chimera §3.4, CAPTURE): predict iteration time and memory, recommend W / D / B and the partition.

Chimera §3.4's performance model with measured costs, and CAPTURE's profiling-based memory
prediction and partition recommendation, for this repository's schedules and runtime::

    costs = load_or_profile(cfg.model)                       # planner.profile (+ planner.comm_profile), cached
    plans = plan_all(costs, devices=8, global_batch_size=64, budget=device_budget("cpu"))
    best_config(costs, 8, 64, budget)                        # -> Hydra overrides for train.py
    recommend_partition(costs, plans[0].candidate, "memory") # -> layers per stage
    preflight(cfg_dict, layout)                              # raises PreflightError if it cannot fit

Modules: :mod:`.costs` (formulas), :mod:`.model_costs` (the data), :mod:`.profile` / :mod:`.comm_profile`
(measurements), :mod:`.estimate` (fake-tensor estimate), :mod:`.predict` (time), :mod:`.memory`
(memory, budgets), :mod:`.sharding` (a sharded optimizer state's memory and collectives), :mod:`.partition_search`,
:mod:`.recommend`, :mod:`.preflight`.
Names are imported lazily, so ``pipeline_recipes.planner.costs`` stays pure Python.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlphaBeta": "costs", "LinearFit": "costs", "fit_line": "costs", "rabenseifner": "costs",
    "CommCosts": "model_costs", "LayerCosts": "model_costs", "ModelCosts": "model_costs",
    "load_or_profile": "profile", "profile_model": "profile", "measure_comm": "comm_profile",
    "estimate_costs": "estimate",
    "Candidate": "predict", "candidates": "predict", "predict_time": "predict",
    "Budget": "memory", "device_budget": "memory", "predict_memory": "memory",
    "recommend_partition": "partition_search",
    "Plan": "recommend", "best_config": "recommend", "plan_all": "recommend", "plan_rows": "recommend",
    "PreflightError": "preflight", "preflight": "preflight",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
