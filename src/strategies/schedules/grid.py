"""Worker × step text grid of a schedule, with faulty cells marked (used in error messages)."""

from __future__ import annotations

from collections.abc import Iterable

from pipeline_recipes.strategies.schedules.actions import Schedule


def format_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """Rows are workers, columns are steps (position in the worker's order); ``>x<`` marks a fault."""
    marked = set(marks)
    cells = [
        [f">{a}<" if (w, i) in marked else str(a) for i, a in enumerate(acts)]
        for w, acts in enumerate(schedule.workers)
    ]
    steps = max((len(r) for r in cells), default=0)
    width = max([len(c) for r in cells for c in r] + [len(str(steps - 1)) if steps else 1])
    header = "step " + " ".join(str(i).rjust(width) for i in range(steps))
    lines = [header]
    for w, row in enumerate(cells):
        lines.append(f"P{w:<3} " + " ".join(c.rjust(width) for c in row))
    return "\n".join(lines)
