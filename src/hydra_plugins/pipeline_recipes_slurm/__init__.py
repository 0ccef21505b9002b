"""The recipe's Hydra plugins: Hydra instantiates launchers only from the ``hydra_plugins`` namespace package
(:mod:`hydra_plugins.pipeline_recipes_slurm.launcher`, the ``hydra/launcher=slurm`` preset's launcher)."""
