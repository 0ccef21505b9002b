"""The error of data that cannot be had (no such file, offline with an empty cache, no answer from the hub).

:class:`DataError` is defined beside :class:`~pipeline_recipes.recipe.layout.ConfigError` (torch-free, so the launcher's
error handler needs no data import) and re-exported here for the data modules."""

from __future__ import annotations

from ..recipe.layout import ConfigError, DataError

__all__ = ["ConfigError", "DataError"]
