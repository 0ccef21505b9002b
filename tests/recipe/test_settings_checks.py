"""Every setting checked before launch, and the stage table of workers holding several stages.

* A value outside a setting's fixed set (``strategy.grad_sync=eagr``) and a global batch that W·B does
  not divide stop ``train.py`` with exit status 2 and one message before any process starts.
* So does a number of the wrong type or out of its range (``trainer.max_steps=-5``,
  ``checkpoint.every_n_steps=abc``): the schema (:func:`~pipeline_recipes.recipe.check.settings.settings_schema`)
  refuses it in the launcher's checks, in-process here, naming the key, the value and the rule, with fixes
  that pass every check (the ``train.py`` runs are in ``tests/e2e/test_refused_values.py``).
* A misspelled key of any config group (``model.n_layr=4``) gets the key it resembles, not Hydra's
  advice to append it.
* The printed partition table lists the S = v·D stages that train and the worker holding each, as the
  strategy's ``rank r: … stages […]`` line does.

The ``train.py`` runs are refused before any worker starts (a second or two each).
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from pipeline_recipes.core.node import NodeDevices
from pipeline_recipes.recipe.check.command import Command, check_command
from pipeline_recipes.recipe.check.command_line import explain
from pipeline_recipes.recipe.check.settings import (
    ConfigError, NumericSetting, check_drain_timeout, check_settings, numeric_settings, resolve_layout,
    settings_schema,
)

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = frozenset(p.name for p in CONF.iterdir() if p.is_dir())
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path}"]
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)


def _refused(result: subprocess.CompletedProcess, tmp_path: Path) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "logs").exists()  # no worker was started
    return result.stderr


# -- fixed sets of values --------------------------------------------------------------------------------------


def _runtime_values() -> dict[str, tuple[str, ...]]:
    """The values the runtime itself accepts (the modules that run them)."""
    from pipeline_recipes.datamodules.synthetic import STRUCTURES
    from pipeline_recipes.strategies.runtime.grad_sync import GRAD_SYNC_MODES
    from pipeline_recipes.strategies.runtime.recompute import RECOMPUTE_MODES

    return {"strategy.grad_sync": GRAD_SYNC_MODES, "strategy.recompute": RECOMPUTE_MODES, "data.structure": STRUCTURES}


def test_the_launch_check_allows_what_the_runtime_runs() -> None:
    from pipeline_recipes.recipe.check.settings import fixed_settings

    table = {s.key: s.values for s in fixed_settings()}
    for key, values in _runtime_values().items():
        assert table[key] == tuple(values), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, key, value, close",
    [
        (["strategy.grad_sync=eagr"], "strategy.grad_sync", "eagr", "eager"),
        (["strategy=gpipe", "strategy.recompute=alway"], "strategy.recompute", "alway", "always"),
        (["checkpoint.keep=last"], "checkpoint.keep", "last", "latest"),
        (["nonfinite_loss=skipp"], "nonfinite_loss", "skipp", "skip"),
    ],
)
def test_a_value_outside_its_set_stops_before_launch(tmp_path: Path, overrides: list[str], key: str, value: str,
                                                      close: str) -> None:
    err = _refused(_train(tmp_path, *overrides, "trainer=cpu"), tmp_path)
    allowed = {**_runtime_values(), "checkpoint.keep": ("latest", "all"), "nonfinite_loss": ("stop", "skip")}[key]
    assert f"{key} = {value!r} is not one of" in err
    assert all(v in err for v in allowed)
    assert f"did you mean {close!r}? set {key}={close}" in err
    assert err.count("error:") == 1


@pytest.mark.slow
def test_an_unknown_concat_method_stops_before_launch(tmp_path: Path) -> None:
    """strategy.concat is the schedule registry's rule (Chimera §3.5's methods, or auto)."""
    from pipeline_recipes.strategies.schedules import AUTO_CONCAT, CONCAT_METHODS

    err = _refused(_train(tmp_path, "strategy=chimera", "strategy.concat=forward_dubling", "trainer=cpu"), tmp_path)
    assert "strategy.concat = 'forward_dubling'" in err
    assert all(v in err for v in (*CONCAT_METHODS, AUTO_CONCAT))
    assert "did you mean 'forward_doubling'?" in err


# -- numbers: the schema's types and ranges --------------------------------------------------------------------


@functools.cache
def _composed(chosen: tuple[str, ...]) -> Any:
    return compose("config", overrides=list(chosen))


@pytest.fixture
def composer() -> Iterator[Any]:
    """Hydra's compose API over ``conf/``, once per choice of config groups (as ``test_suggested_fixes.py``),
    initialised for one test at a time (``train.py``'s own key check initialises Hydra itself)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield _composed


BASE = ("trainer=cpu", "logger=none", "preflight=false")
STEPS = "an integer ≥ 1, or -1 for no limit"
POSITIVE_SECONDS = "a positive number of seconds"

BAD_VALUES = [  # (overrides, the refused key, its value as the message shows it, the rule in words)
    (["trainer.max_steps=-5"], "trainer.max_steps", "-5", STEPS),
    (["trainer.max_steps=0"], "trainer.max_steps", "0", STEPS),
    (["trainer.max_steps=abc"], "trainer.max_steps", "'abc'", STEPS),  # a string from the command line
    (["trainer.max_steps=2.5"], "trainer.max_steps", "2.5", STEPS),
    (["trainer.max_steps=true"], "trainer.max_steps", "true", STEPS),  # a bool is not an int
    (["trainer.max_steps=null"], "trainer.max_steps", "null", STEPS),  # Lightning takes no None
    (["+trainer.max_epochs=-3"], "trainer.max_epochs", "-3", "an integer ≥ 1, or -1 for no limit, or null"),
    (["trainer.log_every_n_steps=-1"], "trainer.log_every_n_steps", "-1", "an integer ≥ 0, or null"),
    (["trainer.log_every_n_steps=x"], "trainer.log_every_n_steps", "'x'", "an integer ≥ 0, or null"),
    (["trainer.limit_val_batches=1.5"], "trainer.limit_val_batches", "1.5",
     "an integer ≥ 0, or a share of them in [0.0, 1.0], or null"),
    (["trainer.limit_val_batches=-2"], "trainer.limit_val_batches", "-2", "an integer ≥ 0"),
    (["trainer.gradient_clip_val=-0.5"], "trainer.gradient_clip_val", "-0.5", "a number ≥ 0, or null for no clipping"),
    (["trainer.gradient_clip_val=abc"], "trainer.gradient_clip_val", "'abc'", "a number ≥ 0"),
    (["checkpoint.every_n_steps=abc"], "checkpoint.every_n_steps", "'abc'", "an integer ≥ 1, or null for never"),
    (["checkpoint.every_n_steps=-3"], "checkpoint.every_n_steps", "-3", "an integer ≥ 1, or null for never"),
    (["checkpoint.every_n_steps=0"], "checkpoint.every_n_steps", "0", "an integer ≥ 1, or null for never"),
    (["stop_timeout_s=0"], "stop_timeout_s", "0", POSITIVE_SECONDS),
    (["stop_timeout_s=abc"], "stop_timeout_s", "'abc'", POSITIVE_SECONDS),
    (["stop_timeout_s=nan"], "stop_timeout_s", "nan", POSITIVE_SECONDS),
    (["stop_timeout_s=inf"], "stop_timeout_s", "inf", POSITIVE_SECONDS),
    (["nonfinite_loss_patience=-1"], "nonfinite_loss_patience", "-1", "an integer ≥ 0"),
    (["nonfinite_loss_patience=1.5"], "nonfinite_loss_patience", "1.5", "an integer ≥ 0"),
    (["strategy.timeout_s=0"], "strategy.timeout_s", "0", POSITIVE_SECONDS),
    (["strategy=dapple", "strategy.timeout_s=-10"], "strategy.timeout_s", "-10", POSITIVE_SECONDS),
    (["strategy=ddp", "strategy.timeout_s=x"], "strategy.timeout_s", "'x'", POSITIVE_SECONDS),
    (["metrics.window_size=0"], "metrics.window_size", "0", "an integer ≥ 1"),
    (["metrics.warmup_steps=-1"], "metrics.warmup_steps", "-1", "an integer ≥ 0"),
    (["metrics.warmup_steps=one"], "metrics.warmup_steps", "'one'", "an integer ≥ 0"),
    (["metrics.progress_interval_s=-1"], "metrics.progress_interval_s", "-1", "a number of seconds ≥ 0"),
    (["seed=-1"], "seed", "-1", "an integer in [0, 4294967295]"),
    (["seed=4294967296"], "seed", "4294967296", "an integer in [0, 4294967295]"),
    (["seed=abc"], "seed", "'abc'", "an integer in [0, 4294967295]"),
    (["seed=null"], "seed", "null", "an integer in [0, 4294967295]"),  # a random seed per rank: copies differ
    (["logger=wandb", "logger.drain_timeout_s=0"], "logger.drain_timeout_s", "0", POSITIVE_SECONDS),
    (["logger=wandb", "logger.drain_timeout_s=null"], "logger.drain_timeout_s", "null", POSITIVE_SECONDS),
    (["scheduler.warmup_steps=-1"], "scheduler.warmup_steps", "-1", "an integer ≥ 0"),
    (["scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio", "2", "a number in [0, 1]"),
    (["scheduler.total_steps=0"], "scheduler.total_steps", "0", "an integer ≥ 1, or null for trainer.max_steps"),
    (["optim.lr=-0.1"], "optim.lr", "-0.1", "a number ≥ 0"),
    (["optim=sgd", "optim.momentum=-1"], "optim.momentum", "-1", "a number ≥ 0"),
]


def _checked(command: Command, vet_fixes: bool = True) -> ConfigError | None:
    """The refusal of ``command`` by the launcher's checks on a CPU node (None: it passes)."""
    cfg = command.config()
    assert cfg is not None, command.overrides
    try:
        check_command(cfg, command=command, node=NodeDevices(), env={}, vet_fixes=vet_fixes)
    except ConfigError as err:
        return err
    return None


@pytest.mark.parametrize("overrides, key, shown, rule", BAD_VALUES,
                         ids=[" ".join(o) for o, *_ in BAD_VALUES])
def test_a_bad_number_is_refused_before_launch_with_fixes_that_pass(composer: Any, overrides: list[str], key: str,
                                                                    shown: str, rule: str) -> None:
    """The launcher's checks (in-process: nothing is launched) refuse it first, naming the key, the value and the
    rule; each fix names the key and, applied to the same command, passes every check."""
    command = Command((*BASE, *overrides), composer, GROUPS)
    err = _checked(command)
    assert err is not None, overrides
    message = str(err)
    assert message.startswith(f"{key} = {shown}: "), message
    assert f"must be {rule}" in message, message
    assert err.fixes and all(set(fix) == {key} for fix in err.fixes), message
    assert message.endswith("; set " + " or ".join(f"{key}={fix[key]}" for fix in err.fixes)), message
    for fix in err.fixes:
        again = _checked(command.with_fix(fix), vet_fixes=False)
        assert again is None, f"{fix} is refused again: {again}"


@pytest.mark.parametrize("overrides, fixes", [
    (["trainer.max_steps=-5"], ["trainer.max_steps=5", "trainer.max_steps=-1"]),  # the likely intent, or no limit
    (["checkpoint.every_n_steps=-3"], ["checkpoint.every_n_steps=3", "checkpoint.every_n_steps=null"]),
    (["checkpoint.every_n_steps=abc"], ["checkpoint.every_n_steps=100", "checkpoint.every_n_steps=null"]),
    (["checkpoint.every_n_steps='8'"], ["checkpoint.every_n_steps=8", "checkpoint.every_n_steps=null"]),
    (["trainer.max_steps=3.0"], ["trainer.max_steps=3", "trainer.max_steps=-1"]),
    (["seed=4294967296"], ["seed=4294967295"]),
    (["stop_timeout_s=0"], ["stop_timeout_s=120"]),
])
def test_a_refused_number_proposes_the_value_meant(composer: Any, overrides: list[str], fixes: list[str]) -> None:
    err = _checked(Command((*BASE, *overrides), composer, GROUPS))
    assert [f"{k}={v}" for fix in err.fixes for k, v in fix.items()] == fixes


@pytest.mark.parametrize("override", [
    "trainer.max_steps=-1", "trainer.max_steps=1", "+trainer.max_epochs=-1", "+trainer.max_epochs=null",
    "+trainer.max_epochs=2", "trainer.log_every_n_steps=0", "trainer.log_every_n_steps=null",
    "trainer.limit_val_batches=0.25", "trainer.limit_val_batches=3", "trainer.limit_val_batches=null",
    "trainer.gradient_clip_val=null", "trainer.gradient_clip_val=0", "trainer.gradient_clip_val=2",
    "checkpoint.every_n_steps=null", "checkpoint.every_n_steps=1", "stop_timeout_s=0.5", "stop_timeout_s=600",
    "nonfinite_loss_patience=0", "strategy.timeout_s=1e3", "metrics.window_size=1", "metrics.warmup_steps=0",
    "metrics.progress_interval_s=0", "seed=0", "seed=4294967295", "scheduler.total_steps=null",
    "scheduler.min_lr_ratio=0", "scheduler.min_lr_ratio=1.0", "optim.lr=0.0006",
])
def test_the_values_lightning_and_the_runtime_take_pass(composer: Any, override: str) -> None:
    assert _checked(Command((*BASE, override), composer, GROUPS)) is None


def test_the_schema_names_each_key_once_and_its_examples_pass() -> None:
    keys = [rule.key for rule in settings_schema()]
    assert len(keys) == len(set(keys))
    for rule in numeric_settings():
        assert rule.accepts(rule.example), rule.key
        assert not rule.accepts(True) and not rule.accepts(float("nan")) and not rule.accepts("1"), rule.key
        assert all(rule.accepts(special) for special, _ in rule.specials), rule.key
    # the layout's sizes are the layout's rules (resolve_layout), not written again here
    assert not set(keys) & {"trainer.devices", "trainer.num_nodes", "strategy.D", "strategy.W",
                            "strategy.micro_batch_size", "data.global_batch_size", "trainer.peak_tflops",
                            "model.loss_chunk_tokens"}


def _options_holding(key: str) -> list[tuple[str, ...]]:
    """The group choices whose config has ``key`` (read from the yaml files: the top level, or a group's options)."""
    group, _, leaf = key.partition(".")
    if not leaf:
        return [()] if key in yaml.safe_load((CONF / "config.yaml").read_text()) else []
    if group not in GROUPS:
        return [()] if leaf in (yaml.safe_load((CONF / "config.yaml").read_text()).get(group) or {}) else []
    return [(f"{group}={p.stem}",) for p in sorted((CONF / group).glob("*.yaml"))
            if leaf in (yaml.safe_load(p.read_text()) or {})]


ADDED_ONLY = {"trainer.max_epochs"}  # a Trainer argument no yaml sets (+trainer.max_epochs=…)


@pytest.mark.slow
def test_every_key_of_the_schema_is_a_setting_and_its_configured_values_pass(composer: Any) -> None:
    """Each numeric key is in conf/ (a misspelled key would never be checked), and every option that sets it
    passes (the defaults are valid values)."""
    for rule in numeric_settings():
        holders = _options_holding(rule.key)
        if rule.key == "strategy.timeout_s":  # the pipeline schedules' base config has it
            holders = [("strategy=gpipe",), ("strategy=ddp",)]
            assert "timeout_s" in yaml.safe_load((CONF / "pipeline_strategy.yaml").read_text())
        assert holders or rule.key in ADDED_ONLY, rule.key
        for chosen in holders:
            cfg = composer(chosen)
            assert OmegaConf.select(cfg, rule.key, default="absent") != "absent", (rule.key, chosen)
            check_settings(cfg)


@pytest.mark.slow
def test_every_recipe_passes_the_schema() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):  # as --config-dir recipes
        for path in sorted((ROOT / "recipes").glob("*.yaml")):
            check_settings(compose(path.stem, overrides=[f"hydra.searchpath=[file://{CONF}]"]))


def test_the_drain_timeout_is_the_schemas_rule() -> None:
    """logger.drain_timeout_s: the same rule before launch (check_settings) and in the logger itself."""
    rule = next(r for r in numeric_settings() if r.key == "logger.drain_timeout_s")
    assert isinstance(rule, NumericSetting) and check_drain_timeout(5) == 5.0
    for bad in (0, -1.0, "300", None, True, math.inf):
        with pytest.raises(ConfigError) as refused:
            check_drain_timeout(bad)
        assert str(refused.value) == rule.error(bad)
        with pytest.raises(ConfigError) as refused:
            check_settings({"logger": {"drain_timeout_s": bad}})
        assert str(refused.value) == rule.error(bad)


# -- the global batch ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, devices, D, B, explicit_w", [(10, 4, 2, 3, False), (9, 4, 2, 3, False),
                                                               (14, 8, 2, 2, True)])
def test_batch_message_names_both_settings_and_fixes_that_work(batch: int, devices: int, D: int, B: int,
                                                               explicit_w: bool) -> None:
    W = devices // D
    strategy = {"name": "gpipe", "D": D, "micro_batch_size": B, **({"W": W} if explicit_w else {})}
    with pytest.raises(ConfigError) as info:
        resolve_layout(strategy, {"devices": devices}, batch, 8)
    message = str(info.value)
    assert f"data.global_batch_size = {batch} is not divisible by W·B = {W}·{B} = {W * B}" in message
    assert f"strategy.micro_batch_size = {B}" in message
    assert (f"strategy.W = {W}" if explicit_w else f"trainer.devices × trainer.num_nodes = {devices} processes / "
            f"strategy.D = {D}") in message
    fixes = info.value.fixes
    batches = [int(f["data.global_batch_size"]) for f in fixes if set(f) == {"data.global_batch_size"}]
    sizes = [int(f["strategy.micro_batch_size"]) for f in fixes if set(f) == {"strategy.micro_batch_size"}]
    # the nearest multiples of W·B each way, and every micro-batch size that divides B̂ / W; each one is accepted
    assert batches == [v for v in ((batch // (W * B)) * W * B, (batch // (W * B) + 1) * W * B) if v > 0]
    for fixed in batches:
        resolve_layout(strategy, {"devices": devices}, fixed, 8)
    if batch % W:
        assert sizes == [] and f"not a multiple of W = {W}" in message
    else:
        assert sizes == [b for b in range(1, batch + 1) if (batch // W) % b == 0 and batch % (W * b) == 0]
        for b in sizes:
            resolve_layout({**strategy, "micro_batch_size": b}, {"devices": devices}, batch, 8)
    for fix in fixes[len(batches) + len(sizes):]:  # then other depths: W changes with D
        assert set(fix) == {"strategy.D"}
        resolve_layout({**strategy, "D": int(fix["strategy.D"])}, {"devices": devices}, batch, 8)


@pytest.mark.slow
def test_batch_refusal_from_train_py(tmp_path: Path) -> None:
    err = _refused(_train(tmp_path, "strategy=gpipe", "trainer=cpu", "trainer.devices=4", "strategy.D=2",
                          "strategy.micro_batch_size=3", "data.global_batch_size=10"), tmp_path)
    assert "data.global_batch_size = 10" in err and "strategy.micro_batch_size = 3" in err
    assert "a multiple of 6" in err and "strategy.micro_batch_size=1 or strategy.micro_batch_size=5" in err


# -- misspelled keys -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layr=4"], "model.n_layr is not a setting of model=gpt2-tiny; did you mean 'n_layer'? "
                             "(to add a new key on purpose, write +model.n_layr=4)"),
        (["strategy=gpipe", "strategy.grad_sink=end"], "strategy.grad_sink is not a setting of strategy=gpipe; "
                                                       "did you mean 'grad_sync'?"),
        (["data.global_bach_size=8"], "data.global_bach_size is not a setting of data=synthetic; "
                                      "did you mean 'global_batch_size'?"),
        (["trainer.max_step=3"], "trainer.max_step is not a setting of trainer=auto; did you mean 'max_steps'?"),
        (["optim=sgd", "optim.momentun=0.5"], "optim.momentun is not a setting of optim=sgd; did you mean 'momentum'?"),
        (["scheduler.warmup_step=2"], "scheduler.warmup_step is not a setting of scheduler=cosine; "
                                      "did you mean 'warmup_steps'?"),
        (["logger.projct=x"], "logger.projct is not a setting of logger=wandb; did you mean 'project'?"),
        (["seeed=1"], "seeed is not a top-level setting of config.yaml; did you mean 'seed'? "
                      "(to add a new key on purpose, write +seeed=1)"),
        (["checkpoint.kep=all"], "checkpoint.kep is not a setting of checkpoint; did you mean 'keep'?"),
        # a sweep: the key exists under gpipe, not under ddp
        (["-m", "strategy=gpipe,ddp", "strategy.chunks=2"], "strategy.chunks is not a setting of strategy=ddp"),
    ],
)
def test_a_misspelled_key_gets_the_key_it_resembles(tmp_path: Path, overrides: list[str], message: str) -> None:
    result = _train(tmp_path, *overrides)
    err = _refused(result, tmp_path)
    assert f"error: {message}" in err
    assert "To append to your config" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["model=llama-tiny", "model.family=mistral", "+model.sliding_window=512"],
        ["model=llama-tiny", "model.num_key_value_heads=1"],
        ["-m", "strategy=gpipe,dapple,chimera", "strategy.D=2,4", "trainer.devices=4"],
        ["--config-dir", str(ROOT / "recipes"), "--config-name", "schedules-cpu", "trainer.max_steps=2"],
        ["--cfg", "job", "strategy.micro_batch_size=2"],
        ["--help"],
    ],
)
def test_valid_command_lines_pass_the_key_check(argv: list[str]) -> None:
    assert explain(HydraException("any"), argv, CONF) is None  # nothing of theirs to explain


def test_the_key_check_leaves_other_errors_to_hydra() -> None:
    assert explain(HydraException("any"), ["+seed=3"], CONF) is None  # already there: Hydra says drop + or use ++


@pytest.mark.parametrize("argv, message", [
    (["strategy=dappel"], "strategy=dappel: config group 'strategy' has no option 'dappel'; choose one of "),
    (["-m", "strategy=gpipe,chimra"], "strategy=chimra: config group 'strategy' has no option 'chimra'"),
    (["model=gpt3"], "model=gpt3: config group 'model' has no option 'gpt3'"),
])
def test_a_misspelled_group_option_gets_the_options_and_the_closest(argv: list[str], message: str) -> None:
    """The options come from the conf/ folder itself; the closest is difflib's (an independent spelling rule)."""
    import difflib

    got, code = explain(HydraException("any"), argv, CONF)
    assert code == 2
    group, value = message.split(":")[0].split("=")
    options = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
    assert got.startswith(message) and got.split("choose one of ")[1].startswith(", ".join(options))
    close = difflib.get_close_matches(value, options, n=1)
    assert got.endswith(f"; did you mean {group}={close[0]}?" if close else ", ".join(options))


def test_a_misspelled_schedule_or_concat_method_gets_the_closest() -> None:
    from pipeline_recipes.recipe.check.settings import ConfigError, resolve_layout
    from pipeline_recipes.strategies.schedules import ScheduleError, get_spec

    with pytest.raises(ScheduleError, match=r"unknown schedule 'chimra'.*; did you mean 'chimera'\?$"):
        get_spec("chimra")
    with pytest.raises(ConfigError, match=r"strategy 'interleaved' .*; did you mean 'interleaved_1f1b'\? set "
                                          r"strategy.name=interleaved_1f1b$"):
        resolve_layout({"name": "interleaved", "D": 2, "micro_batch_size": 1}, {"devices": 2}, 8, 4)


# -- the stage table -------------------------------------------------------------------------------------------


def _tiny_model():
    from hydra.utils import instantiate

    return instantiate(OmegaConf.load(ROOT / "conf" / "model" / "gpt2-tiny.yaml"), device="meta")


def _expected_holders(schedule: str, D: int) -> list[set[int]]:
    """Worker(s) of each stage from the papers' placements: one stage per worker (GPipe), the V of ZB-V and
    DualPipeV (worker w: stages w and 2D − 1 − w), Chimera's down and up pipelines (stage s on workers s and
    D − 1 − s)."""
    if schedule in ("zbv", "dualpipev"):
        return [{s if s < D else 2 * D - 1 - s} for s in range(2 * D)]
    if schedule == "chimera":
        return [{s, D - 1 - s} for s in range(D)]
    return [{s} for s in range(D)]


@pytest.mark.parametrize("schedule, D", [("zbv", 2), ("dualpipev", 2), ("zbv", 3), ("gpipe", 2), ("chimera", 4)])
def test_stage_table_lists_the_stages_that_train_and_their_workers(schedule: str, D: int) -> None:
    from pipeline_recipes.recipe.worker.job import stage_table
    from pipeline_recipes.strategies.runtime.topology import Topology
    from pipeline_recipes.strategies.schedules import derive_layout, get_spec

    W = 2
    layout = derive_layout(schedule, W * D, D, W * get_spec(schedule).smallest_micro_batches(D), B=1)
    expected = _expected_holders(schedule, D)
    S = len(expected)
    text = stage_table(_tiny_model(), Topology.from_layout(layout))
    rows = [line for line in text.splitlines() if re.match(r"\s*\d+ \|", line)]
    assert [int(r.split("|")[0]) for r in rows] == list(range(S))
    placement = dict(re.findall(r"stage (\d+) → workers? ([\d and]+)", text))
    holders = [{int(w) for w in placement[str(s)].split(" and ")} for s in range(S)]
    assert holders == expected
    # the strategy's per-rank line names the same stages for every rank
    topology = Topology.from_layout(layout)
    for rank in range(W * D):
        stages = re.search(r"stages \[([\d, ]+)\]", topology.describe(rank)).group(1)
        held = [s for s in range(S) if rank % D in holders[s]]
        assert [int(s) for s in stages.split(", ")] == held


# -- strategy.shard_optimizer ----------------------------------------------------------------------------------


def _applied(strategy: dict[str, Any], fix: dict[str, str]) -> dict[str, Any]:
    """``strategy`` with a proposed fix's overrides (``strategy=NAME`` chooses another schedule's config)."""
    out = dict(strategy)
    for key, text in fix.items():
        value = yaml.safe_load(text)
        if key == "strategy":
            out = {k: v for k, v in out.items() if k not in ("schedule", "pipelines", "concat")} | {"name": value}
        else:
            out[key.removeprefix("strategy.")] = value
    return out


@pytest.mark.parametrize("strategy, devices, words", [
    ({"name": "single", "D": 1}, 1, "strategy=single runs one process, which holds the only copy"),
    ({"name": "ddp", "D": 1}, 2, "strategy=ddp keeps a whole optimizer per replica"),
    ({"name": "gpipe", "D": 2, "micro_batch_size": 1}, 2, "every stage of gpipe at W = 1 has one copy"),
    ({"name": "pipedream_2bw", "D": 2, "micro_batch_size": 1}, 4, "pipedream_2bw is asynchronous"),
    ({"name": "dapple", "D": 2, "micro_batch_size": 1, "shard_optimizer": "yes"}, 4, "must be true or false"),
])
def test_a_sharded_optimizer_without_copies_to_shard_is_refused_with_fixes_that_pass(
        strategy: dict[str, Any], devices: int, words: str) -> None:
    """Nothing to shard (one process, one copy per stage), an optimizer the strategy does not shard (DDP, the
    asynchronous schedules) or a value that is no bool: refused before launch, each proposed fix accepted."""
    strategy = {"shard_optimizer": True, **strategy}
    with pytest.raises(ConfigError) as refused:
        resolve_layout(strategy, {"devices": devices}, 8, 8)
    assert words in str(refused.value) and "strategy.shard_optimizer" in str(refused.value)
    assert refused.value.fixes and any(f.get("strategy.shard_optimizer") == "false" for f in refused.value.fixes)
    for fix in refused.value.fixes:
        resolve_layout(_applied(strategy, fix), {"devices": devices}, 8, 8)


@pytest.mark.parametrize("strategy, devices", [({"name": "chimera", "D": 2}, 2), ({"name": "dapple", "D": 2}, 4),
                                               ({"name": "dapple", "D": 1}, 2), ({"name": "zbv", "D": 2}, 4)])
def test_a_sharded_optimizer_is_part_of_the_layout(strategy: dict[str, Any], devices: int) -> None:
    """Chimera's two pipelines hold two copies of each stage even at W = 1; DAPPLE at D = 1 is data parallelism
    with sharded state (what ``strategy=ddp`` is told to use instead)."""
    layout = resolve_layout({**strategy, "micro_batch_size": 1, "shard_optimizer": True}, {"devices": devices}, 8, 8)
    assert layout.shard_optimizer and layout.label.endswith("shard_optim")
    assert "strategy.shard_optimizer=true" in layout.describe()


@pytest.mark.slow
def test_a_sharded_optimizer_refusal_from_train_py(tmp_path: Path) -> None:
    err = _refused(_train(tmp_path, "strategy=ddp", "trainer=cpu", "trainer.devices=2",
                          "strategy.shard_optimizer=true"), tmp_path)
    assert "strategy.shard_optimizer = true but strategy=ddp" in err
    assert "set strategy=dapple strategy.D=1 strategy.shard_optimizer=true" in err
