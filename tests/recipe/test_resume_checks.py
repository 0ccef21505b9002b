"""``ckpt_path`` checked and ``ckpt_path=auto`` resolved by the launcher, before any process starts.

Checkpoints are written here, in-process, with the project's own writer (``strategies.checkpoint.save_sharded`` of
a tiny GPT-2's stages) or as a baseline's Lightning file, from a model config taken from ``conf/model``: the
expected overrides come from the config a checkpoint was written with. Damaged checkpoints (a stage file cut short
or with one byte flipped, a file missing, a size that is not the manifest's) are made by hand, located with
``zipfile`` and ``os.stat`` rather than with the code under test. One ``train.py`` run is refused (it must stop
before any worker starts) and one slow test runs two short jobs: a fresh start and its resume under ``auto``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from pipeline_recipes.recipe.check.settings import ConfigError
from pipeline_recipes.recipe.check.resume import CHECKPOINT_DIR, Resume, resolve_resume
from pipeline_recipes.strategies import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SAVED = {"n_layer": 2, "n_embd": 64}  # the model the checkpoints hold (gpt2-tiny's other keys)


def _model_config(**overrides: Any) -> dict[str, Any]:
    return {**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "gpt2-tiny.yaml")), **overrides}


def _root(config: dict[str, Any]) -> nn.Module:
    """The model under the name PipelineModule gives it (state-dict keys ``model.…``)."""
    return nn.ModuleDict({"model": instantiate(config, device="meta")})


def _sharded(path: Path, config: dict[str, Any], step: int, config_in_meta: bool = True) -> Path:
    """A sharded checkpoint of two stages, written as two ranks would (``save_sharded``); ``config_in_meta=False``:
    as before ``meta.json`` held the model config (only ``trainer.pt`` has it)."""
    root = _root(config)
    layers = root["model"].pipeline_layers()
    index = ckpt.ModelIndex.of(root, layers)
    half = len(layers) // 2
    partition = [range(0, half), range(half, len(layers))]
    state = {k: torch.zeros(v.shape) for k, v in root.state_dict().items()}
    payloads = {s: ckpt.stage_payload(r, root, state, [], index, with_common=s == 0) for s, r in enumerate(partition)}
    meta = {"format": ckpt.SHARDED_FORMAT, "version": 1, "schedule": "gpipe", "D": 2, "W": 1,
            "partition": [[r.start, r.stop] for r in partition], "num_layers": len(layers), "global_step": step,
            "has_optimizer_states": False, "index": index.as_dict(),
            **({ckpt.MODEL_CONFIG_KEY: config} if config_in_meta else {})}
    return ckpt.save_sharded(path, rank=0, write_parts=ckpt.stage_files(payloads), meta=meta,
                             trainer_state={"global_step": step, ckpt.MODEL_CONFIG_KEY: config},
                             write_trainer_state=lambda s, p: torch.save(dict(s), p), any_failed=lambda failed: failed)


def _file(path: Path, config: dict[str, Any], step: int) -> Path:
    """A baseline's (ddp, single) checkpoint: one Lightning file with the model config."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: torch.zeros(v.shape) for k, v in _root(config).state_dict().items()}
    torch.save({"state_dict": state, "global_step": step, ckpt.MODEL_CONFIG_KEY: config}, path)
    return path


def _resume(value: str | Path, job_dir: Path, strategy: str = "gpipe", **model: Any) -> Resume:
    cfg = OmegaConf.create({"ckpt_path": str(value), "model": _model_config(**{**SAVED, **model})})
    return resolve_resume(cfg, job_dir, strategy)


def _refusal(value: str | Path, job_dir: Path, strategy: str = "gpipe", **model: Any) -> str:
    with pytest.raises(ConfigError) as err:
        _resume(value, job_dir, strategy, **model)
    return str(err.value)


def _cut_in_half(file: Path) -> tuple[int, int]:
    """Cut ``file`` to half its size, as a copy or a write that stopped half-way; returns both sizes."""
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])
    return len(data), len(data) // 2


def _flip_inside_a_record(file: Path) -> str:
    """Flip one byte in the middle of the data of the largest record of the zip archive ``file`` (a tensor's bytes:
    the archive stays readable, the record's CRC-32 no longer matches); returns the record's name."""
    with zipfile.ZipFile(file) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    data = bytearray(file.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF  # local header: 30 bytes
    file.write_bytes(data)
    return info.filename


# -- a checkpoint given ------------------------------------------------------------------------------------------


def test_a_missing_checkpoint_names_the_newest_complete_one_next_to_it(tmp_path: Path) -> None:
    _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    message = _refusal(tmp_path / "step-000008.ckpt", tmp_path)
    assert f"{tmp_path / 'step-000008.ckpt'} does not exist" in message
    assert f"the newest complete checkpoint in {tmp_path} is step-000004.ckpt" in message
    assert "does not exist" in _refusal(tmp_path / "nowhere" / "x.ckpt", tmp_path)


def test_a_partial_or_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    complete = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    partial = _sharded(tmp_path / "copy", _model_config(**SAVED), 8).rename(tmp_path / "step-000008.ckpt.partial")
    assert (partial / ckpt.META_FILE).is_file()  # written to the end but never renamed: still not complete
    message = _refusal(partial, tmp_path)
    assert "is a save that did not finish" in message and "the newest complete checkpoint" in message
    (complete / ckpt.stage_file(1)).unlink()
    assert "lacks stage1.pt" in _refusal(complete, tmp_path)
    (complete / ckpt.META_FILE).unlink()
    assert "has no meta.json" in _refusal(complete, tmp_path)
    whole = _file(tmp_path / "full.ckpt", _model_config(**SAVED), 4)
    whole.write_bytes(whole.read_bytes()[:-100])  # a copy cut short
    assert "not a complete torch file" in _refusal(whole, tmp_path, "single")


def test_the_writer_lists_every_file_with_its_size(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    on_disk = {Path(root, name).relative_to(path).as_posix(): os.stat(Path(root, name)).st_size
               for root, _, names in os.walk(path) for name in names}
    del on_disk["meta.json"]
    assert set(on_disk) == {"trainer.pt", "stage0.pt", "stage1.pt", "rng/rank0.pt"}
    assert json.loads((path / "meta.json").read_text())["manifest"] == on_disk
    assert ckpt.verify_checkpoint(path) is None


@pytest.mark.parametrize("damage", ["cut", "flipped", "missing", "size"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    if damage == "cut":
        full, half = _cut_in_half(path / "stage1.pt")
        reason = f": stage1.pt has {half} bytes, its meta.json lists {full} (cut short)"
    elif damage == "flipped":
        record = _flip_inside_a_record(path / "stage1.pt")
        reason = f": stage1.pt is damaged: its record {record} fails its CRC-32 check"
    elif damage == "missing":
        (path / "rng" / "rank0.pt").unlink()
        reason = " is incomplete: it lacks rng/rank0.pt"
    else:  # a file that is not the one written: a different size than meta.json's manifest lists
        size = (path / "trainer.pt").stat().st_size
        with open(path / "trainer.pt", "ab") as file:
            file.write(b"\0" * 10)
        reason = f": trainer.pt has {size + 10} bytes, its meta.json lists {size}"
    message = _refusal(path, tmp_path)
    assert message == f"ckpt_path={path}{reason}", message  # the path once; no other complete checkpoint nearby
    with pytest.raises(ckpt.CheckpointError, match=f"^{re.escape(f'{path}{reason}')}$"):
        ckpt.verify_checkpoint(path)


def test_a_checkpoint_written_before_the_manifest_is_verified_by_its_files(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    meta = json.loads((path / "meta.json").read_text())
    del meta["manifest"]
    (path / "meta.json").write_text(json.dumps(meta))
    assert _resume(path, tmp_path).path == str(path)
    record = _flip_inside_a_record(path / "rng" / "rank0.pt")  # not a file every checkpoint has: found on disk
    message = _refusal(path, tmp_path)
    assert message == f"ckpt_path={path}: rng/rank0.pt is damaged: its record {record} fails its CRC-32 check"
    (path / "stage1.pt").unlink()
    assert _refusal(path, tmp_path) == f"ckpt_path={path} is incomplete: it lacks stage1.pt"


def test_a_damaged_single_file_checkpoint_is_refused(tmp_path: Path) -> None:
    whole = _file(tmp_path / "full.ckpt", _model_config(**SAVED), 4)
    record = _flip_inside_a_record(whole)
    message = _refusal(whole, tmp_path, "single")
    assert message == f"ckpt_path={whole} is damaged: its record {record} fails its CRC-32 check"


def test_a_sharded_checkpoint_under_ddp_or_single_must_be_consolidated(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    for strategy in ("ddp", "single"):
        message = _refusal(path, tmp_path, strategy)
        assert f"consolidate it first: python scripts/consolidate_ckpt.py {path} full.ckpt" in message
    assert _resume(path, tmp_path, "dapple").path == str(path)
    whole = _file(tmp_path / "full.ckpt", _model_config(**SAVED), 4)
    assert _resume(whole, tmp_path, "single").path == _resume(whole, tmp_path, "gpipe").path == str(whole)


def _overrides(message: str) -> list[str]:
    found = re.search(r"to resume it, set (.+?) \(this run has", message)
    assert found, message
    return found[1].split(" ")


def _applied(overrides: list[str], model: dict[str, Any]) -> dict[str, Any]:
    """``model`` with Hydra's reading of ``model.key=value`` overrides."""
    out = dict(model)
    for o in OverridesParser.create().parse_overrides(overrides):
        out[o.key_or_group.removeprefix("model.")] = o.value()
    return out


@pytest.mark.parametrize("kind", ["sharded", "sharded, config in trainer.pt only", "file"])
def test_another_model_is_refused_with_the_overrides_that_match_it(tmp_path: Path, kind: str) -> None:
    saved = _model_config(**SAVED, compile=False, loss_chunk_tokens=64)  # two keys that change no parameter
    path = (_file(tmp_path / "full.ckpt", saved, 4) if kind == "file"
            else _sharded(tmp_path / "step-000004.ckpt", saved, 4, config_in_meta=kind == "sharded"))
    strategy = "single" if kind == "file" else "gpipe"
    run = {"n_layer": 4, "n_embd": 32}
    message = _refusal(path, tmp_path, strategy, **run)
    assert message.startswith(f"ckpt_path={path} holds another model than this run's: ")
    expected = [f"model.{key}={saved[key]}" for key in ("n_layer", "n_embd")]  # this run's config order
    assert _overrides(message) == expected
    assert f"(this run has n_layer={run['n_layer']}, n_embd={run['n_embd']})" in message
    fixed = _applied(expected, _model_config(**run))
    cfg = OmegaConf.create({"ckpt_path": str(path), "model": fixed})
    assert resolve_resume(cfg, tmp_path, strategy).path == str(path)


def test_settings_that_change_no_parameter_do_not_matter(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    same = {"compile": True, "loss_chunk_tokens": None, "seq_len": 16, "name": "renamed", "resid_pdrop": 0.1}
    assert _resume(path, tmp_path, **same).path == str(path)


def test_tied_embeddings_are_part_of_the_model(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)  # gpt2-tiny ties them
    message = _refusal(path, tmp_path, tie_word_embeddings=False)
    assert "lm_head.weight is only in this run's model" in message
    assert _overrides(message) == ["model.tie_word_embeddings=true"]


# -- ckpt_path=auto ----------------------------------------------------------------------------------------------


def test_auto_starts_fresh_without_a_complete_checkpoint(tmp_path: Path) -> None:
    checkpoints = tmp_path / CHECKPOINT_DIR
    assert _resume("auto", tmp_path) == Resume(None, f"ckpt_path=auto: no complete checkpoint in {checkpoints}, "
                                                     "starting fresh")
    (checkpoints / "step-000002.ckpt.partial").mkdir(parents=True)
    fresh = _resume("auto", tmp_path)
    assert fresh.path is None and fresh.note.endswith("skipped step-000002.ckpt.partial: a save that did not finish")


def test_auto_resumes_the_highest_complete_step(tmp_path: Path) -> None:
    checkpoints = tmp_path / CHECKPOINT_DIR
    config = _model_config(**SAVED)
    for step in (2, 10, 999_999):
        _sharded(checkpoints / f"step-{step:06d}.ckpt", config, step)
    newest = _sharded(checkpoints / "step-1000000.ckpt", config, 1_000_000)  # after step 999999 in number, not name
    assert _resume("auto", tmp_path) == Resume(str(newest), f"ckpt_path=auto: resuming from {newest} (step 1000000)", 1000000)


def test_auto_skips_newer_unfinished_saves(tmp_path: Path) -> None:
    checkpoints = tmp_path / CHECKPOINT_DIR
    config = _model_config(**SAVED)
    complete = _sharded(checkpoints / "step-000004.ckpt", config, 4)
    _sharded(checkpoints / "copy", config, 8).rename(checkpoints / "step-000008.ckpt.partial")
    cut = _file(checkpoints / "step-000006.ckpt", config, 6)
    cut.write_bytes(cut.read_bytes()[:1000])
    resumed = _resume("auto", tmp_path)
    assert resumed.path == str(complete)
    assert resumed.note.startswith(f"ckpt_path=auto: resuming from {complete} (step 4); skipped "
                                   "step-000008.ckpt.partial: a save that did not finish; ")
    assert "; step-000006.ckpt is not a complete torch file" in resumed.note and "\n" not in resumed.note
    assert "another model" in _refusal("auto", tmp_path, n_layer=3)  # the checkpoint found is checked as one given


def test_auto_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    checkpoints = tmp_path / CHECKPOINT_DIR
    config = _model_config(**SAVED)
    intact = _sharded(checkpoints / "step-000004.ckpt", config, 4)
    flipped = _sharded(checkpoints / "step-000006.ckpt", config, 6)
    record = _flip_inside_a_record(flipped / "stage0.pt")
    newest = _sharded(checkpoints / "step-000008.ckpt", config, 8)
    full, half = _cut_in_half(newest / "stage1.pt")
    resumed = _resume("auto", tmp_path)
    assert resumed.path == str(intact)
    assert resumed.note == (f"ckpt_path=auto: resuming from {intact} (step 4); skipped "
                            f"step-000008.ckpt: stage1.pt has {half} bytes, its meta.json lists {full} (cut short); "
                            f"step-000006.ckpt: stage0.pt is damaged: its record {record} fails its CRC-32 check")


def test_auto_takes_a_baselines_file(tmp_path: Path) -> None:
    path = _file(tmp_path / CHECKPOINT_DIR / "step-000003.ckpt", _model_config(**SAVED), 3)
    assert _resume("auto", tmp_path, "ddp").path == str(path)


# -- train.py -------------------------------------------------------------------------------------------------


def _train(job_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), "trainer=cpu", "trainer.devices=2", "logger=none",
           f"hydra.run.dir={job_dir}", *args]
    return subprocess.run(cmd, cwd=job_dir.parent, env=ENV, capture_output=True, text=True, timeout=300)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.slow
def test_train_refuses_another_model_before_any_process_starts(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "step-000004.ckpt", _model_config(**SAVED), 4)
    job = tmp_path / "job"
    cpu, start = _children_cpu_s(), time.monotonic()
    result = _train(job, "strategy=gpipe", "strategy.D=2", "model.n_layer=4", f"ckpt_path={path}")
    wall, cpu = time.monotonic() - start, _children_cpu_s() - cpu
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1
    assert f"error: ckpt_path={path} holds another model than this run's" in result.stderr
    assert f"to resume it, set model.n_layer={SAVED['n_layer']} (this run has n_layer=4)" in result.stderr
    assert not (job / "logs").exists() and not (job / "job.yaml").exists()  # no worker, no job file
    # the launcher alone: importing torch and transformers (6-7 s of CPU on a quiet 2-core machine, more under load);
    # the launcher and a worker, which spends ≥ 6.5 s importing Lightning alone, would take ≥ 12 s
    assert cpu < 10.0 and wall < 60.0, (cpu, wall)


@pytest.mark.slow
def test_auto_starts_fresh_then_resumes_the_jobs_newest_checkpoint(tmp_path: Path) -> None:
    job = tmp_path / "job"
    args = ["strategy=gpipe", "strategy.D=2", f"model.n_layer={SAVED['n_layer']}", "preflight=false",
            "data.global_batch_size=4", "checkpoint.every_n_steps=2", "ckpt_path=auto"]
    first = _train(job, *args, "trainer.max_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = job / CHECKPOINT_DIR / "step-000002.ckpt"
    assert f"ckpt_path=auto: no complete checkpoint in {job / CHECKPOINT_DIR}, starting fresh" in first.stdout
    meta = json.loads((saved / ckpt.META_FILE).read_text())
    assert meta[ckpt.MODEL_CONFIG_KEY] == _model_config(n_layer=SAVED["n_layer"])  # the launcher reads no trainer.pt
    history = json.loads((job / "results.json").read_text())["loss_history"]

    second = _train(job, *args, "trainer.max_steps=4")  # the same job directory, as a requeued job
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"ckpt_path=auto: resuming from {saved} (step 2)" in second.stdout
    assert OmegaConf.load(job / "job.yaml").config.ckpt_path == str(saved)  # the workers got the path, not "auto"
    resumed = json.loads((job / "results.json").read_text())["loss_history"]
    assert len(resumed) == 4 and resumed[:2] == history  # steps 1-2 restored from the checkpoint, 3-4 trained
    assert (job / CHECKPOINT_DIR / "step-000004.ckpt" / ckpt.META_FILE).is_file()
