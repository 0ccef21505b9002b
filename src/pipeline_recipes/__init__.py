"""The pipeline recipes under one import name: ``pipeline_recipes.strategies``, ``.models``, ``.planner``,
``.recipe`` and ``.datamodules``.

On disk the folders stay where they are (``src/strategies/`` …); ``pyproject.toml`` maps each one under
this package with setuptools' ``package-dir``, so nothing is installed under a generic top-level name.
Run from a checkout without installing (``PYTHONPATH=src``), this package also looks for its
subpackages in ``src/`` itself, the same files the installed mapping names.

Checkpoints written before the rename name ``strategies.…``/``models.…`` in their model config:
:mod:`pipeline_recipes.strategies.legacy` reads them.
"""

from __future__ import annotations

from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent
if _SRC.name == "src" and (_SRC / "strategies" / "__init__.py").is_file() and str(_SRC) not in __path__:
    __path__.append(str(_SRC))  # a checkout: src/strategies is pipeline_recipes.strategies
