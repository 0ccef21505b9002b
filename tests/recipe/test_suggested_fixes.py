"""Every fix a refusal proposes passes every check: a property over a grid of refused commands.

The grid is enumerated, not picked: every schedule of the registry and both baselines × devices × D, with the
model (3 to 8 pipeline layers), the micro-batch size, the global batch and a setting of the schedule's own (its
pipelines, concatenation or chunks as its spec allows, the gradient sync and recomputation of an asynchronous one,
W, CUDA graphs, a misspelled value) taken in turn, so that every combination of those recurs along the grid;
then commands on a node with fewer GPUs than processes (or without bf16), under torchrun and SLURM, and with a
value outside each setting's fixed set. Each command runs the launcher's own checks in-process
(:func:`pipeline_recipes.recipe.check.command.check_command`; nothing is launched). For every refusal:

* it proposes something, and its message names every override it proposes (rendered from them);
* each fix, applied to the command line and composed by Hydra, passes every check again;
* where it says that no value of a setting works, no value tried does (the layout's rules or the whole check
  refuse each one), and the alternatives it names pass.

The memory pre-flight estimates the model with torch: a handful of commands with a budget that their layout
exceeds test its refusals (and that a layout refusal's fixes fit in memory too) in their own test.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir

from pipeline_recipes.core.node import NodeDevices
from pipeline_recipes.recipe.check.command import Checked, Command, check_command
from pipeline_recipes.core.fixes import ConfigError
from pipeline_recipes.recipe.check.settings import BASELINES, resolve_layout
from pipeline_recipes.strategies.schedules import get_spec, names

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = frozenset(p.name for p in CONF.iterdir() if p.is_dir())
GIB = 2**30
CPU_NODE = NodeDevices()
GPU_NODE = NodeDevices(4, True, "NVIDIA H100 80GB HBM3", None, 80 * GIB)  # 4 GPUs with bf16
V100_NODE = NodeDevices(8, False, "Tesla V100-SXM2-32GB", None, 32 * GIB)  # no bf16
COMMON = ("logger=none", "preflight=false")

MODELS = (("model=gpt2-tiny", "model.n_layer=1"), ("model=llama-tiny", "model.num_hidden_layers=2"),
          ("model=gpt2-tiny",), ("model=llama-tiny", "model.num_hidden_layers=6"))  # 3, 4, 6 and 8 layers
DEVICES = (1, 2, 3, 4, 6, 8)
DEPTHS = (1, 2, 3, 4, 8)
MICRO_BATCHES = (1, 2, 3)
GLOBAL_BATCHES = (4, 6, 8, 12, 16)

# values each claim "no value of <setting> works" is tried with
DOMAINS = {"strategy.D": range(1, 17), "strategy.micro_batch_size": range(1, 17),
           "data.global_batch_size": range(1, 65), "strategy.pipelines": range(1, 9),
           "strategy.chunks": range(1, 7), "strategy.W": range(1, 9),
           "strategy.concat": ("direct", "forward_doubling", "backward_halving", "auto")}


@pytest.fixture(scope="module")
def composer() -> Iterator[Any]:
    """Hydra's compose API over ``conf/``, once per choice of config groups (the rest of a command is set on a
    copy, as Hydra sets overrides)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield functools.lru_cache(maxsize=None)(lambda chosen: compose("config", overrides=list(chosen)))


def _extras(schedule: str) -> list[tuple[str, ...]]:
    """A schedule's own settings to take in turn, from its registry spec (baselines: none)."""
    if schedule in BASELINES:
        return [()]
    spec = get_spec(schedule)
    out: list[tuple[str, ...]] = [(), ("strategy.W=2",), ("strategy.cuda_graphs=true",),
                                  ("strategy.recompute=alway",)]
    key = "strategy.pipelines" if "pipelines" in _strategy_keys(schedule) else "+strategy.pipelines"
    out += [(f"{key}=4",), (f"{key}=3",)] if spec.pipelines.choices else [(f"{key}=4",)]
    out += ([("strategy.concat=backward_halving",), ("strategy.concat=auto",), ("strategy.concat=forward_dubling",)]
            if spec.concat else [("+strategy.concat=auto",)])
    out += [("strategy.chunks=3",), ("strategy.chunks=1",)] if spec.chunks.choosable else [("strategy.chunks=2",)]
    if spec.asynchronous:
        out += [("strategy.recompute=always",), ("strategy.grad_sync=eager",)]
    return out


@functools.cache
def _strategy_keys(schedule: str) -> frozenset[str]:
    text = yaml.safe_load((CONF / "strategy" / f"{schedule}.yaml").read_text())
    return frozenset(text)


def layout_grid(schedule: str) -> list[tuple[str, ...]]:
    """The commands of one schedule: devices × D, the other settings in turn (coprime cycles of the index)."""
    extras = _extras(schedule)
    out = []
    for i, (devices, D) in enumerate(itertools.product(DEVICES, DEPTHS)):
        sizes = () if schedule in BASELINES or get_spec(schedule).fixed_micro_batches else (
            f"strategy.micro_batch_size={MICRO_BATCHES[i % len(MICRO_BATCHES)]}",)
        out.append((f"strategy={schedule}", "trainer=cpu", f"trainer.devices={devices}", f"strategy.D={D}",
                    f"data.global_batch_size={GLOBAL_BATCHES[i % len(GLOBAL_BATCHES)]}", *sizes,
                    *MODELS[i % len(MODELS)], *extras[i % len(extras)], *COMMON))
    return out


def _refusal(command: Command, node: NodeDevices, env: dict[str, str], found: Checked | None = None,
             cfg: Any = None, **options: Any) -> ConfigError | None:
    """The refusal of ``command`` by the launcher's checks (``cfg``: its config, composed already), or None."""
    cfg = command.config() if cfg is None else cfg
    assert cfg is not None, command.overrides
    try:
        check_command(cfg, found, command=command, node=node, env=env, **options)
    except ConfigError as err:
        return err
    return None


def _layout_refuses(found: Checked, key: str, value: Any) -> bool:
    """Whether the layout's rules alone refuse ``key=value`` on the refused command's layout settings."""
    strategy, trainer, batch, layers, _ = found.layout_inputs
    strategy, trainer = dict(strategy), dict(trainer)
    if key == "data.global_batch_size":
        batch = value
    else:
        strategy[key.split(".", 1)[1]] = value
    try:
        resolve_layout(strategy, trainer, batch, layers, vet_fixes=False)
    except ConfigError:
        return True
    return False


def problems(command: Command, node: NodeDevices = CPU_NODE, env: dict[str, str] | None = None,
             **options: Any) -> tuple[ConfigError | None, list[str]]:
    """The refusal of ``command`` (None: it passes), and what is wrong with its fixes (nothing: all is well)."""
    env = {} if env is None else env
    found = Checked()
    err = _refusal(command, node, env, found, **options)
    if err is None:
        return None, []
    where = f"{' '.join(command.overrides)}\n  -> {err}"
    out = []
    if not err.fixes:
        out.append(f"proposes no fix: {where}")
    for fix in err.fixes:
        if any(key not in str(err) or value not in str(err) for key, value in fix.items()):
            out.append(f"the message does not name {fix}: {where}")
        fixed = command.with_fix(fix)
        if (cfg := fixed.config()) is None:
            out.append(f"{fix} does not compose: {where}")
        elif (again := _refusal(fixed, node, env, cfg=cfg, vet_fixes=False, **options)) is not None:
            out.append(f"{fix} is refused again: {again}\n  by {where}")
    if err.stuck and found.layout_inputs is not None:
        for key in (k for k in err.refused if k in DOMAINS):
            for value in DOMAINS[key]:
                if _layout_refuses(found, key, value):
                    continue
                if _refusal(command.with_fix({key: str(value)}), node, env, vet_fixes=False, **options) is None:
                    out.append(f"says no value of {key} works, but {key}={value} does: {where}")
    return err, out


def _command(composer: Any, overrides: tuple[str, ...]) -> Command:
    return Command(overrides, composer, GROUPS)


@pytest.mark.parametrize("schedule", [*names(), *BASELINES])
@pytest.mark.slow
def test_every_fix_of_a_layout_refusal_passes_every_check(composer: Any, schedule: str) -> None:
    refused, failures = 0, []
    for overrides in layout_grid(schedule):
        err, found = problems(_command(composer, overrides))
        refused += err is not None
        failures += found
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} in all)"
    assert refused >= len(DEVICES) * len(DEPTHS) // 3  # the grid is mostly refusals


def gpu_grid() -> list[tuple[tuple[str, ...], NodeDevices]]:
    """``trainer=gpu`` with more processes than the node's 4 GPUs (and CUDA graphs with what they cannot
    capture), and on a node without bf16."""
    out = [((f"strategy={s}", "trainer=gpu", f"trainer.devices={devices}", f"strategy.D={D}", *COMMON), GPU_NODE)
           for s in ("gpipe", "chimera", "dualpipev", "interleaved_1f1b", "pipedream", "ddp")
           for devices in (5, 8) for D in (1, 2, 4)]
    graphs = [("strategy=dapple", "strategy.recompute=always"), ("strategy=pipedream_2bw",), ("strategy=zb_h1",),
              ("strategy=chimera", "strategy.concat=backward_halving", "strategy.micro_batch_size=2")]
    out += [((*g, "trainer=gpu", "trainer.devices=4", "strategy.D=2", "strategy.cuda_graphs=true", *COMMON), GPU_NODE)
            for g in graphs]
    out += [((f"strategy={s}", "trainer=gpu", "trainer.devices=8", "strategy.D=4", *COMMON), V100_NODE)
            for s in ("gpipe", "chimera")]
    return out


@pytest.mark.slow
def test_every_fix_of_a_gpu_refusal_passes_every_check(composer: Any) -> None:
    refused, failures = 0, []
    for overrides, node in gpu_grid():
        err, found = problems(_command(composer, overrides), node)
        refused += err is not None
        failures += found
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} in all)"
    assert refused >= len(gpu_grid()) // 2


TORCHRUN = {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}
SLURM = {"SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1",
         "SLURM_NODELIST": "gpu[01-02]", "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize("env", [TORCHRUN, SLURM], ids=["torchrun", "slurm"])
@pytest.mark.slow
def test_every_fix_of_a_cluster_refusal_passes_every_check(composer: Any, env: dict[str, str]) -> None:
    """A launcher that started other processes than ``trainer.devices × trainer.num_nodes``."""
    refused, failures = 0, []
    for schedule, devices, D in itertools.product(("gpipe", "chimera", "dualpipev"), (2, 3, 8), (2, 3)):
        overrides = (f"strategy={schedule}", "trainer=cpu", f"trainer.devices={devices}", f"strategy.D={D}", *COMMON)
        err, found = problems(_command(composer, overrides), env=env)
        refused += err is not None
        failures += found
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} in all)"
    assert refused >= 9


SETTINGS = ("strategy.grad_sync=eagr", "strategy.recompute=alway", "strategy.recompute=always",
            "strategy.grad_sync=eager", "checkpoint.keep=last", "nonfinite_loss=skipp", "preflight=maybe",
            "model.compile=atuo", "data.num_workers=-1", "data.pin_memory=yes", "model.loss_chunk_tokens=0",
            "model.seq_len=128", "trainer.float32_matmul_precision=tf32", "+trainer.strategy=ddp",
            "trainer.peak_tflops=-1", "trainer.precision=16-mixed", "strategy.schedule=chimra",
            "data.global_batch_size=0", "strategy.D=0", "trainer.num_nodes=0")


@pytest.mark.parametrize("schedule", ["dapple", "pipedream_2bw", "chimera", "ddp"])
@pytest.mark.slow
def test_every_fix_of_a_settings_refusal_passes_every_check(composer: Any, schedule: str) -> None:
    """A value outside a setting's set or range, with each kind of schedule (an asynchronous one refuses what the
    near miss of a misspelled value may propose)."""
    refused, failures = 0, []
    for setting in SETTINGS:
        command = _command(composer, (f"strategy={schedule}", "trainer=cpu", "trainer.devices=4", setting, *COMMON))
        if command.config() is None:  # a key this strategy's config lacks: train.py's key check refuses it
            continue
        err, found = problems(command)
        refused += err is not None
        failures += found
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} in all)"
    assert refused >= 10


MEMORY = [  # (overrides, budget as a share of what the command's own layout is predicted to need)
    (("strategy=dapple", "strategy.D=2", "strategy.micro_batch_size=4"), 0.6),
    (("strategy=chimera", "strategy.D=2", "strategy.micro_batch_size=8"), 0.5),
    (("strategy=gpipe", "strategy.D=2", "strategy.micro_batch_size=8", "strategy.cuda_graphs=true",
      "trainer=gpu"), 0.7),
]


@pytest.mark.parametrize("overrides, share", MEMORY)
@pytest.mark.slow
def test_every_fix_of_a_memory_refusal_fits_and_passes_every_check(composer: Any, overrides: tuple[str, ...],
                                                                   share: float) -> None:
    """The pre-flight's layouts of the same devices and global batch are fixes like any other: each one, applied to
    the command, passes every check with the memory pre-flight on (and the same budget). A refusal before the
    pre-flight (D = 3 on 2 processes) is vetted without it (no torch for a layout error): its fixes pass every other
    check, with the pre-flight off."""
    from pipeline_recipes.planner.preflight import PreflightError

    node = GPU_NODE if "trainer=gpu" in overrides else CPU_NODE
    base = ("model=gpt2-tiny", "model.n_layer=6", "trainer.devices=2", "data.global_batch_size=16", "logger=none",
            *overrides)
    found = Checked()
    check_command(_command(composer, (*base, "preflight=report")).config(), found, node=node, env={})
    per_rank = max(found.report["predicted_peak_bytes_per_rank"])
    budget = int(per_rank * (1 if node.cuda_devices else found.report["ranks_per_node"]) * share)
    err, failures = problems(_command(composer, (*base, "preflight=true")), node, budget_bytes=budget)
    assert isinstance(err, PreflightError) and err.fixes and not failures, "\n".join(failures)
    err = _refusal(_command(composer, (*base, "strategy.D=3", "preflight=true")), node, {}, budget_bytes=budget)
    assert not isinstance(err, PreflightError) and err.fixes, err
    err_off, failures = problems(_command(composer, (*base, "strategy.D=3", "preflight=false")), node)
    assert err_off.fixes == err.fixes and not failures, "\n".join(failures)
