"""Glue between Hydra configs and the training run: layout checks, printing, summaries.

Importing it registers the config's resolvers (:mod:`.resolvers`), which ``conf/`` uses."""

from .resolvers import register as _register_resolvers

_register_resolvers()
