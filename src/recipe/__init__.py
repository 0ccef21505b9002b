"""Glue between Hydra configs and the training run: layout checks, printing, summaries."""
