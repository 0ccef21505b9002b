"""Launching and supervising a job: :func:`~pipeline_recipes.recipe.launch.main.run` (the body of ``train.py``) checks
the command, holds the job directory, starts one worker per local rank (or runs in-process under torchrun or
SLURM), watches them and concludes the job from its end record. Never imports Lightning."""
