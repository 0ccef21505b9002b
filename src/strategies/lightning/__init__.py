"""The Lightning adapter: :class:`~.strategy.PipelineStrategy` maps Lightning's hooks onto the runtime
(:mod:`pipeline_recipes.strategies.runtime`); :class:`~.strategy.PipelineModule` wraps a pipeline model; stop
signals (:mod:`.stop`), mixed precision (:mod:`.precision`), optimizers and schedules (:mod:`.optim`) and the
baselines (:mod:`.baselines`). ``from pipeline_recipes.strategies.lightning import PipelineModule, PipelineStrategy``.
"""

from .strategy import PipelineModule, PipelineStrategy

__all__ = ["PipelineModule", "PipelineStrategy"]
