"""One layout: the launcher resolves it once, the job file carries it, and a worker's strategy, engine and stage
table read it instead of deriving it again; what a worker observes (the processes that joined, the batch it is given)
is checked against it.

Fast: Hydra's compose API, the engine on rank 0 of torch's ``fake`` backend (no peers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipeline_recipes.core.layout import Layout, LayoutMismatch
from pipeline_recipes.core.node import NodeDevices
from pipeline_recipes.recipe.check.accelerator import resolve_accelerator
from pipeline_recipes.recipe.worker.job_spec import JobSpec
from pipeline_recipes.recipe.check.settings import num_layers, resolve_layout
from pipeline_recipes.strategies.runtime.engine import PipelineConfig, build_engine
from pipeline_recipes.strategies.runtime.topology import Topology
from pipeline_recipes.strategies.schedules import build_schedule, derive_layout
from toy_model import ToyMLP, toy_batches

CONF = Path(__file__).resolve().parents[2] / "conf"


def _layout(*overrides: str) -> tuple[Layout, dict]:
    """The layout as the launcher resolves it on a CPU node, and the job's resolved config."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    trainer = resolve_accelerator(OmegaConf.to_container(cfg.trainer, resolve=True), NodeDevices()).trainer
    layout = resolve_layout(OmegaConf.to_container(cfg.strategy, resolve=True), trainer, cfg.data.global_batch_size,
                            num_layers(cfg.model))
    return layout, OmegaConf.to_container(cfg, resolve=True)


CHIMERA_AUTO = ("strategy=chimera", "strategy.concat=auto", "trainer=cpu", "trainer.devices=4", "strategy.D=4",
                "data.global_batch_size=8", "strategy.grad_sync=eager", "strategy.recompute=except_last")


@pytest.mark.slow
def test_the_layout_holds_what_the_runtime_runs_with() -> None:
    layout, _ = _layout(*CHIMERA_AUTO)
    assert (layout.W, layout.D, layout.B, layout.N, layout.stages) == (1, 4, 1, 8, 4)
    assert (layout.grad_sync, layout.recompute, layout.concat) == ("eager", "except_last", "forward_doubling")
    schedule = build_schedule("chimera", 4, 8, 2, "auto", micro_batch_size=1)
    assert layout.placement == schedule.placement  # Chimera §3.3: stage s on workers s and D − 1 − s
    baseline, _ = _layout("strategy=ddp", "trainer=cpu", "trainer.devices=2")
    assert baseline.placement == () and baseline.grad_sync is None


@pytest.mark.slow
def test_the_job_file_carries_the_layout_unchanged(tmp_path: Path) -> None:
    layout, config = _layout(*CHIMERA_AUTO)
    spec = JobSpec(config, layout, str(tmp_path), "runs")
    assert JobSpec.load(spec.save()).layout == layout
    with pytest.raises(ValueError, match="keys future_key that this version does not know"):
        Layout.from_dict({**layout.as_dict(), "future_key": 1})


@pytest.mark.slow
def test_the_engine_config_and_topology_are_the_layouts() -> None:
    layout, _ = _layout(*CHIMERA_AUTO)
    config = PipelineConfig(layout, timeout_s=30.0)
    assert (config.schedule, config.stages, config.micro_batch_size, config.micro_batches) == ("chimera", 4, 1, 8)
    assert (config.grad_sync, config.recompute, config.concat) == ("eager", "except_last", "forward_doubling")
    schedule = build_schedule("chimera", 4, 8, 2, "auto", micro_batch_size=1)  # concat=auto resolved at N = 8, B = 1
    assert config.build(8).to_json() == schedule.to_json()
    assert Topology.from_layout(layout) == Topology(1, schedule.num_workers, schedule.stages, schedule.placement)
    baseline, _ = _layout("strategy=single", "trainer=cpu", "trainer.devices=1")
    with pytest.raises(ValueError, match="strategy=single is a baseline"):
        PipelineConfig(baseline, timeout_s=30.0)


@pytest.mark.slow
def test_the_strategy_reads_the_layout_and_checks_the_processes_that_joined() -> None:
    from pipeline_recipes.recipe.worker.job import build_strategy
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy

    layout, config = _layout(*CHIMERA_AUTO, "strategy.timeout_s=7", "+strategy.process_group_backend=gloo")
    strategy = build_strategy(config["strategy"], layout)
    assert isinstance(strategy, PipelineStrategy) and strategy.layout == layout
    assert strategy.pipeline_config == PipelineConfig(layout, timeout_s=7.0)
    assert (strategy.W, strategy.D, strategy.S) == (layout.W, layout.D, layout.stages)
    assert strategy.process_group_backend == "gloo"  # a key of Lightning's own, passed on
    with pytest.raises(LayoutMismatch, match=r"W·D = 1·4 = 4 processes but 2 joined"):
        layout.check_world_size(2)
    for baseline in ("single", "ddp"):  # a baseline is built as configured (single's target is a function)
        layout, config = _layout(f"strategy={baseline}", "trainer=cpu", "trainer.devices=1")
        assert not isinstance(build_strategy(config["strategy"], layout), PipelineStrategy)


def test_a_training_batch_of_another_n_than_the_layouts_is_refused() -> None:
    layout = derive_layout("gpipe", 1, 1, 4, B=2)  # N = 2
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        engine = build_engine(ToyMLP(layers=2), layout, torch.device("cpu"))
        with pytest.raises(LayoutMismatch, match=r"makes N = 3 micro-batches of B = 2, but the layout resolved "
                                                 r"before launch has N = 2"):
            engine.split_for_training(toy_batches(1, 6)[0])
        assert len(engine.split_for_training(toy_batches(1, 4)[0])) == 2
        assert len(engine.split(toy_batches(1, 6)[0])) == 3  # evaluation takes any whole number of micro-batches
    finally:
        dist.destroy_process_group()


def test_a_layout_whose_placement_is_not_its_schedules_is_refused() -> None:
    """The engine takes its topology from the layout and checks it against the schedule a step runs: a layout
    written by hand with another placement stops before any process group is made."""
    from dataclasses import replace

    layout = derive_layout("chimera", 2, 2, 2, B=1)
    assert layout.placement == ((0, 1), (1, 0))  # Chimera §3.3: the down pipeline and the up one
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(LayoutMismatch, match=r"placed as \[\[0, 1\], \[1, 0\]\]"):
            build_engine(ToyMLP(layers=2), replace(layout, placement=((0, 1), (0, 1))), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
