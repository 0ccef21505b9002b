"""The README's commands and ``scripts/train.sbatch`` leave nothing untracked in the checkout: every path they write
(a job or sweep directory, a JSON file, SLURM's output file) is one ``.gitignore`` covers, as git itself reads it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and the checkout's .git")


def written_paths() -> list[str]:
    """What the README's commands write, relative to the checkout (a file in a directory for a directory), and what
    ``scripts/train.sbatch`` writes by default, its job name ``pipeline`` and job id 123."""
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S))
    paths = [f"{d}/results.json" for d in re.findall(r"hydra\.(?:run|sweep)\.dir=(\S+)", commands)]
    paths += re.findall(r"--(?:json|png) (\S+)", commands)
    sbatch = (ROOT / "scripts" / "train.sbatch").read_text()
    [output] = re.findall(r"^#SBATCH --output=(\S+)", sbatch, flags=re.M)
    [run_dir] = re.findall(r'RUN_DIR="\$\{RUN_DIR:-(\S+?)\}"', sbatch)
    paths.append(output.replace("%x", "pipeline").replace("%j", "123"))
    paths.append(run_dir.replace("${SLURM_JOB_NAME}", "pipeline").replace("${SLURM_JOB_ID}", "123") + "/job.yaml")
    return [p for p in paths if not p.startswith("/")]


def test_every_path_the_readme_and_sbatch_write_is_ignored() -> None:
    paths = written_paths()
    assert len(paths) >= 5  # runs/g1, sweeps/s1, plan.json, the SLURM log, the SLURM job directory
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths),
                             capture_output=True, text=True, check=False).stdout.split()
    assert sorted(set(paths) - set(ignored)) == []
