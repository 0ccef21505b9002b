"""Checking a command before any process starts: :func:`~pipeline_recipes.recipe.check.command.check_command` is the
one entry point (its order is its docstring); the settings' schema and layout, the accelerator, the logger, the
resume checkpoint, ``strategy=auto``. Imports neither Lightning nor the data modules."""
