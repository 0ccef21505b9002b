"""The engine's set-up picks one step object per kind of schedule, and no step asks which kind runs.

``build_engine(model, layout, device)`` (:func:`pipeline_recipes.strategies.runtime.engine.build_engine`)
assembles a rank's share of the pipeline once and returns a
:class:`~pipeline_recipes.strategies.runtime.engine.SynchronousStep` or an
:class:`~pipeline_recipes.strategies.runtime.engine.AsynchronousStep`; what only an asynchronous schedule needs (stashed
weight versions, windows, late losses) lives on the latter alone. Each engine is built on rank 0 of torch's ``fake``
backend (no peers: the set-up's collectives return at once), for every schedule of the registry.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipeline_recipes.strategies.runtime import engine as engine_module
from pipeline_recipes.strategies.runtime.engine import (
    AsynchronousStep, PipelineEngine, SynchronousStep, build_engine,
)
from pipeline_recipes.strategies.schedules import derive_layout
from pipeline_recipes.strategies.schedules.registry import ScheduleSpec, specs
from schedule_grids import valid
from toy_model import ToyMLP

ASYNC_ONLY = ("versions", "windows", "late_losses")  # the asynchronous step's own collaborators


def _build(spec: ScheduleSpec) -> PipelineEngine:
    D = next(d for d in range(2, 9) if valid(spec, d, None))
    layout = derive_layout(spec, D, D, spec.smallest_micro_batches(D), B=1)
    dist.init_process_group("fake", rank=0, world_size=D, store=FakeStore())
    try:
        return build_engine(ToyMLP(layers=max(layout.stages, 4)), layout, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_the_set_up_returns_the_step_of_the_schedules_kind(spec: ScheduleSpec) -> None:
    engine = _build(spec)
    assert isinstance(engine, PipelineEngine)
    assert type(engine) is (AsynchronousStep if spec.asynchronous else SynchronousStep)
    assert {name for name in ASYNC_ONLY if hasattr(engine, name)} == (set(ASYNC_ONLY) if spec.asynchronous else set())
    # forwards run on stashed weights exactly under an asynchronous schedule
    versions = {id(stage.versions) for stage in engine.executor.stages.values()}
    assert versions == {id(engine.versions) if spec.asynchronous else id(None)}


def test_no_step_reads_the_schedules_kind() -> None:
    """``is_async`` is read by the set-up alone; the asynchronous collaborators are named only in their step."""
    tree = ast.parse(inspect.getsource(engine_module))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for name in ("PipelineEngine", "SynchronousStep", "AsynchronousStep"):
        attributes = {node.attr for node in ast.walk(classes[name]) if isinstance(node, ast.Attribute)}
        assert "is_async" not in attributes, name
        if name != "AsynchronousStep":
            assert not attributes & set(ASYNC_ONLY), name
