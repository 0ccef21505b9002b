"""Helpers that live in a test module of another folder, imported as pytest imports that module.

pytest imports a test module by its name with its folder first on ``sys.path`` (``--import-mode=prepend``);
:func:`import_test_module` does the same for a module of another folder, so both imports give one module object.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def import_test_module(name: str) -> ModuleType:
    """The test module ``name`` (e.g. ``"test_models"``) wherever it sits under ``tests/``."""
    path = next(TESTS.rglob(f"{name}.py"))
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(name)

