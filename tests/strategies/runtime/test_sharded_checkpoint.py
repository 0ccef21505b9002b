"""Checkpoints of a sharded optimizer (``strategy.shard_optimizer``) through ``train.py`` on CPU.

Chimera D = 2 on two ranks keeps two copies of every stage (its down and up pipelines), so each rank steps half of
the optimizer state and saves that half (its chunks of the DCP state). Uninterrupted 6-step runs, sharded and not, save at
steps 3 and 6; three runs resume from step 3: sharded under the same layout (exact), DAPPLE W = 2 D = 1 unsharded
from the sharded checkpoint, DAPPLE W = 2 D = 1 sharded from the unsharded one (other layouts: the same sums in
another order). The expected values are the uninterrupted unsharded run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline_recipes.strategies import checkpoint as ckpt
from pipeline_recipes.strategies import dcp_state

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
COMMON = ("data.global_batch_size=8", "logger=none", "trainer.devices=2", "preflight=false", "trainer.max_steps=6",
          "scheduler.warmup_steps=2", "checkpoint.keep=all")
CHIMERA = ("strategy=chimera", "strategy.D=2", "checkpoint.every_n_steps=3")
OTHER = ("strategy=dapple", "strategy.D=1", "checkpoint.every_n_steps=6")  # W = 2 replicas of one stage
SHARD = "strategy.shard_optimizer=true"
OTHER_LAYOUT_LOSS = 1e-5  # another layout sums the same terms in another order (as unsharded resumes do)
OTHER_LAYOUT_STATE = 5e-7


def _start(out: Path, *overrides: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={out}", *COMMON, *overrides],
                            cwd=out, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(*procs: subprocess.Popen) -> None:
    for proc in procs:
        output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, output[-4000:]


def _result(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:06d}.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded_ckpt")
    # the whole run saves in the foreground, the sharded one in the background (the default): both kinds resume
    _wait(_start(root / "whole", *CHIMERA, "checkpoint.async_save=false"), _start(root / "sharded", *CHIMERA, SHARD))
    resumes = {
        "same": (*CHIMERA, SHARD, f"ckpt_path={_step(root / 'sharded', 3)}"),
        "to_whole": (*OTHER, f"ckpt_path={_step(root / 'sharded', 3)}"),
        "to_sharded": (*OTHER, SHARD, f"ckpt_path={_step(root / 'whole', 3)}"),
    }
    _wait(*[_start(root / name, *args) for name, args in resumes.items()])
    return {"root": root, "whole": root / "whole", "sharded": root / "sharded", **{n: root / n for n in resumes}}


@pytest.mark.slow
def test_a_sharded_run_trains_as_the_unsharded_one_with_a_fraction_of_the_state(runs: dict[str, Path]) -> None:
    whole, sharded = _result(runs["whole"]), _result(runs["sharded"])
    assert sharded["loss_history"] == pytest.approx(whole["loss_history"], abs=1e-6)
    assert sharded["strategy"] == "chimera+shard_optim" and whole["strategy"] == "chimera"
    assert sharded["parameter_bytes"] == whole["parameter_bytes"]
    trained = {n: ckpt.consolidate(_step(runs[n], 6))["state_dict"] for n in ("whole", "sharded")}
    worst = max((trained["sharded"][k] - v).abs().max().item() for k, v in trained["whole"].items()
                if v.is_floating_point())
    assert worst <= 1e-6, f"the sharded run's parameters differ by {worst:.2e}"  # the global norm, summed by shard
    for part, full in zip(sharded["optimizer_state_bytes"], whole["optimizer_state_bytes"]):
        assert 0.45 <= part / full <= 0.55, (sharded["optimizer_state_bytes"], whole["optimizer_state_bytes"])


@pytest.mark.slow
def test_each_rank_saves_its_part_of_the_optimizer_state(runs: dict[str, Path]) -> None:
    step3 = _step(runs["sharded"], 3)
    assert sorted(p.name for p in step3.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # DCP's index: each rank wrote the chunks of the moments it steps, half of them, a parameter split between both
    metadata = dcp_state.read_metadata(step3)
    files: dict[str, set[str]] = {}
    written = {"__0_0.distcp": 0, "__1_0.distcp": 0}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optimizer.0.state.") and not index.fqn.endswith(".step"):
            files.setdefault(index.fqn, set()).add(info.relative_path)
            written[info.relative_path] += info.length
    assert any(len(f) == 2 for f in files.values()), files
    assert 0.4 <= written["__0_0.distcp"] / sum(written.values()) <= 0.6, written
    ckpt.verify_checkpoint(step3)
    # consolidated, the two halves are the unsharded run's state: the same model, the same Adam moments by name
    sharded, whole = ckpt.consolidate(step3), ckpt.consolidate(_step(runs["whole"], 3))
    assert sharded["pipeline"]["param_names"] == whole["pipeline"]["param_names"]
    for key, value in whole["state_dict"].items():
        torch.testing.assert_close(sharded["state_dict"][key], value, rtol=0, atol=1e-6, msg=key)
    for i, entry in whole["optimizer_states"][0]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sharded["optimizer_states"][0]["state"][i][name], entry[name], rtol=0,
                                       atol=1e-7)


@pytest.mark.slow
def test_resuming_a_sharded_checkpoint_under_the_same_layout_is_exact(runs: dict[str, Path]) -> None:
    assert _result(runs["same"])["loss_history"] == _result(runs["sharded"])["loss_history"]
    same, sharded = ckpt.consolidate(_step(runs["same"], 6)), ckpt.consolidate(_step(runs["sharded"], 6))
    for key, value in sharded["state_dict"].items():
        assert torch.equal(same["state_dict"][key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["to_whole", "to_sharded"])
def test_sharded_and_unsharded_checkpoints_resume_each_other_under_another_layout(runs: dict[str, Path],
                                                                                  resumed: str) -> None:
    """Sharded → unsharded DAPPLE W = 2, and unsharded → sharded DAPPLE W = 2 (its state split between two
    replicas instead of two pipelines): the losses and step-6 state of the uninterrupted run that saved the
    checkpoint."""
    source = runs["sharded" if resumed == "to_whole" else "whole"]
    full, losses = _result(source)["loss_history"], _result(runs[resumed])["loss_history"]
    assert losses[:3] == full[:3]  # the history before the checkpoint comes with it
    assert max(abs(a - b) for a, b in zip(full[3:], losses[3:])) <= OTHER_LAYOUT_LOSS, (full, losses)
    state, reference = ckpt.consolidate(_step(runs[resumed], 6)), ckpt.consolidate(_step(source, 6))
    worst = max((state["state_dict"][k] - v).abs().max().item() for k, v in reference["state_dict"].items()
                if v.is_floating_point())
    assert worst <= OTHER_LAYOUT_STATE, f"{resumed}: parameters differ by {worst:.2e}"


@pytest.mark.slow
def test_a_sharded_checkpoint_exports_to_transformers(runs: dict[str, Path], tmp_path: Path) -> None:
    import importlib.util

    from transformers import GPT2LMHeadModel

    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    export.export(_step(runs["sharded"], 3), tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    saved = ckpt.model_state(_step(runs["sharded"], 3))
    assert torch.equal(loaded.transformer.wte.weight, saved["layers.0.wte.weight"])
