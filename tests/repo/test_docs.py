"""The documentation: every command in it is one a test runs, every relative link points to a file, the README
is short, lists every schedule of the registry and gives CI's exact test command.

**Which commands** (:func:`doc_commands`, the one place the rule is defined): README.md and docs/*.md, every
fenced block opened by ```bash, ```sh or ```console. Inside one, a line ending in a backslash continues on the
next; blank lines and comments (``#`` first) are skipped; a console block's ``$ `` prompt is dropped; a line of
commands joined by ``&&`` gives one command each. Other blocks (```text: output) hold no commands.

**How each is covered** (:func:`coverage`), one of three ways:

(a) ``RUN``: run for real, cheap on a CPU (the schedule viewer, the benchmark tables, ``--cfg job``), in a
    scratch directory linking the checkout's ``conf``, ``recipes``, ``scripts``, ``benchmarks`` and ``train.py``,
    and it must exit 0.
(b) ``FOUND_IN``: the test (or CI script) that runs the same command line. The file must name the program (the
    script's stem, the module after ``-m``, or the executable) and every option and setting of the command:
    each token that starts with ``-`` or holds ``=``, found whole, or as ``key=`` plus ``value``. Positional
    arguments (the user's own paths) and the values of ``hydra.run.dir`` / ``hydra.sweep.dir`` (where the job
    writes) are not compared.
(c) any other ``train.py`` command (directly, under ``torchrun`` or behind ``VAR=value`` assignments): the
    hardware it names is not CI's (GPUs, 8+ devices, several nodes), so it goes through the launcher's own
    pre-launch checks instead (:func:`pipeline_recipes.recipe.check.command.check_command`: the settings, the layout
    rules, the accelerator and the launcher's environment; the memory pre-flight off): composed by Hydra's
    compose API from ``conf/`` (or ``recipes/``), on a node of eight H100 GPUs under ``trainer=gpu``, a CPU node
    under ``trainer=cpu``, and on both under ``trainer=auto`` (the node decides), in the environment its launcher sets (torchrun's, the assignments, or one SLURM task per
    rank under ``hydra/launcher=slurm``); a sweep (``-m``) is checked point by point.

A command none of these covers fails the test, and so does a ``RUN`` or ``FOUND_IN`` entry no page holds any
more.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from pipeline_recipes.core.node import NodeDevices
from pipeline_recipes.recipe.check.command import check_command
from pipeline_recipes.strategies.schedules import names

ROOT = Path(__file__).resolve().parents[2]
CONF, RECIPES = ROOT / "conf", ROOT / "recipes"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 20_000
GIB = 2**30
GPU_NODE = NodeDevices(8, True, "NVIDIA H100 80GB HBM3", None, 80 * GIB)
CPU_NODE = NodeDevices()
NODES = {"cpu": (CPU_NODE,), "gpu": (GPU_NODE,), "auto": (CPU_NODE, GPU_NODE)}  # trainer=auto: either node


# (a) cheap on a CPU: run for real
RUN = {
    "python train.py --cfg job strategy=dapple strategy.micro_batch_size=2",
    "python scripts/schedule.py chimera --stages 4 --micro-batches 4",
    "python scripts/schedule.py chimera --stages 4 --micro-batches 16 --concat auto",
    "python scripts/schedule.py dapple --stages 8 --micro-batches 16 --t-f 1 --t-b 2",
    "python scripts/schedule.py zbv --workers 4 --micro-batches 8 --png zbv.png",
    "python scripts/schedule.py interleaved_1f1b --workers 4 --chunks 2 --micro-batches 8 --json",
    "python scripts/schedule.py pipedream_2bw --stages 4 --micro-batches 4 --steps 3",
    "python scripts/bench_tables.py benchmarks/bench.json",
}

_SRUN_D2 = ("trainer=cpu trainer.devices=2 trainer.num_nodes=2 strategy=dapple strategy.D=2 "
            "hydra.run.dir=/shared/runs/d2")
# (b) the command -> the file that runs the same command line
FOUND_IN = {
    'pip install "torch==2.13.0" -e .': ".ci/run",
    'pip install "torch==2.13.0" -e ".[test]"': ".ci/run",
    "python -m pytest -q": ".ci/run",
    "python train.py strategy=dapple strategy.D=2 trainer.devices=4 trainer.max_steps=3 data.global_batch_size=8 "
    "logger=csv": "tests/e2e/test_train_e2e.py",
    "python scripts/compare.py sweeps/s1": "tests/recipe/test_compare.py",
    "python scripts/plan.py cluster=piz-daint model=gpt2 trainer.devices=2048 data.global_batch_size=2048 --compare "
    "--json plan.json": "tests/planner/test_planner_cluster.py",
    "python scripts/compare.py multirun/schedules-cpu": "tests/recipe/test_compare.py",
    "python scripts/plan.py model=gpt2-tiny trainer.devices=2 data.global_batch_size=4 --json plan.json":
        "tests/planner/test_planner.py",
    # train.py turns strategy=auto into the planner's layout with recipe.auto.auto_overrides, which the test calls
    "python train.py strategy=auto model=gpt2-tiny trainer.devices=2 data.global_batch_size=4": "tests/planner/test_planner.py",
    "python train.py trainer=gpu trainer.devices=1 model=gpt2 strategy=single data.global_batch_size=16 "
    "preflight=report": "tests/planner/test_preflight_precision.py",
    "python train.py trainer=cpu trainer.devices=2 strategy=gpipe strategy.D=2 data.global_batch_size=4 "
    "trainer.max_steps=4 checkpoint.every_n_steps=2 ckpt_path=auto hydra.run.dir=runs/g1": "tests/recipe/test_resume_checks.py",
    # the scripts' main / export functions on a checkpoint the test trains
    "python scripts/consolidate_ckpt.py runs/g1/checkpoints/step-000004.ckpt full.ckpt": "tests/strategies/runtime/test_checkpoint.py",
    "python scripts/export_hf.py runs/g1/checkpoints/step-000004.ckpt hf-model/": "tests/strategies/runtime/test_checkpoint.py",
    "sbatch --nodes=2 --cpus-per-task=2 scripts/train.sbatch trainer=cpu trainer.devices=2 trainer.num_nodes=2 "
    "strategy=dapple strategy.D=2 checkpoint.every_n_steps=100": "tests/e2e/test_slurm_jobs.py",
    f"srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=2 python train.py {_SRUN_D2}":
        "tests/e2e/test_slurm_jobs.py",
    f"srun --nodes=2 --ntasks=4 --ntasks-per-node=2 python train.py {_SRUN_D2}": "tests/e2e/test_slurm_jobs.py",
    "python train.py -m hydra/launcher=slurm hydra.launcher.timeout_min=10 trainer=cpu trainer.devices=2 "
    "strategy=gpipe,dapple strategy.D=2": "tests/e2e/test_slurm_jobs.py",
    "python scripts/slurm_cluster.py start --nodes 2 --dir /tmp/slurm": "tests/e2e/test_slurm_cluster.py",
    "srun --nodes=2 --ntasks-per-node=2 hostname": "tests/e2e/test_slurm_cluster.py",
    "python scripts/slurm_cluster.py stop --dir /tmp/slurm": "tests/e2e/test_slurm_cluster.py",
    "bash scripts/gpu_check.sh gpu-check-out": "tests/e2e/test_gpu_check.py",
    'python -m pytest -o addopts="-ra --strict-markers" -m gpu tests/strategies/runtime/test_cuda_graphs.py tests/strategies/runtime/test_gpu.py': "scripts/gpu_check.sh",
    "python scripts/bench.py --parts gpu --device cpu --tiny --out bench_gpu.json": "tests/e2e/test_gpu_check.py",
}


# -- extraction --------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\s*$")


def doc_commands(page: Path) -> list[str]:
    """The commands of ``page``, by the module docstring's rule."""
    out: list[str] = []
    shell, pending = None, ""
    for line in page.read_text().splitlines():
        fence = FENCE.match(line.strip())
        if fence:
            shell = None if shell is not None else fence.group(1)
            continue
        if shell not in ("bash", "sh", "console"):
            continue
        text = line.strip()
        if shell == "console" and text.startswith("$ "):
            text = text[2:]
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        text, pending = (pending + text).strip(), ""
        if text and not text.startswith("#"):
            out += [part.strip() for part in text.split("&&")]
    return out


def all_commands() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in doc_commands(page)]


COMMANDS = all_commands()


def coverage(command: str) -> str:
    if command in RUN:
        return "a"
    if command in FOUND_IN:
        return "b"
    if _train_args(command) is not None:
        return "c"
    return "none"


def test_every_command_is_covered_and_every_entry_is_in_the_docs() -> None:
    assert COMMANDS, "no commands found"
    uncovered = [(page, cmd) for page, cmd in COMMANDS if coverage(cmd) == "none"]
    assert not uncovered, f"commands no test runs: {uncovered}"
    documented = {cmd for _, cmd in COMMANDS}
    assert not (set(RUN) | set(FOUND_IN)) - documented, "entries of commands no page holds any more"


def test_the_extraction_rule(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    lines = ("```bash", "# a comment", "a \\", "  b && c", "", "```", "```text", "not a command", "```",
             "```console", "$ d", "```")
    page.write_text("\n".join(lines))
    assert doc_commands(page) == ["a b", "c", "d"]


# -- (a) run for real --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that looks like the checkout (links), so commands write nothing into it."""
    work = tmp_path_factory.mktemp("docs")
    for name in ("conf", "recipes", "scripts", "benchmarks", "train.py"):
        (work / name).symlink_to(ROOT / name)
    return work


@pytest.mark.parametrize("command", sorted(RUN))
@pytest.mark.slow
def test_run(command: str, scratch: Path) -> None:
    argv = shlex.split(command)
    assert argv[0] == "python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, *argv[1:]], cwd=scratch, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip()


# -- (b) found in the test that runs it --------------------------------------------------------------------------

def _program(argv: list[str]) -> tuple[str, list[str]]:
    """The program a test must name and the arguments after it."""
    if argv[0] in ("python", "bash"):
        if argv[1] == "-m":
            return argv[2], argv[3:]
        return Path(argv[1]).stem if argv[1] != "train.py" else "train.py", argv[2:]
    return argv[0], argv[1:]


def _found(token: str, text: str) -> bool:
    if token in text:
        return True
    if "=" not in token:
        return False
    key, value = token.split("=", 1)
    if key in ("hydra.run.dir", "hydra.sweep.dir"):
        return f"{key}=" in text
    return f"{key}=" in text and value in text


@pytest.mark.parametrize("command", sorted(FOUND_IN))
def test_found_in(command: str) -> None:
    text = (ROOT / FOUND_IN[command]).read_text()
    program, args = _program(shlex.split(command))
    assert program in text, f"{FOUND_IN[command]} does not name {program}"
    missing = [a for a in args if (a.startswith("-") or "=" in a) and not _found(a, text)]
    assert not missing, f"{FOUND_IN[command]} does not run {command!r}: missing {missing}"


def test_ci_runs_the_readmes_test_command() -> None:
    """``.ci/run`` calls the README's test command verbatim (its last line)."""
    readme = doc_commands(ROOT / "README.md")
    test_command = next(c for c in readme if c.startswith('pip install "torch==2.13.0" -e ".[test]"'))
    line = f"{test_command} && {readme[readme.index(test_command) + 1]}"
    assert line == 'pip install "torch==2.13.0" -e ".[test]" && python -m pytest -q'
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip()]
    assert ci_lines[-1] == line


# -- (c) checked before launch -----------------------------------------------------------------------------------

def _train_args(command: str) -> tuple[dict[str, str], list[str]] | None:
    """``(environment, train.py's arguments)`` of a train.py command, or None."""
    argv = [a.replace("$NODE", "0") for a in shlex.split(command)]
    env: dict[str, str] = {}
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    if argv[:2] == ["python", "train.py"]:
        return env, argv[2:]
    if argv and argv[0] == "torchrun" and "train.py" in argv:
        at = argv.index("train.py")
        flags = dict(a.lstrip("-").split("=", 1) for a in argv[1:at])
        nodes, per_node, node = int(flags.get("nnodes", 1)), int(flags["nproc_per_node"]), int(flags.get("node_rank", 0))
        env.update(TORCHELASTIC_RUN_ID="docs", WORLD_SIZE=str(nodes * per_node), LOCAL_WORLD_SIZE=str(per_node),
                   RANK=str(node * per_node), GROUP_RANK=str(node), LOCAL_RANK="0",
                   MASTER_ADDR=flags.get("master_addr", "127.0.0.1"), MASTER_PORT=flags.get("master_port", "29500"))
        return env, argv[at + 1:]
    return None


def _points(args: list[str]) -> tuple[str, list[list[str]], bool]:
    """The config name, the overrides of every point (a sweep's product), and whether SLURM launches it."""
    name, multirun, slurm, overrides = "config", False, False, []
    it = iter(args)
    for arg in it:
        if arg == "--config-dir":
            assert next(it) == "recipes"
        elif arg == "--config-name":
            name = next(it)
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg.startswith(("hydra/launcher=", "hydra.")):
            slurm = slurm or arg == "hydra/launcher=slurm"
        else:
            overrides.append(arg)
    if not multirun:
        return name, [overrides], slurm
    choices = [[f"{a.split('=', 1)[0]}={v}" for v in a.split("=", 1)[1].split(",")] if "," in a and "[" not in a
               else [a] for a in overrides]
    return name, [list(p) for p in itertools.product(*choices)], slurm


def _slurm_env(cfg) -> dict[str, str]:
    """One SLURM task per rank, as the submitit preset starts them."""
    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.get("num_nodes", 1))
    return {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(devices * nodes),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(devices), "SLURM_PROCID": "0",
            "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_NODELIST": f"n[1-{nodes}]"}


CHECKED = [(page, cmd) for page, cmd in COMMANDS if coverage(cmd) == "c"]


@pytest.mark.parametrize("page, command", CHECKED, ids=[cmd[:80] for _, cmd in CHECKED])
@pytest.mark.slow
def test_checked_before_launch(page: str, command: str) -> None:
    env, args = _train_args(command)
    name, points, slurm = _points(args)
    primary, extra = (CONF, RECIPES) if name == "config" else (RECIPES, CONF)
    with initialize_config_dir(config_dir=str(primary), version_base="1.3"):
        for point in points:
            overrides = [f"hydra.searchpath=[file://{extra}]", *point, "preflight=false"]
            accelerator = compose(name, overrides=overrides).trainer.get("accelerator")
            for node in NODES[accelerator]:
                cfg = compose(name, overrides=overrides)  # check_command sets the concrete trainer on it
                layout = check_command(cfg, node=node, env={**env, **(_slurm_env(cfg) if slurm else {})},
                                       prepare=False, vet_fixes=False)
                assert layout.world_size >= 1, (page, point)


# -- links, size, the schedule table -----------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings."""
    heads = [ln.lstrip("#").strip() for ln in page.read_text().splitlines() if ln.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_point_to_files(page: Path) -> None:
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= README_MAX_BYTES


def test_readme_table_lists_every_schedule_of_the_registry_with_its_picture() -> None:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Schedules"):].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|.*\[\w+\]\((docs/img/\w+\.png)\) \|$", table, flags=re.MULTILINE)
    assert [name for name, _ in rows] == list(names())
    assert all(picture == f"docs/img/{name}.png" and (ROOT / picture).is_file() for name, picture in rows)
