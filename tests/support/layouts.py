"""Layouts for tests that build engines and strategies directly: derived as the launcher derives them
(:func:`pipeline_recipes.strategies.schedules.derive_layout`), never written by hand."""

from __future__ import annotations

from typing import Any

from pipeline_recipes.core.layout import Layout
from pipeline_recipes.strategies.schedules import derive_layout


def pipeline_layout(schedule: str, D: int, B: int, N: int, W: int = 1, **settings: Any) -> Layout:
    """W replicas × D workers of ``schedule``, B samples per micro-batch, N micro-batches per step; ``settings``:
    the schedule's others (pipelines, concat, chunks, grad_sync, recompute, cuda_graphs)."""
    return derive_layout(schedule, W * D, D, W * B * N, B=B, **settings)
