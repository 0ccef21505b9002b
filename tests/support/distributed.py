"""Run a function on N local CPU processes over gloo (tests use the package's spawn helper)."""

from __future__ import annotations

from pipeline_recipes.strategies.harness.spawn import WorldError, free_port, run_world

__all__ = ["WorldError", "free_port", "run_world"]
