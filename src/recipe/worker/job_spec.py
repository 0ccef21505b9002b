"""The job file (``job.yaml`` in the job's output directory): the resolved Hydra config, the derived layout and the
W&B group, written by the launcher and read by every worker, so a worker needs no Hydra context.

Apart from :mod:`pipeline_recipes.recipe.worker.job` so that the launcher, which writes it, never imports Lightning or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pipeline_recipes.core.layout import Layout

JOB_FILE = "job.yaml"


@dataclass(frozen=True)
class JobSpec:
    """Everything a worker needs: the resolved config, the derived layout, where to write."""

    config: dict[str, Any]
    layout: Layout
    out_dir: str
    group: str

    def save(self) -> Path:
        path = Path(self.out_dir) / JOB_FILE
        OmegaConf.save(OmegaConf.create({"config": self.config, "layout": self.layout.as_dict(),
                                         "out_dir": self.out_dir, "group": self.group}), path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        return cls(raw["config"], Layout.from_dict(raw["layout"]), raw["out_dir"], raw["group"])
