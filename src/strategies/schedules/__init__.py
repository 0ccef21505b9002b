"""Pipeline schedules as data: generate, validate, simulate (no torch.distributed)."""

from .actions import Action, Schedule, parse_action
from .asynchronous import ASYNC_SCHEDULES
from .generators import (
    AUTO_CONCAT, CONCAT_METHODS, SCHEDULES, best_concat, build_schedule, chimera, chimera_placement, concat_choices,
    dapple, gems, gpipe, resolve_concat,
)
from .graph import ActionIndex, dependencies, index_actions
from .grid import format_grid
from .simulate import DeadlockError, Simulation, TimedAction, peak_activations, simulate
from .validate import validate

__all__ = [
    "ASYNC_SCHEDULES", "AUTO_CONCAT", "ActionIndex", "CONCAT_METHODS", "SCHEDULES", "Action", "DeadlockError", "Schedule",
    "Simulation", "TimedAction", "best_concat", "build_schedule", "chimera", "chimera_placement", "concat_choices",
    "dapple", "dependencies", "format_grid", "index_actions", "gems", "gpipe", "parse_action", "peak_activations",
    "resolve_concat", "simulate", "validate",
]
