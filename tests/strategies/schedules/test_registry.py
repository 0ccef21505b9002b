"""The schedule registry: one description per schedule, read by every place that lists or checks schedules.

A toy schedule registered in a test (nothing else touched) appears in the viewer's choices, the
planner's candidates, the layout check, Lightning's strategy names and the engine; each layout rule's
message names the setting as the user spelled it, its value, the rule and the fix. Pure Python except
the Lightning registration (imports lightning, starts no process).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline_recipes.planner.predict import candidates, default_schedules
from pipeline_recipes.recipe.check.settings import ConfigError, resolve_layout
from pipeline_recipes.strategies.schedules import (
    SCHEDULES, ScheduleError, ScheduleSpec, best_concat, build_schedule, dapple, get_spec, names, specs, validate,
)
from pipeline_recipes.strategies.schedules.registry import Chunks, register
from pipeline_recipes.strategies.schedules.rules import Settings

ROOT = Path(__file__).resolve().parents[3]


def _viewer():
    spec = importlib.util.spec_from_file_location("schedule_viewer_for_registry", ROOT / "scripts" / "schedule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy_generator(stages: int, micro_batches: int):
    return replace(dapple(stages, micro_batches), name="toy")


def _whole_rounds(spec: ScheduleSpec, s: Settings) -> str | None:
    """Toy rule: N is a multiple of D."""
    if s.micro_batches is None or s.micro_batches % s.stages == 0:
        return None
    n = s.naming
    return (f"{spec.name} needs N to be a multiple of D, got N = {s.micro_batches} ({n.micro_batches}) and "
            f"D = {s.stages} ({n.stages}); {n.more_micro_batches}")


TOY = ScheduleSpec("toy", _toy_generator, "Toy: DAPPLE's order under another name", rules=(_whole_rounds,))


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ScheduleSpec:
    monkeypatch.setitem(SCHEDULES, "toy", TOY)
    return TOY


def test_the_registry_lists_every_schedule_once_with_its_properties() -> None:
    """Today's schedules, in the order users see them; one registered later comes after them (:func:`register`
    appends), so adding a schedule needs no edit here."""
    modern = ("interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev", "chimera_zb")
    known = ("gpipe", "dapple", "gems", "chimera", "pipedream_2bw", "pipedream", *modern)
    assert names()[:len(known)] == known and len(set(names())) == len(names())
    assert names(aliases=True)[:len(known) + 1] == ("gpipe", "dapple", "1f1b", "gems", "chimera", "pipedream_2bw",
                                                    "pipedream", *modern)
    assert get_spec("1f1b") is get_spec("dapple")
    assert [s.name for s in specs() if s.asynchronous and s.name in known] == ["pipedream_2bw", "pipedream"]
    assert {s.name: (s.chunks.default, s.chunks.choosable) for s in specs()
            if s.chunks != Chunks(1, False) and s.name in known} == {
        "interleaved_1f1b": (2, True), "zbv": (2, False), "dualpipev": (2, False)}
    assert [s.name for s in specs() if s.concat and s.name in known] == ["chimera", "chimera_zb"]
    assert get_spec("chimera").planner_variants(8, 16, 2) == tuple(
        (p, c) for p in (2, 4, 8) for c in ("direct", "forward_doubling", "backward_halving"))
    assert get_spec("gems").planner_variants(4, 4, 1) == ((2, "direct"),)
    assert default_schedules()[:len(modern) + 4] == ("gpipe", "dapple", "gems", "chimera", *modern)
    with pytest.raises(ScheduleError) as err:
        get_spec("zb_h3")
    assert str(err.value).startswith("unknown schedule 'zb_h3'; choose one of gpipe, dapple (alias 1f1b), gems, "
                                     "chimera, pipedream_2bw, pipedream, " + ", ".join(modern))
    with pytest.raises(ValueError, match=r"already registered"):
        register(replace(TOY, name="gpipe"))
    with pytest.raises(ValueError, match=r"\['1f1b'\] are already registered"):
        register(replace(TOY, aliases=("1f1b",)))


def test_a_registered_spec_reaches_the_viewer_the_planner_the_layout_and_the_engine(
        toy: ScheduleSpec, capsys: pytest.CaptureFixture[str]) -> None:
    viewer = _viewer()
    assert "toy" in viewer.build_parser()._actions[1].choices
    assert viewer.main(["toy", "--stages", "2", "--micro-batches", "4", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["schedule"] == "toy" and shown["stages"] == 2 and len(shown["workers"]) == 2
    assert viewer.main(["toy", "--stages", "2", "--micro-batches", "3"]) == 2
    assert capsys.readouterr().err == ("error: toy needs N to be a multiple of D, got N = 3 (--micro-batches) and "
                                       "D = 2 (--stages); raise --micro-batches\n")

    assert "toy" in default_schedules()
    found = {(c.D, c.N) for c in candidates(4, 8, 6, schedules=["toy"], recompute=["none"])}
    # W·D = 4 and W·B·N = 8 with B a power of two: N = 1, 2, 4 at D = 2 and 1, 2, 4, 8 at D = 4; the toy's rule
    # keeps N a multiple of D (D = 1 is gpipe's alone)
    assert found == {(2, 2), (2, 4), (4, 4), (4, 8)}

    layout = resolve_layout({"schedule": "toy", "D": 2, "micro_batch_size": 1}, {"devices": 2}, 4, num_layers=4)
    assert (layout.strategy, layout.N, layout.pipelines) == ("toy", 4, 1)
    with pytest.raises(ConfigError) as err:
        resolve_layout({"schedule": "toy", "D": 4, "micro_batch_size": 1}, {"devices": 4}, 2, num_layers=4)
    assert str(err.value) == ("toy needs N to be a multiple of D, got N = 2 (data.global_batch_size / "
                              "(W·strategy.micro_batch_size)) and D = 4 (strategy.D); raise data.global_batch_size "
                              "or lower strategy.micro_batch_size")

    from pipeline_recipes.strategies.runtime.engine import PipelineConfig

    config = PipelineConfig(layout)
    assert not config.is_async and toy.smallest_micro_batches(2) == 2 and config.build(4).name == "toy"
    assert layout.placement == ((0, 1),)  # one pipeline, stage s on worker s


def test_a_registered_specs_layout_becomes_a_lightning_strategy(toy: ScheduleSpec) -> None:
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy
    from pipeline_recipes.strategies.schedules import derive_layout

    strategy = PipelineStrategy.from_layout(derive_layout("toy", 4, 2, 8, B=1))
    assert (strategy.pipeline_config.schedule, strategy.W, strategy.D, strategy.layout.N) == ("toy", 2, 2, 4)  # N = 8 / (W·B)
    assert PipelineStrategy.from_layout(derive_layout("1f1b", 4, 4, 4, B=1)).pipeline_config.schedule == "dapple"
    with pytest.raises(ScheduleError, match="unknown schedule 'gpipe2'"):
        derive_layout("gpipe2", 2, 2, 2, B=1)


def test_chunks_reach_a_generator_that_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interleaved schedule is just a spec: ``chunks`` reaches its generator, its minimum is a rule."""
    seen = []

    def interleaved(stages: int, micro_batches: int, chunks: int):
        seen.append(chunks)
        return dapple(stages, micro_batches)

    monkeypatch.setitem(SCHEDULES, "toy_v", ScheduleSpec("toy_v", interleaved, "toy", chunks=Chunks(2, True, 2)))
    build_schedule("toy_v", 2, 2)
    build_schedule("toy_v", 2, 2, chunks=3)
    assert seen == [2, 3]
    with pytest.raises(ScheduleError) as err:
        build_schedule("toy_v", 2, 2, chunks=1)
    assert str(err.value) == "toy_v: chunks = 1 must be an integer ≥ 2 (stages per worker); use chunks = 2"
    with pytest.raises(ScheduleError) as err:  # a one-stage-per-worker schedule now names the one that chooses
        build_schedule("gpipe", 2, 2, chunks=2)
    assert str(err.value) == ("gpipe runs one stage per worker, got chunks = 2; drop chunks, or use a schedule with "
                              "a choice of chunks per worker (interleaved_1f1b, toy_v)")


CONFIG_RULES = [  # (strategy, devices, global batch) -> the problem (setting, values, rule), the fix in words
    ({"name": "chimera", "D": 1}, 1, 4,
     "chimera needs strategy.D to be even (its down and up pipelines merge without conflict, Chimera §3.1), got "
     "strategy.D = 1", "no value of strategy.D passes every check"),
    ({"name": "chimera", "D": 3}, 3, 6,
     "chimera needs strategy.D to be even (its down and up pipelines merge without conflict, Chimera §3.1), got "
     "strategy.D = 3", "no value of strategy.D passes every check"),
    ({"name": "chimera", "D": 3}, 6, 6,
     "chimera needs strategy.D to be even (its down and up pipelines merge without conflict, Chimera §3.1), got "
     "strategy.D = 3", "set strategy.D=2 or strategy.D=6"),
    ({"name": "gems", "D": 5}, 5, 10,
     "gems needs strategy.D to be even (each worker holds one stage of each of its two replicas), got strategy.D = 5",
     "so change something else: set trainer.devices=4 strategy.D=4"),
    ({"name": "chimera", "D": 8, "pipelines": 6}, 8, 8,
     "chimera: strategy.pipelines = 6 must be 2f for a divisor f of D/2 (Chimera §3.6), with strategy.D = 8",
     "set strategy.pipelines to one of [2, 4, 8]"),
    ({"name": "gems", "D": 4, "pipelines": 4}, 4, 8,
     "gems runs exactly 2 pipelines (two opposite replicas), got strategy.pipelines = 4",
     "set strategy.pipelines=null or strategy.pipelines=2"),
    ({"name": "gpipe", "D": 2, "pipelines": 2}, 2, 4,
     "gpipe runs a single pipeline, got strategy.pipelines = 2", "set strategy.pipelines=null or strategy.pipelines=1"),
    ({"name": "chimera", "D": 2, "concat": "tripling"}, 2, 4,
     "chimera: strategy.concat = 'tripling' is not a concatenation method (direct, forward_doubling, "
     "backward_halving or auto (the fastest simulated; Chimera §3.5))",
     "set strategy.concat to one of [direct, forward_doubling, auto]"),
    ({"name": "chimera", "D": 2, "concat": "forward_dubling"}, 2, 4,
     "chimera: strategy.concat = 'forward_dubling' is not a concatenation method (direct, forward_doubling, "
     "backward_halving or auto (the fastest simulated; Chimera §3.5))",
     "did you mean 'forward_doubling'? set strategy.concat=forward_doubling, or strategy.concat=direct or "
     "strategy.concat=auto"),
    ({"name": "dapple", "D": 2, "concat": "auto"}, 2, 4,
     "strategy.concat applies to schedules that concatenate units of micro-batches (chimera, chimera_zb) only: dapple "
     "has none, got strategy.concat = auto", "set strategy.concat=null"),
    ({"name": "dapple", "D": 2, "chunks": 2}, 2, 4,
     "dapple runs one stage per worker, got strategy.chunks = 2", "set strategy.chunks=null"),
    ({"name": "pipedream_2bw", "D": 4}, 4, 3,
     "pipedream_2bw needs N ≥ D micro-batches per update (so that only two weight versions are in flight), got N = 3 "
     "(data.global_batch_size / (W·strategy.micro_batch_size)) < D = 4 (strategy.D)",
     "set data.global_batch_size=4"),
    ({"name": "pipedream_2bw", "D": 2}, 4, 2,  # "lower strategy.D" would not do: D = 1 makes W = 4 and N = 1/2
     "pipedream_2bw needs N ≥ D micro-batches per update (so that only two weight versions are in flight), got N = 1 "
     "(data.global_batch_size / (W·strategy.micro_batch_size)) < D = 2 (strategy.D)",
     "; set data.global_batch_size=4"),
    ({"name": "dualpipev", "D": 2}, 4, 6,  # N ≥ 2D: 3 < 4; 2·D·W·B = 8
     "dualpipev needs N ≥ 2·D micro-batches per step (one per stage of the V), got N = 3 (data.global_batch_size / "
     "(W·strategy.micro_batch_size)) < 2·D = 4 (strategy.D = 2)", "set data.global_batch_size=8"),
    ({"name": "pipedream", "D": 2}, 2, 4,
     "pipedream updates the weights after every micro-batch, so N must be 1, got N = 4 (data.global_batch_size / "
     "(W·strategy.micro_batch_size))",
     "set data.global_batch_size=1, or strategy.micro_batch_size=4 or strategy.micro_batch_size=null"),
    ({"name": "pipedream_2bw", "D": 2, "recompute": "always"}, 2, 4,
     "pipedream_2bw stashes weight versions per step and runs with strategy.grad_sync=end and strategy.recompute=none, "
     "got strategy.grad_sync=end and strategy.recompute=always", "set strategy.recompute=none"),
    ({"name": "chimera", "D": 2, "concat": "backward_halving", "micro_batch_size": 3}, 2, 12,
     "concat = backward_halving splits micro-batches in two halves, but strategy.micro_batch_size = 3 is odd",
     "set strategy.micro_batch_size to one of [2, 4, 6, 12], or strategy.concat=direct or "
     "strategy.concat=forward_doubling"),
    ({"name": "gpipe2", "D": 2}, 2, 4,
     f"strategy 'gpipe2' is neither a pipeline schedule ({', '.join(names())}) nor a baseline (ddp, single); choose "
     "one of them with strategy=NAME", "did you mean 'gpipe'? set strategy.name=gpipe"),
    ({"schedule": "gpipe", "name": "dapple", "D": 2}, 2, 4,
     "strategy.schedule = gpipe but strategy.name = dapple: strategy.name follows the schedule, which strategy=NAME "
     "chooses", "set strategy.schedule=dapple, or strategy.name=gpipe"),
]


def _with_fix(strategy: dict, devices: int, batch: int, fix: dict[str, str]) -> tuple[dict, dict, int]:
    """The layout's settings with a fix's overrides set (the values as YAML reads them)."""
    import yaml

    strategy, trainer = dict(strategy), {"devices": devices}
    for key, text in fix.items():
        value = yaml.safe_load(text)
        if key == "data.global_batch_size":
            batch = value
        else:
            group, leaf = key.split(".", 1)
            {"strategy": strategy, "trainer": trainer}[group][leaf] = value
    return strategy, trainer, batch


@pytest.mark.parametrize("strategy, devices, batch, problem, fix_text", CONFIG_RULES)
def test_each_rule_names_the_setting_the_values_the_rule_and_fixes_that_pass(
        strategy: dict, devices: int, batch: int, problem: str, fix_text: str) -> None:
    """The message is the problem, then its fixes; each fix, applied to the same settings, passes every rule (where
    no value of the refused setting works, the message says so and each of its alternatives passes)."""
    strategy = {"micro_batch_size": 1, **strategy}
    with pytest.raises(ConfigError) as err:
        resolve_layout(strategy, {"devices": devices}, batch, num_layers=8)
    message = str(err.value)
    assert message.startswith(problem + "; ") and fix_text in message, message
    assert err.value.fixes and err.value.stuck == ("no value of" in message)
    for fix in err.value.fixes:
        resolve_layout(*_with_fix(strategy, devices, batch, fix), num_layers=8)


@pytest.mark.parametrize("argv, message", [
    (["chimera", "--stages", "1", "--micro-batches", "4"],
     "chimera needs --stages to be even (its down and up pipelines merge without conflict, Chimera §3.1), got "
     "--stages = 1; use --stages = 2"),
    (["pipedream", "--stages", "2", "--micro-batches", "3"],
     "pipedream updates the weights after every micro-batch, so N must be 1, got N = 3 (--micro-batches); pass "
     "--micro-batches 1"),
    (["gpipe", "--stages", "2", "--micro-batches", "2", "--steps", "2"],
     "--steps applies to asynchronous schedules only (pipedream_2bw, pipedream: their windows run without flushes), "
     "got --steps = 2 for gpipe; drop --steps"),
])
def test_the_viewer_names_its_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _viewer().main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_the_api_names_its_arguments() -> None:
    with pytest.raises(ScheduleError) as err:
        build_schedule("chimera", 1, 4)
    assert str(err.value) == ("chimera needs stages to be even (its down and up pipelines merge without conflict, "
                              "Chimera §3.1), got stages = 1; use stages = 2")
    with pytest.raises(ScheduleError) as err:
        build_schedule("pipedream_2bw", 4, 2)
    assert "got N = 2 (micro_batches) < D = 4 (stages); raise micro_batches, or lower stages" in str(err.value)
    # concat=auto is resolved at the micro-batch size: an odd B cannot be halved
    assert {validate(build_schedule("chimera", 4, 8, concat="auto", micro_batch_size=b)).concat for b in (1, 3)} == {
        best_concat(4, 8, 2, 1)} != {"backward_halving"}


@pytest.mark.slow
def test_every_schedule_has_a_strategy_config_on_the_shared_base() -> None:
    """``conf/strategy/<name>.yaml`` for every schedule: ``schedule: <name>`` on ``conf/pipeline_strategy.yaml``
    (not itself a strategy option); every user key of the strategy group keeps working."""
    conf = ROOT / "conf"
    options = {p.stem for p in (conf / "strategy").glob("*.yaml")}
    assert set(names()) <= options and "pipeline_strategy" not in options
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for name in names():
            cfg = OmegaConf.to_container(compose("config", overrides=[f"strategy={name}", "strategy.D=4"]).strategy,
                                         resolve=True)
            assert cfg["_target_"] == "pipeline_recipes.strategies.lightning.strategy.PipelineStrategy"
            assert cfg["schedule"] == cfg["name"] == name and cfg["D"] == 4
            assert {"W", "micro_batch_size", "timeout_s", "grad_sync", "recompute"} <= set(cfg)
        chimera = compose("config", overrides=["strategy=chimera_backward_halving", "strategy.pipelines=4",
                                               "strategy.D=8"]).strategy
        assert (chimera.schedule, chimera.pipelines, chimera.concat, chimera.micro_batch_size) == (
            "chimera", 4, "backward_halving", 2)
