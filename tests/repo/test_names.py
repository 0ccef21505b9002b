"""Names by job: no two modules share a name, and the tests sit in folders that mirror the packages.

A module's name says its job, so one name means one module across ``src/`` and ``scripts/``. A test file sits in
the folder of the package it tests (``tests/strategies/runtime/`` for ``src/strategies/runtime/``); whole-job
runs of ``train.py`` and the scripts sit in ``tests/e2e/``, checks of the repository itself in ``tests/repo/``,
and what the tests share in ``tests/support/``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from test_import_graph import ROOT, package_dirs

NOT_PACKAGES = {"e2e", "repo", "support", "golden"}


def test_no_two_modules_share_a_name() -> None:
    files = [p for folder in ("src", "scripts") for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py"]
    names = Counter(p.name for p in files)
    shared = {name: sorted(str(p.relative_to(ROOT)) for p in files if p.name == name)
              for name, count in names.items() if count > 1}
    assert not shared, f"modules that share a name (rename one by its job): {shared}"


def test_test_folders_mirror_the_packages() -> None:
    roots = {folder.resolve() for folder in package_dirs().values()}
    tests = ROOT / "tests"
    folders = {p.parent for p in tests.rglob("test_*.py")}
    assert tests not in folders, "every test file sits in the folder of the package it tests, not in tests/ itself"
    for folder in folders:
        rel = folder.relative_to(tests)
        if rel.parts[0] in NOT_PACKAGES:
            continue
        source = (ROOT / "src" / rel).resolve()
        is_package = (source / "__init__.py").exists() and any(source == r or r in source.parents for r in roots)
        assert is_package, f"tests/{rel.as_posix()} mirrors no package (src/{rel.as_posix()} is not one)"
