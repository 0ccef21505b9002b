"""Pipeline schedules as data: generate, validate, simulate (no torch.distributed).

:mod:`.registry` describes every schedule once (name, generator, layout rules, asynchronous or not,
stages per worker, pipelines, planner variants); everything that lists or checks schedules reads it.
:mod:`.derivation` derives a run's layout from its settings (:func:`derive_layout`), the one place W, B, N and S
are worked out.
"""

from pipeline_recipes.strategies.schedules.actions import Action, Schedule, parse_action
from pipeline_recipes.strategies.schedules.generators import best_concat, chimera, chimera_placement, concat_choices, dapple, gems, gpipe
from pipeline_recipes.strategies.schedules.graph import ActionIndex, dependencies, index_actions
from pipeline_recipes.strategies.schedules.grid import format_grid
from pipeline_recipes.strategies.schedules.registry import (
    DEFAULT_SCHEDULE, SCHEDULES, ScheduleError, ScheduleSpec, build_schedule, get_spec, names, register,
    resolve_concat, specs,
)
from pipeline_recipes.strategies.schedules.rules import AUTO_CONCAT, CLI, CONCAT_METHODS, CONFIG, Naming, Settings
from pipeline_recipes.strategies.schedules.derivation import LayoutRefusal, derive_layout, derive_sizes, layout_of
from pipeline_recipes.strategies.schedules.simulate import DeadlockError, Simulation, TimedAction, peak_activations, simulate, slots_needed
from pipeline_recipes.strategies.schedules.validate import validate

__all__ = [
    "AUTO_CONCAT", "ActionIndex", "CLI", "CONCAT_METHODS", "CONFIG", "DEFAULT_SCHEDULE", "SCHEDULES", "Action",
    "DeadlockError", "LayoutRefusal", "Naming", "derive_layout", "derive_sizes", "layout_of",
    "Schedule", "ScheduleError", "ScheduleSpec", "Settings", "Simulation", "TimedAction", "best_concat",
    "build_schedule", "chimera", "chimera_placement", "concat_choices", "dapple", "dependencies", "format_grid",
    "gems", "get_spec", "gpipe", "index_actions", "names", "parse_action", "peak_activations", "register",
    "resolve_concat", "simulate", "slots_needed", "specs", "validate",
]
