"""Where this process sits in a job: who started it, its global rank, and where the ranks meet.

Three ways to run a job of ``trainer.devices × trainer.num_nodes`` processes:

* ``self``: ``train.py`` starts the node's workers itself (one per local rank, :mod:`pipeline_recipes.recipe.launch.main`).
  On one node it picks a free port; on several, every node runs the same command with
  ``MASTER_ADDR``/``MASTER_PORT`` (node 0's address and a free port there) and ``NODE_RANK`` set,
  or SLURM runs one task per node (``--ntasks-per-node=1``) and those come from SLURM.
* ``torchrun``: the processes exist (``TORCHELASTIC_RUN_ID``); the rank is ``RANK`` — torchrun sets
  no ``NODE_RANK`` (its node index is ``GROUP_RANK``).
* ``slurm``: ``srun`` (or Hydra's submitit launcher) started one task per process; the rank is
  ``SLURM_PROCID``, and :func:`rank_env` gives Lightning the rest (as its ``SLURMEnvironment`` would, also
  under ``salloc``, whose job name ``interactive`` makes Lightning ignore SLURM).

A process is a SLURM task when it runs in a job step (``SLURM_STEP_ID``, set by ``srun``), whatever the job's
name. Inside an allocation but outside a step (an ``salloc`` shell, an ``sbatch`` script) ``train.py`` starts the
workers of this node only, so a job of several nodes is refused there with the ``srun`` line that runs it.

:func:`detect_launch` reads only the environment it is given, so tests fake a cluster with a dict,
and it refuses a multi-node job that could never meet (no address, port or node rank) before any
process starts, instead of letting every rank wait out ``strategy.timeout_s``.
``results.json``, the summary and the W&B run are written by global rank 0 only
(:func:`is_global_zero`), into its job directory; checkpoints go to rank 0's directory too
(Lightning's ``ModelCheckpoint`` broadcasts it), which on several nodes must be a shared file system.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline_recipes.core.fixes import ConfigError, Proposal, fixes_of

SLURM_PORT_BASE = 15000  # Lightning's SLURMEnvironment: port = 15000 + the last 4 digits of the job id
# SLURM's per-task variables: workers started by train.py drop them, or Lightning would take every
# worker for SLURM task SLURM_PROCID of SLURM_NTASKS.
SLURM_TASK_VARS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                   "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NUM_TASKS")


@dataclass(frozen=True)
class Launch:
    """How this process takes part in the job."""

    launcher: str  # "self" | "torchrun" | "slurm" | "env" (LOCAL_RANK/RANK set by another launcher)
    node_rank: int
    rank: int | None  # this process's global rank; None for train.py starting its node's workers
    master_addr: str = "127.0.0.1"
    master_port: str | None = None  # None: one node, any free port
    tasks: str = ""  # how SLURM started this process, said by describe(): e.g. "one SLURM task per node (2 tasks)"

    @property
    def external(self) -> bool:
        """True when the processes already exist and the job runs in this one."""
        return self.launcher != "self"

    @property
    def is_global_zero(self) -> bool:
        """Global rank 0 (an external rank), or the node-0 process that starts rank 0."""
        return self.rank == 0 if self.rank is not None else self.node_rank == 0

    def describe(self) -> str:
        where = f"node {self.node_rank}" + ("" if self.rank is None else f", rank {self.rank}")
        tasks = f", {self.tasks}" if self.tasks else ""
        return (f"launcher: {self.launcher} ({where}; rendezvous {self.master_addr}:{self.master_port or 'free port'})"
                + tasks)


def _int(env: Mapping[str, str], key: str) -> int | None:
    """An integer variable; SLURM's ``8(x4)`` counts read as 8. None when unset or not a number."""
    match = re.match(r"\s*(\d+)", env.get(key) or "")
    return int(match.group(1)) if match else None


def slurm_tasks(env: Mapping[str, str]) -> int | None:
    """The tasks of the SLURM job step this process is a task of (``srun`` sets ``SLURM_STEP_ID``); None outside
    a step: not under SLURM, or in an ``salloc`` shell or ``sbatch`` script."""
    if env.get("SLURM_STEP_ID") is None:
        return None
    return _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")


def global_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's global rank: ``RANK`` (torchrun, train.py's workers), else ``SLURM_PROCID``
    when SLURM runs the tasks; None in a process that is not a rank."""
    env = os.environ if env is None else env
    rank = _int(env, "RANK")
    if rank is None and slurm_tasks(env) is not None:
        rank = _int(env, "SLURM_PROCID")
    return rank


def is_global_zero(env: Mapping[str, str] | None = None) -> bool:
    """Inside a rank: global rank 0. In train.py's parent process: the one on node 0."""
    env = os.environ if env is None else env
    rank = global_rank(env)
    if rank is not None:
        return rank == 0
    return (_int(env, "NODE_RANK") or 0) == 0 and (_int(env, "LOCAL_RANK") or 0) == 0


def slurm_root_address(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,09],cpu1`` -> ``gpu03``, ``a,b`` -> ``a``."""
    first = re.split(r"[,\s](?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"([^\[]*)\[([^\],-]+)", first)
    return match.group(1) + match.group(2) if match else first


def slurm_port(job_id: str | None) -> str:
    """Lightning's port for a SLURM job: 15000 + the job id's last 4 digits (12910 without a job id)."""
    digits = re.sub(r"\D", "", job_id or "")
    return str(SLURM_PORT_BASE + int(digits[-4:])) if digits else "12910"


def srun_line(devices: int, num_nodes: int, per_node: bool = True) -> str:
    """The ``srun`` options that run a job of ``devices`` processes on each of ``num_nodes`` nodes: one task per
    node (``train.py`` starts that node's workers, each a CPU) or one task per process."""
    if per_node:
        return f"srun --nodes={num_nodes} --ntasks={num_nodes} --ntasks-per-node=1 --cpus-per-task={devices}"
    return f"srun --nodes={num_nodes} --ntasks={devices * num_nodes} --ntasks-per-node={devices}"


def _fix_hint(devices: int, num_nodes: int) -> str:
    return (f"run one task per process ({srun_line(devices, num_nodes, per_node=False)}, or hydra/launcher=slurm) "
            f"or one per node ({srun_line(devices, num_nodes)}: train.py starts the {devices} workers of each "
            "node); srun takes the task counts of the allocation (sbatch/salloc --ntasks, --ntasks-per-node) unless "
            "given its own --ntasks and --ntasks-per-node")


def _world_fixes(sizes: dict[str, int], world: int) -> list[Proposal]:
    """The fix ``sizes`` (``trainer.devices`` / ``trainer.num_nodes``) for ``world`` processes, alone or with
    another ``strategy.D`` (a divisor of them, the largest first)."""
    divisors = [d for d in range(world, 0, -1) if world % d == 0]
    return [fixes_of(sizes), fixes_of(*({**sizes, "strategy.D": d} for d in divisors), keep=1)]


def _torchrun_fixes(started: int | None, per_node: int | None) -> list[Proposal]:
    """``trainer.devices`` and ``trainer.num_nodes`` as torchrun's ``--nproc_per_node`` and ``--nnodes``
    (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE`` / it)."""
    if not started or not per_node or started % per_node:
        return []
    return _world_fixes({"trainer.devices": per_node, "trainer.num_nodes": started // per_node}, started)


def detect_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    """How this process runs a job of ``devices`` processes on each of ``num_nodes`` nodes.

    Raises :class:`ConfigError` (naming the variables, values and the fix) when the launcher's
    processes do not match ``trainer.devices × trainer.num_nodes``, or when several nodes have no
    address, port or node rank to meet at.
    """
    world = devices * num_nodes
    sizes = f"trainer.devices × trainer.num_nodes = {devices}·{num_nodes} = {world}"
    if env.get("TORCHELASTIC_RUN_ID") is not None:  # torchrun first, also inside SLURM (as Lightning)
        started = _int(env, "WORLD_SIZE")
        if started != world:
            raise ConfigError(f"torchrun started WORLD_SIZE = {env.get('WORLD_SIZE')} processes but {sizes}: "
                              "trainer.devices is torchrun's --nproc_per_node and trainer.num_nodes its --nnodes",
                              _torchrun_fixes(started, _int(env, "LOCAL_WORLD_SIZE")))
        return Launch("torchrun", _int(env, "GROUP_RANK") or 0, _int(env, "RANK"),
                      env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT"))
    if env.get("LOCAL_RANK") is not None:  # a rank started by another launcher, Lightning's manual mode
        node, local = _int(env, "NODE_RANK") or 0, _int(env, "LOCAL_RANK") or 0
        rank = _int(env, "RANK")
        return Launch("env", node, node * devices + local if rank is None else rank,
                      env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT"))
    tasks = slurm_tasks(env)
    if tasks is not None and tasks > 1:
        nnodes, per_node = _int(env, "SLURM_NNODES"), _int(env, "SLURM_NTASKS_PER_NODE")
        addr = env.get("MASTER_ADDR") or slurm_root_address(env.get("SLURM_NODELIST")  # as Lightning reads it
                                                             or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
        port = env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID"))
        if nnodes is not None and nnodes != num_nodes:
            raise ConfigError(f"SLURM runs this job on SLURM_NNODES = {nnodes} nodes but trainer.num_nodes = "
                              f"{num_nodes} (or run it with srun --nodes={num_nodes})",
                              _world_fixes({"trainer.num_nodes": nnodes}, nnodes * devices))
        if tasks == world:  # one task per process: the job runs in them
            if per_node != devices:
                raise ConfigError(f"SLURM started SLURM_NTASKS = {tasks} tasks with SLURM_NTASKS_PER_NODE = "
                                  f"{env.get('SLURM_NTASKS_PER_NODE')} but trainer.devices = {devices}: start them "
                                  f"with --ntasks-per-node={devices} (Lightning reads the tasks per node from it)")
            said = f"one SLURM task per rank ({tasks} tasks, {per_node} per node)"
            return Launch("slurm", _int(env, "SLURM_NODEID") or 0, _int(env, "SLURM_PROCID"), addr, port, said)
        if tasks == num_nodes:  # one task per node: train.py starts the node's workers
            node = _int(env, "SLURM_NODEID")
            said = f"one SLURM task per node ({tasks} tasks): train.py starts each node's {devices} workers"
            return Launch("self", _int(env, "SLURM_PROCID") if node is None else node, None, addr, port, said)
        raise ConfigError(f"SLURM started SLURM_NTASKS = {tasks} tasks but {sizes}: {_fix_hint(devices, num_nodes)}",
                          _world_fixes({"trainer.devices": tasks // num_nodes}, tasks)
                          if tasks % num_nodes == 0 else ())
    if num_nodes > 1 and env.get("SLURM_JOB_ID") and not env.get("MASTER_ADDR"):
        raise ConfigError(
            f"trainer.num_nodes = {num_nodes} but this process is not a SLURM task (SLURM_JOB_ID = "
            f"{env['SLURM_JOB_ID']} without SLURM_STEP_ID: an salloc shell or an sbatch script, which run on one "
            f"node): start train.py on every node with {srun_line(devices, num_nodes)} python train.py ...")
    if num_nodes > 1:
        missing = [key for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not env.get(key)]
        if missing:
            raise ConfigError(
                f"trainer.num_nodes = {num_nodes} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "not set, so the nodes cannot meet (each would wait for strategy.timeout_s); on every node set "
                "MASTER_ADDR to node 0's address, MASTER_PORT to a free port there and NODE_RANK to the node's "
                f"index 0..{num_nodes - 1}, or launch with torchrun (--nnodes={num_nodes}) or SLURM")
        node = _int(env, "NODE_RANK")
        if node is None or not 0 <= node < num_nodes:
            raise ConfigError(f"NODE_RANK = {env.get('NODE_RANK')!r} is not a node index of trainer.num_nodes = "
                              f"{num_nodes}; set NODE_RANK to 0..{num_nodes - 1}, a different one on each node")
        return Launch("self", node, None, env["MASTER_ADDR"], env["MASTER_PORT"])
    return Launch("self", 0, None, env.get("MASTER_ADDR") or "127.0.0.1", env.get("MASTER_PORT") or None)


def rank_env(env: Mapping[str, str], launch: Launch, devices: int, world_size: int) -> dict[str, str]:
    """The variables Lightning reads to join a job of processes it did not start, for a rank that a SLURM task
    is (the values Lightning's ``SLURMEnvironment`` derives: the first node's name, 15000 + the job id's last
    4 digits): set them and Lightning takes the same values under any job name (``salloc``'s ``interactive``)."""
    return {"MASTER_ADDR": launch.master_addr, "MASTER_PORT": str(launch.master_port),
            "WORLD_SIZE": str(world_size), "NODE_RANK": str(launch.node_rank), "RANK": str(launch.rank),
            "LOCAL_RANK": str(_int(env, "SLURM_LOCALID") or 0)}


def worker_env(env: Mapping[str, str], launch: Launch, world_size: int, devices: int, local_rank: int,
               master_port: str) -> dict[str, str]:
    """The environment of one worker that train.py starts: Lightning's variables for a process it
    did not launch itself (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``RANK``, ``MASTER_*``),
    without SLURM's per-task ones (Lightning would otherwise detect a SLURM task of its own)."""
    out = {key: value for key, value in env.items() if key not in SLURM_TASK_VARS}
    out.update({
        "MASTER_ADDR": launch.master_addr, "MASTER_PORT": master_port, "WORLD_SIZE": str(world_size),
        "NODE_RANK": str(launch.node_rank), "LOCAL_RANK": str(local_rank),
        "RANK": str(launch.node_rank * devices + local_rank),
    })
    return out
