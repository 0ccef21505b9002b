"""Config groups, recipes, sweeps, launching and W&B logging (Hydra recipes and sweeps).

Composition tests are fast (Hydra's compose API, no processes); the multirun, torchrun and
dead-rank tests start real processes and are marked slow.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline_recipes.core.node import NodeDevices
from pipeline_recipes.models import build_model, hydra_config
from pipeline_recipes.recipe.check.accelerator import resolve_accelerator
from pipeline_recipes.recipe.launch.main import launch_workers, num_layers
from pipeline_recipes.recipe.check.settings import ConfigError, resolve_layout
from pipeline_recipes.recipe.report.results import find_results

ROOT = Path(__file__).resolve().parents[2]
CONF, RECIPES = ROOT / "conf", ROOT / "recipes"
GROUPS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
          for group in ("strategy", "model", "data", "trainer", "logger", "optim", "scheduler")}
RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _compose(name: str = "config", overrides: list[str] = (), hydra: bool = False):
    """Compose like ``train.py [--config-dir recipes --config-name name] overrides``."""
    primary, extra = (CONF, RECIPES) if name == "config" else (RECIPES, CONF)
    with initialize_config_dir(config_dir=str(primary), version_base="1.3"):
        return compose(name, overrides=[f"hydra.searchpath=[file://{extra}]", *overrides], return_hydra_config=hydra)


def _layout(cfg):
    """The layout as train.py derives it on a CPU node (``trainer=auto`` resolved first)."""
    trainer = resolve_accelerator(OmegaConf.to_container(cfg.trainer, resolve=True), NodeDevices()).trainer
    return resolve_layout(OmegaConf.to_container(cfg.strategy, resolve=True), trainer, cfg.data.global_batch_size,
                          num_layers(cfg.model))


@pytest.mark.parametrize("group, option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_group_option_composes_and_resolves(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if option == "single":
        overrides.append("trainer.devices=1")
    if option == "ddp":
        overrides.append("strategy.D=1")
    cfg = _compose(overrides=overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert resolved[group]
    if group in ("strategy", "trainer"):
        layout = _layout(cfg)
        assert layout.W * layout.D == layout.world_size


@pytest.mark.slow
def test_strategies_instantiate_from_config() -> None:
    """Every strategy option builds its Lightning strategy as a worker does: a pipeline's from the layout the launcher
    resolved (the config's schedule and concat), a baseline from its config."""
    from lightning.pytorch.strategies import Strategy

    from pipeline_recipes.recipe.worker.job import build_strategy
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy

    for option in GROUPS["strategy"]:
        devices = 1 if option == "single" else 4  # W = 2 replicas of a pipeline of the config's D = 2
        cfg = _compose(overrides=[f"strategy={option}", "trainer=cpu", f"trainer.devices={devices}"])
        layout = _layout(cfg)
        strategy = build_strategy(OmegaConf.to_container(cfg.strategy, resolve=True), layout)
        assert isinstance(strategy, Strategy), option
        if isinstance(strategy, PipelineStrategy):
            assert strategy.layout == layout and layout.strategy == cfg.strategy.name
            assert layout.concat == cfg.strategy.get("concat", "direct")


def _sweep_jobs(cfg, grid: bool) -> list[list[str]]:
    """Every job of the sweep (``grid``), or each swept value once (enough to check composition)."""
    params = cfg.hydra.sweeper.params or {}
    keys = list(params)
    values = [str(params[k]).split(",") for k in keys]
    if grid:
        return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*values)]
    return [[f"{k}={v}"] for k, vs in zip(keys, values) for v in vs]


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.slow
def test_every_recipe_composes_and_every_cpu_job_is_valid(recipe: str) -> None:
    cfg = _compose(recipe, hydra=True)
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.experiment == recipe
    jobs = _sweep_jobs(cfg, grid=recipe.endswith("-cpu"))
    assert len(jobs) >= 2
    for job in jobs:
        job_cfg = _compose(recipe, job)
        if recipe.endswith("-cpu"):
            layout = _layout(job_cfg)  # a CPU recipe never skips a job
            assert job_cfg.trainer.accelerator == "cpu" and layout.world_size <= 8
        else:  # paper grids may hold combinations a sweep records as skipped
            assert job_cfg.trainer.accelerator == "gpu" and job_cfg.trainer.num_nodes > 1


def test_users_trainer_keys_override_the_recipes() -> None:
    """``+trainer.<any Trainer argument>`` and the trainer group's keys reach ``Trainer`` over the recipe's
    own arguments (no duplicate keywords); ``trainer.callbacks`` are added; ``trainer.strategy`` is refused."""
    from pipeline_recipes.recipe.worker.job import trainer_kwargs

    cfg = _compose(overrides=["+trainer.enable_progress_bar=true", "+trainer.default_root_dir=/elsewhere",
                              "trainer.peak_tflops=312", "+trainer.callbacks=[{_target_: "
                              "lightning.pytorch.callbacks.LearningRateMonitor}]"])
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert trainer.pop("peak_tflops") == 312  # read by the job, not a Trainer argument
    recipe = {"strategy": "S", "logger": False, "callbacks": ["ours"], "default_root_dir": "/job",
              "enable_progress_bar": False}
    kwargs = trainer_kwargs(trainer, recipe)
    assert kwargs["enable_progress_bar"] is True and kwargs["default_root_dir"] == "/elsewhere"
    assert kwargs["strategy"] == "S" and kwargs["max_steps"] == 40
    assert kwargs["callbacks"][0] == "ours" and type(kwargs["callbacks"][1]).__name__ == "LearningRateMonitor"
    with pytest.raises(ValueError, match="choose the strategy with the strategy group"):
        trainer_kwargs({**trainer, "strategy": "ddp"}, recipe)


def test_layout_names_variants() -> None:
    cfg = _compose(overrides=["strategy=chimera_forward_doubling", "trainer.devices=4", "strategy.D=4",
                              "strategy.pipelines=4"])
    layout = _layout(cfg)
    assert layout.label == "chimera+forward_doubling+4pipes"
    assert layout.run_name == "chimera+forward_doubling+4pipes-W1-D4-B1"
    assert layout.result_fields()["strategy"] == layout.label


def test_concat_auto_is_resolved_before_launch() -> None:
    """strategy.concat=auto: the layout (printed, labelled) and every worker's engine pick the same method,
    best_concat's (Chimera §3.5) for this D, N, B and pipelines; a bad method stops before launch."""
    from pipeline_recipes.planner.preflight import candidate_of
    from pipeline_recipes.strategies.runtime.engine import PipelineConfig
    from pipeline_recipes.strategies.schedules import best_concat

    for B, expected in ((1, "forward_doubling"), (2, "backward_halving")):  # N = 8 = 2D: no halving at odd B
        cfg = _compose(overrides=["strategy=chimera", "strategy.concat=auto", "trainer.devices=4", "strategy.D=4",
                                  f"strategy.micro_batch_size={B}", f"data.global_batch_size={8 * B}"])
        layout = _layout(cfg)
        assert layout.N == 8 and layout.concat == expected == best_concat(4, 8, 2, B)
        assert layout.describe().endswith(f"; 2 pipelines; concat=auto → {expected}")
        assert layout.label == f"chimera+{expected}"
        assert PipelineConfig(layout).build(8).concat == expected  # the runtime runs the layout's method
        assert candidate_of(layout).concat == expected  # pre-flight
    direct = _layout(_compose(overrides=["strategy=chimera", "trainer.devices=4", "strategy.D=4"]))
    assert direct.concat == "direct" and "concat" not in direct.describe()
    with pytest.raises(ConfigError, match="strategy.concat = 'tripling' is not a concatenation method"):
        _layout(_compose(overrides=["strategy=chimera", "strategy.concat=tripling", "trainer.devices=2"]))


def test_baseline_layouts() -> None:
    ddp = _layout(_compose(overrides=["strategy=ddp", "trainer.devices=4", "data.global_batch_size=16"]))
    assert (ddp.W, ddp.D, ddp.B, ddp.N) == (4, 1, 4, 1)
    single = _layout(_compose(overrides=["strategy=single", "trainer.devices=1"]))
    assert (single.W, single.D, single.B, single.N, single.world_size) == (1, 1, 32, 1, 1)
    with pytest.raises(ConfigError, match="strategy=single runs one process"):
        _layout(_compose(overrides=["strategy=single", "trainer.devices=2"]))
    with pytest.raises(ConfigError, match="set strategy.D=1"):
        _layout(_compose(overrides=["strategy=ddp", "strategy.D=2"]))


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_multirun_sweep_runs_every_job_once_and_logs_offline(tmp_path: Path) -> None:
    """2 valid jobs and 2 invalid ones in one command: 2 × ok with W&B runs, 2 × skipped; the sweep's end lists
    all four with their status and exits 1 (not every point trained)."""
    sweep = tmp_path / "sweep"
    result = _run([str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep}", "strategy=gpipe,chimera",
                   "strategy.D=2,3", "trainer.devices=2", "trainer.max_steps=4", "data.global_batch_size=8",
                   "experiment=test-sweep"], cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: sweep: 2 of 4 points did not train to the end (2 skipped)")
    table = result.stdout[result.stdout.rindex("strategy  W"):]
    assert table.count(" ok") == 2 and table.count("skipped: strategy.D = 3") == 2
    results = find_results([sweep])
    assert len(results) == 4
    ok = [r for r in results if r.status == "ok"]
    skipped = [r for r in results if r.status == "skipped"]
    assert sorted(r.strategy for r in ok) == ["chimera", "gpipe"] and len(skipped) == 2
    assert all("strategy.D = 3 does not divide the 2 processes" in r.reason for r in skipped)
    for r in ok:
        assert (r.W, r.D, r.B, r.N, r.world_size, r.global_batch_size) == (1, 2, 1, 8, 2, 8)
        assert r.samples_per_s > 0 and r.tokens_per_s == pytest.approx(32 * r.samples_per_s)
        assert r.iteration_s > 0 and 0 <= r.bubble_ratio_measured < 1 and 0 <= r.bubble_ratio_theory < 1
        assert len(r.peak_memory_bytes) == 2 and min(r.peak_memory_bytes) > 0
        assert len(r.loss_history) == 4 and r.final_loss == r.loss_history[-1]
        assert (Path(r.path).parent / "timeline.png").stat().st_size > 0
    # synchronous schedules are equivalent: the same losses, whatever the order of the actions
    assert ok[0].loss_history == pytest.approx(ok[1].loss_history, abs=1e-5)
    # what each rank holds, against the unsplit model: GPipe's two stages hold it once, the tied embedding on both
    # ends; Adam keeps two moments per parameter (and a step count per tensor)
    model = build_model(hydra_config("gpt2-tiny"))
    uses = [p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False)]
    gpipe = next(r for r in ok if r.strategy == "gpipe")
    assert sum(gpipe.parameter_bytes) == sum(uses)  # every use: a tied weight's two ends are on two stages
    for r in ok:
        assert len(r.parameter_bytes) == len(r.optimizer_state_bytes) == 2
        assert all(0 <= state - 2 * held <= 4096 for held, state in zip(r.parameter_bytes, r.optimizer_state_bytes))

    from pipeline_recipes.recipe.worker.wandb_offline import find_offline_runs

    runs = find_offline_runs(sweep)
    assert sorted(r.name for r in runs) == ["chimera-W1-D2-B1-gpt2-tiny", "gpipe-W1-D2-B1-gpt2-tiny"]
    for run in runs:
        assert run.group == "test-sweep" and run.job_type == run.name.split("-")[0]
        assert run.tags == [f"strategy={run.job_type}", "model=gpt2-tiny", "W=1", "D=2", "B=1"]
        assert run.summary["samples_per_s"] > 0 and run.summary["tokens_per_s"] > 0
        assert "bubble_ratio_measured" in run.summary and "iteration_s" in run.summary
        assert run.config["derived"]["N"] == 8 and run.config["strategy"]["name"] == run.job_type
        lr_rows = [row for row in run.history if "train/lr" in row]  # the background writer's rows, in order
        assert [row["trainer/global_step"] for row in lr_rows] == [0, 1, 2, 3]

    compare = _run([str(ROOT / "scripts" / "compare.py"), str(sweep), "--json", str(tmp_path / "rows.json")],
                   cwd=tmp_path)
    assert compare.returncode == 0, compare.stderr
    assert (sweep / "compare.png").stat().st_size > 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [row["status"] for row in rows] == ["ok"] * 2 + ["skipped"] * 2


@pytest.mark.slow
def test_train_py_under_torchrun_does_not_relaunch(tmp_path: Path) -> None:
    result = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
                   f"hydra.run.dir={tmp_path / 'run'}", "strategy=dapple", "trainer.devices=2", "trainer.max_steps=3",
                   "data.global_batch_size=8", "logger=csv", "trainer.log_every_n_steps=1"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("final train/loss") == 1  # rank 0 reports, once
    assert not (tmp_path / "run" / "logs").exists()  # no workers of our own were started
    (res,) = find_results([tmp_path / "run"])
    assert res.status == "ok" and res.world_size == 2 and len(res.loss_history) == 3
    assert "train/loss" in (tmp_path / "run" / "metrics.csv").read_text()


def _launch_fake_workers(tmp_path: Path, name: str, script: str, **kwargs):
    """``launch_workers`` on 2 fake ranks running ``script`` (module ``name``); returns (outcome, seconds)."""
    (tmp_path / f"{name}.py").write_text(script)
    layout = resolve_layout({"name": "gpipe", "D": 2, "micro_batch_size": 1}, {"devices": 2}, 8, num_layers=6)
    sys.path.insert(0, str(tmp_path))
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}:{env_path}"
    try:
        start = time.monotonic()
        outcome = launch_workers(tmp_path / "job.yaml", layout.world_size, 2, tmp_path / "logs", module=name, grace_s=1.0,
                                 **kwargs)
        return outcome, time.monotonic() - start
    finally:
        os.environ["PYTHONPATH"] = env_path
        sys.path.remove(str(tmp_path))


def test_the_job_end_is_made_of_the_ranks_end_records(tmp_path: Path) -> None:
    """Each rank whose run returns leaves its end record beside its heartbeat; the launcher's end of the job is
    made of them: ok only where the first rank said so, a stop in the first rank's own words (with the signal),
    and a job whose ranks all exited 0 without the first rank's record is failed, not ok."""
    said = "SIGTERM received by rank 1; stopped after step 4"
    script = (
        "import os, sys\n"
        "from pipeline_recipes.core.failures import HEARTBEAT_ENV\n"
        "from pipeline_recipes.recipe.report.ending import JobEnd, end_path, write_end\n"
        "mode = open(os.path.join(os.path.dirname(__file__), 'mode')).read()\n"
        "end = JobEnd.stopped(15, %r) if mode == 'stop' else JobEnd('ok')\n"
        "if mode != 'silent' or os.environ['RANK'] != '0':\n"
        "    write_end(end_path(os.environ[HEARTBEAT_ENV]), end)\n"
        "sys.exit(end.exit_code)\n" % said)
    ends = {}
    for mode in ("ok", "stop", "silent"):
        (tmp_path / "mode").write_text(mode)
        ends[mode], _ = _launch_fake_workers(tmp_path, "ending_worker", script)
    assert (ends["ok"].status, ends["ok"].exit_code) == ("ok", 0)
    assert (ends["stop"].status, ends["stop"].signum, ends["stop"].rank_said, ends["stop"].exit_code) == (
        "stopped", 15, said, 128 + 15)
    assert ends["silent"].status == "failed" and ends["silent"].exit_code == 1
    assert ends["silent"].reason == (f"every rank exited 0 but rank 0 ({socket.gethostname()}) left no end record "
                                     "(its run did not return)")


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_with_its_log(tmp_path: Path) -> None:
    """Rank 1 dies; rank 0 would wait forever: the launcher stops it and names rank 1."""
    outcome, seconds = _launch_fake_workers(tmp_path, "fake_worker", (
        "import os, sys, time\n"
        "print('rank', os.environ['RANK'], 'started', flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('boom: simulated crash', flush=True); sys.exit(3)\n"
        "time.sleep(600)\n"
    ))
    assert not outcome.ok
    assert outcome.reason == f"rank 1 ({socket.gethostname()}) ended with exit status 3", outcome.reason
    assert "boom: simulated crash" in outcome.detail
    assert seconds < 20
    assert "boom" in (tmp_path / "logs" / "rank1.log").read_text()


@pytest.mark.slow
def test_a_silent_rank_is_named_by_its_heartbeat(tmp_path: Path) -> None:
    """Rank 1 beats, then stops itself (alive, silent); nobody else fails: the launcher ends the job
    once its heartbeat is older than hang_s, names rank 1 and stops both workers."""
    outcome, seconds = _launch_fake_workers(tmp_path, "silent_worker", (
        "import os, signal, time\n"
        "from pipeline_recipes.recipe.worker.heartbeat import HEARTBEAT_ENV, start_heartbeat\n"
        "start_heartbeat(os.environ[HEARTBEAT_ENV], interval_s=0.2)\n"
        "print('rank', os.environ['RANK'], 'started', flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.5); print('about to hang', flush=True); os.kill(os.getpid(), signal.SIGSTOP)\n"
        "time.sleep(600)\n"
    ), hang_s=4.0)
    assert not outcome.ok
    assert outcome.reason.startswith(f"rank 1 ({socket.gethostname()}) stopped answering: no heartbeat for"), \
        outcome.reason
    assert "about to hang" in outcome.detail and "rank 0" not in outcome.reason
    assert 4.0 < seconds < 20


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 stops answering mid-training (SIGSTOP: alive, silent). Rank 0's next wait gives up after
    strategy.timeout_s, the job fails naming rank 1, and no worker is left behind."""
    import signal

    import psutil

    timeout_s = 5
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", "strategy=gpipe", "trainer.devices=2",
         "trainer.max_steps=100000", "data.global_batch_size=4", "logger=none", "checkpoint.every_n_steps=1",
         f"strategy.timeout_s={timeout_s}"],
        cwd=tmp_path, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints").exists():  # a first step was taken: training is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        workers = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()
                   if "pipeline_recipes.recipe.worker" in " ".join(p.cmdline())}
        assert sorted(workers) == [0, 1]
        workers[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        output = proc.communicate(timeout=timeout_s + 60)[0]
        elapsed = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None)
    assert elapsed < timeout_s + 30, f"the job took {elapsed:.0f}s to end"
    (res,) = find_results([run_dir])
    assert res.status == "failed"
    assert res.reason.startswith(f"rank 1 ({socket.gethostname()}) stopped answering: no heartbeat for"), res.reason
    assert "rank 1 (" in output and "stopped answering" in output
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers.values())


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.seq_len=100"], "sequence length 100 (model.seq_len / data.seq_len) exceeds the model's 64 positions"),
        (["trainer=gpu", "trainer.devices=2"], "trainer.devices = 2 GPUs but this node has no GPU; set trainer=cpu"),
        (["strategy=chimera", "strategy.D=3", "trainer.devices=3"], "chimera needs strategy.D to be even"),
        (["strategy.micro_batch_size=5"], "not divisible by W·B"),
        (["trainer.num_nodes=2"], "trainer.num_nodes = 2 but MASTER_ADDR, MASTER_PORT, NODE_RANK are not set"),
    ],
)
@pytest.mark.slow
def test_bad_settings_stop_before_launch(tmp_path: Path, overrides: list[str], fragment: str) -> None:
    result = _run([str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", *overrides], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert fragment in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "logs").exists()  # no process was started


@pytest.mark.slow
@pytest.mark.parametrize("mode, patience", [("stop", 3), ("skip", 1)])
def test_nonfinite_loss_stops_or_skips(tmp_path: Path, mode: str, patience: int) -> None:
    """At lr 1e30 every loss after the first is NaN: ``stop`` ends the run as diverged at once (exit status 3);
    ``skip`` skips the update of step 2 (its loss null, the run goes on), and the second NaN in a row is one more
    than ``nonfinite_loss_patience=1`` allows: the run ends as diverged."""
    result = _run([str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", "optim.lr=1e30", "trainer.max_steps=3",
                   "trainer.gradient_clip_val=null", "data.global_batch_size=8", "logger=none",
                   f"nonfinite_loss={mode}", f"nonfinite_loss_patience={patience}"], cwd=tmp_path)
    (res,) = find_results([tmp_path])
    last = (result.stderr.strip().splitlines() or [""])[-1]
    if mode == "stop":
        assert result.returncode == 3 and res.status == "diverged", result.stderr[-2000:]
        assert "training loss is nan at step 1" in last and "nonfinite_loss=skip" in res.reason
        assert last.startswith("error: training diverged: rank ")
    else:
        assert result.returncode == 3 and res.status == "diverged", result.stderr[-2000:]
        assert "non-finite 2 steps in a row (nonfinite_loss_patience = 1)" in last
        assert res.loss_history[0] is not None and res.global_step == 2


@pytest.mark.slow
def test_strategy_auto_takes_the_planners_best_layout(tmp_path: Path) -> None:
    env = {**ENV, "HOME": str(tmp_path)}  # the profile cache goes to ~/.cache
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "strategy=auto", "trainer.devices=2",
                             f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2", "logger=none"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    chosen = next(line for line in result.stdout.splitlines() if line.startswith("strategy=auto -> "))
    (res,) = find_results([tmp_path / "run"])
    assert res.status == "ok" and f"strategy.D={res.D}" in chosen and f"strategy.W={res.W}" in chosen
    assert list((tmp_path / ".cache" / "pipeline-recipes" / "planner").glob("profile-*.json"))
