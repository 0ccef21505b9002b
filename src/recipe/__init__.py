"""The recipe by job: checking a command (:mod:`.check`), launching and supervising (:mod:`.launch`), running inside
a worker (:mod:`.worker`), reporting (:mod:`.report`).

Importing it registers the config's resolvers (:mod:`.check.resolvers`), which ``conf/`` uses."""

from pipeline_recipes.recipe.check.resolvers import register as _register_resolvers

_register_resolvers()
