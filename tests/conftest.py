"""Tests never contact the Hugging Face hub: the library only goes offline when told to, so the tests
say so here (before ``datasets``/``transformers`` are imported) and in the environments of the
processes they start."""

import os
from collections.abc import Iterator

import pytest

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


@pytest.fixture(autouse=True)
def _rank_zero_stays_rank_zero() -> Iterator[None]:
    """Lightning's ``rank_zero_only.rank`` is process-wide: a test that sets up a strategy as rank 1 in this
    process would silence every later ``@rank_zero_only`` call here (a logger's rows, for one). Each test
    leaves it as it found it."""
    from lightning_utilities.core.rank_zero import rank_zero_only  # local: only its attribute, after the env vars

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with the most multi-process and end-to-end (``slow``) tests first, each module's tests in their
    own order: pytest-xdist hands whole files to its workers in this order, so the long ones start early and
    no worker is left with one at the end."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.module.__name__] = slow.get(item.module.__name__, 0) + bool(item.get_closest_marker("slow"))
    first = {name: i for i, name in enumerate(dict.fromkeys(item.module.__name__ for item in items))}
    items.sort(key=lambda item: (-slow[item.module.__name__], first[item.module.__name__]))
