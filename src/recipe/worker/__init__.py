"""Running inside a worker: ``python -m pipeline_recipes.recipe.worker <job.yaml>`` builds the model, data,
strategy, loggers and callbacks from the job's spec and trains (:func:`~pipeline_recipes.recipe.worker.job.run_job`)."""
