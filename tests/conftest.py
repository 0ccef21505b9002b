"""Tests never contact the Hugging Face hub: the library only goes offline when told to, so the tests
say so here (before ``datasets``/``transformers`` are imported) and in the environments of the
processes they start.

Nor do they run as part of an enclosing SLURM job: run inside an allocation (``salloc -N1 -n2 python -m pytest``,
an ``sbatch`` script, ``srun``), this process carries the job's ``SLURM_*`` variables, and Lightning's
``SLURMEnvironment`` (which reads ``SLURM_NTASKS``) or the launcher would take the tests, and every ``train.py`` they
start, for tasks of that job. They are dropped here, before any test module computes an environment from
``os.environ``; a test that wants a SLURM job sets its own variables, and the SLURM tests give their commands a
private cluster's environment (``tests/support/slurm.py``)."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["slurm"]  # tests/support/slurm.py: private SLURM cluster fixtures (slurm_one_node, slurm_two_nodes, ...)

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

NOT_SLURMS = ("SLURM_INSTALL_LOG",)  # .ci/run's, read by tests/support/slurm.py: not a job's
for _var in [key for key in os.environ if key.startswith("SLURM_") and key not in NOT_SLURMS]:
    del os.environ[_var]


@pytest.fixture(autouse=True)
def _rank_zero_stays_rank_zero() -> Iterator[None]:
    """Lightning's ``rank_zero_only.rank`` is process-wide: a test that sets up a strategy as rank 1 in this
    process would silence every later ``@rank_zero_only`` call here (a logger's rows, for one). Each test
    leaves it as it found it."""
    from lightning_utilities.core.rank_zero import rank_zero_only  # local: only its attribute, after the env vars

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank


DURATIONS = Path(__file__).with_name("durations.json")  # scripts/test_durations.py writes it
SLOW_TEST_S = 20.0  # a file missing from it: this per multi-process or end-to-end test, else nothing


def _file_of(item: pytest.Item) -> str:
    return Path(item.nodeid.split("::")[0]).as_posix()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, each file's tests in their own order: pytest-xdist hands whole files to
    its workers in this order, so the long ones start early and no worker is left with one at the end
    (longest processing time first). A file's seconds come from ``durations.json``; a file not in it is
    estimated from its ``slow`` tests."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    estimate: dict[str, float] = {}
    for item in items:
        name = _file_of(item)
        if name in recorded:
            estimate[name] = recorded[name]
        else:
            estimate[name] = estimate.get(name, 0.0) + SLOW_TEST_S * bool(item.get_closest_marker("slow"))
    first = {name: i for i, name in enumerate(dict.fromkeys(map(_file_of, items)))}
    items.sort(key=lambda item: (-estimate[_file_of(item)], first[_file_of(item)]))
