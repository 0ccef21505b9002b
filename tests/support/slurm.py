"""Private SLURM clusters for tests (``scripts/slurm_cluster.py``), each started once per test session and stopped
at its end, failed tests or not. ``tests/conftest.py`` registers this module as a plugin, so a test just asks for a
fixture:

    @pytest.mark.slow
    @pytest.mark.slurm
    def test_two_tasks(slurm_two_nodes: Cluster) -> None:
        out = slurm_two_nodes.run("srun", "--nodes=2", "hostname").stdout
        assert len(out.split()) == 2

``slurm_one_node`` and ``slurm_two_nodes`` use ``proctrack/linuxproc``; ``slurm_clusters.get(nodes=..., proctrack=...)``
gives any other kind (``pgid``), one of each per session. A cluster lives in its own directory with free ports and its
own munged, so two pytest-xdist workers each start their own without meeting (no shared port, file or ``/etc/hosts``
line). Without root or the Debian packages (``slurm-wlm``, ``munge``) the tests skip, naming what is missing; if
``.ci/run`` could not install them, its log (``SLURM_INSTALL_LOG``) is named too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from slurm_cluster import KILL_WAIT_S, Cluster, SlurmClusterError, missing_programs, start, stop_orphans

__all__ = ["Cluster", "ClusterFactory", "SlurmClusterError", "skip_reason"]


def skip_reason(accounting: bool = False) -> str | None:
    """Why a private cluster cannot start here (None if it can)."""
    if not sys.platform.startswith("linux"):
        return f"SLURM tests need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "SLURM tests need root (slurmd starts job steps as their user)"
    missing = missing_programs(accounting)
    if missing:
        reason = f"SLURM not installed: {', '.join(missing)} missing (apt-get install slurm-wlm munge)"
        install_log = os.environ.get("SLURM_INSTALL_LOG")
        if install_log and Path(install_log).exists():
            lines = Path(install_log).read_text(errors="replace").strip().splitlines()
            reason += f"; .ci/run's install failed, see {install_log}: {lines[-1] if lines else '(empty)'}"
        return reason
    return None


class ClusterFactory:
    """Starts clusters on demand, one per kind (nodes, proctrack, accounting, kill_wait), and stops them all at
    ``close``. The first start also stops the clusters of earlier sessions that were killed before their end."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._clusters: dict[tuple[int, str, bool, int, int | None], Cluster] = {}
        self._swept = False

    def get(self, nodes: int = 1, proctrack: str = "linuxproc", accounting: bool = False,
            kill_wait: int = KILL_WAIT_S, cpus_per_node: int | None = None) -> Cluster:
        """The session's cluster of this kind, started on first use; skips the test where none can start.
        ``kill_wait``: Slurm's KillWait (SLURM's default 30 s: a step plus a checkpoint fit in it, as
        ``docs/slurm.md`` asks; less kills a stopping job's ranks before they save).
        ``accounting=True`` adds ``sacct`` (slurmdbd on a private MariaDB, about 2 s more to start);
        ``cpus_per_node`` more CPUs than the host has lets several jobs run at once (default: the host's)."""
        reason = skip_reason(accounting)
        if reason:
            pytest.skip(reason)
        if not self._swept:
            stop_orphans()
            self._swept = True
        key = (nodes, proctrack, accounting, kill_wait, cpus_per_node)
        if key not in self._clusters:
            workdir = self._tmp.mktemp(f"slurm{nodes}{proctrack[0]}{'a' if accounting else ''}")
            self._clusters[key] = start(workdir, nodes=nodes, proctrack=proctrack, accounting=accounting,
                                        kill_wait=kill_wait, cpus_per_node=cpus_per_node, owned=True)
        return self._clusters[key]

    def close(self) -> None:
        """Stop every cluster; raise if one left a daemon or a process that had to be killed."""
        problems = []
        for cluster in self._clusters.values():
            try:
                killed = cluster.stop()
            except SlurmClusterError as error:
                problems.append(str(error))
                continue
            if killed:
                problems.append(f"{cluster.workdir}: killed after its daemons stopped: {killed}")
        self._clusters.clear()
        if problems:
            raise SlurmClusterError("; ".join(problems))


@pytest.fixture(scope="session")
def slurm_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFactory]:
    """Every private cluster of the session (of this xdist worker), stopped at its end."""
    factory = ClusterFactory(tmp_path_factory)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="session")
def slurm_one_node(slurm_clusters: ClusterFactory) -> Cluster:
    """One node ``n1`` with every CPU of this machine, ``proctrack/linuxproc``, partition ``cpu``."""
    return slurm_clusters.get(nodes=1)


@pytest.fixture(scope="session")
def slurm_two_nodes(slurm_clusters: ClusterFactory) -> Cluster:
    """Nodes ``n1`` and ``n2`` on this host, each advertising every CPU of it, ``proctrack/linuxproc``."""
    return slurm_clusters.get(nodes=2)
