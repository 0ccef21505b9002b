"""Baselines to compare the pipeline schedules against: plain DDP and one process.

They train the very same :class:`~pipeline_recipes.strategies.lightning.strategy.PipelineModule` (which runs its layers in
order when no pipeline strategy is active) on the replica's whole mini-batch at once, and accept
the pipeline settings of ``conf/strategy/*.yaml`` so that one sweep can mix every strategy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import override

from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S
from pipeline_recipes.strategies.runtime.process_group import end_process_group


class DDPBaseline(DDPStrategy):
    """Lightning's DDP (W = world size replicas, no stages) with a clean exit."""

    def __init__(self, timeout_s: float = COLLECTIVE_TIMEOUT_S, **pipeline_settings: Any) -> None:
        super().__init__(timeout=timedelta(seconds=timeout_s))

    @override
    def teardown(self) -> None:
        super().teardown()
        end_process_group()


def single_device(accelerator: str = "cpu", **pipeline_settings: Any) -> SingleDeviceStrategy:
    """One process on the trainer's accelerator (``cpu``, or ``gpu``/``cuda``: the first GPU)."""
    return SingleDeviceStrategy(device="cpu" if accelerator == "cpu" else "cuda:0")
