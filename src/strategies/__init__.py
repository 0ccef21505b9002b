"""Synchronous pipeline-parallel training: schedules, runtime and Lightning strategies."""
