"""Pipeline schedules as data: generate, validate, simulate (no torch.distributed)."""

from .actions import Action, Schedule, parse_action
from .asynchronous import ASYNC_SCHEDULES
from .generators import CONCAT_METHODS, SCHEDULES, build_schedule, chimera, chimera_placement, dapple, gems, gpipe
from .graph import dependencies, forward_index
from .grid import format_grid
from .simulate import DeadlockError, Simulation, TimedAction, peak_activations, simulate
from .validate import validate

__all__ = [
    "ASYNC_SCHEDULES", "CONCAT_METHODS", "SCHEDULES", "Action", "DeadlockError", "Schedule", "Simulation", "TimedAction",
    "build_schedule", "chimera", "chimera_placement", "dapple", "dependencies", "format_grid",
    "forward_index", "gems", "gpipe", "parse_action", "peak_activations", "simulate", "validate",
]
