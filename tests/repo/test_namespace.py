"""One import name (``pipeline_recipes``): the packaging, the console commands, and checkpoints written under
the old top-level names (``strategies.…``, ``models.…``) still loading (strategies.legacy)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeline_recipes import cli
from pipeline_recipes.strategies import checkpoint as ckpt
from pipeline_recipes.strategies import legacy
from pipeline_recipes.strategies.lightning import optim

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _old_names(data: bytes) -> bytes:
    """A pickle stream as the packages' old top-level names would have written it."""
    return data.replace(f"{legacy.PACKAGE}.".encode(), b"") if legacy.PACKAGE else data


def _export_script():
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- old checkpoints --------------------------------------------------------------------------


def test_a_checkpoint_naming_the_old_model_target_is_read_and_exported(tmp_path: Path) -> None:
    from hydra.utils import instantiate

    config = {**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "gpt2-tiny.yaml")),
              "n_layer": 2}
    current = config["_target_"]
    torch.manual_seed(0)
    model = instantiate(config)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "model_config": config},
               tmp_path / "new.ckpt")
    saved = torch.load(tmp_path / "new.ckpt", weights_only=True)  # the fresh checkpoint, renamed as before
    saved["model_config"]["_target_"] = current.removeprefix(f"{legacy.PACKAGE}.") if legacy.PACKAGE else current
    torch.save(saved, tmp_path / "old.ckpt")

    full = ckpt.read_checkpoint(tmp_path / "old.ckpt")
    assert full.trainer_state["model_config"]["_target_"] == current
    export = _export_script()
    trained = export.load_trained(tmp_path / "old.ckpt")
    assert type(trained) is type(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(trained.state_dict()[name], tensor), name
    old_config = torch.load(tmp_path / "old.ckpt", weights_only=True)["model_config"]
    assert type(export.build_model(old_config)) is type(model)  # a config read without read_checkpoint


def test_targets_of_old_names_are_renamed_and_others_kept() -> None:
    chimera, gpt2 = "strategies.lightning.ChimeraStrategy", "models.build_gpt2"  # namespace: old name
    old = {"_target_": chimera, "D": 4, "inner": [{"_target_": gpt2}, {"_target_": "torch.optim.AdamW", "lr": 1e-3}],
           "name": chimera}  # not a _target_: left alone
    new = legacy.upgrade_targets(old)
    prefix = f"{legacy.PACKAGE}." if legacy.PACKAGE else ""
    assert new == {"_target_": prefix + chimera, "D": 4,
                   "inner": [{"_target_": prefix + gpt2}, {"_target_": "torch.optim.AdamW", "lr": 1e-3}],
                   "name": chimera}
    assert legacy.upgrade_targets(new) == new  # today's names stay as they are
    assert old["_target_"] == chimera  # a copy: the input is unchanged


def test_objects_pickled_under_old_module_names_load_as_todays(tmp_path: Path) -> None:
    factory = functools.partial(optim.cosine, warmup_steps=3)
    buffer = io.BytesIO()
    torch.save({"state_dict": {}, "scheduler": factory}, buffer, _use_new_zipfile_serialization=False)
    (tmp_path / "old.ckpt").write_bytes(_old_names(buffer.getvalue()))
    if legacy.PACKAGE:
        assert b"pipeline_recipes" not in (tmp_path / "old.ckpt").read_bytes()

    full = ckpt.read_checkpoint(tmp_path / "old.ckpt", load_file=lambda p: torch.load(p, weights_only=False))
    loaded = full.trainer_state["scheduler"]
    assert loaded.func is optim.cosine and loaded.keywords == {"warmup_steps": 3}  # the very same function
    assert optim.__spec__.name == optim.__name__
    for old in legacy.OLD_PACKAGES if legacy.PACKAGE else ():  # the aliases are gone again
        assert not any(name == old or name.startswith(f"{old}.") for name in sys.modules), old


# -- packaging and commands -----------------------------------------------------------------------


def test_every_package_under_src_is_installed_under_one_name() -> None:
    """Every folder of ``src/`` is a package of ``pipeline_recipes``, but for ``src/hydra_plugins``: Hydra takes a
    launcher only from its ``hydra_plugins`` namespace, so the SLURM preset's launcher is installed there."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    if not isinstance(setuptools.get("packages"), list):
        pytest.skip("the folders of src/ are still installed as top-level packages (packages.find)")
    src = ROOT / "src"
    plugins = {".".join(init.parent.relative_to(src).parts) for init in (src / "hydra_plugins").glob("*/__init__.py")}
    expected = {"pipeline_recipes"} | plugins | {
        "pipeline_recipes." + ".".join(init.parent.relative_to(src).parts)
        for init in src.glob("*/**/__init__.py") if init.parent.relative_to(src).parts[0] not in ("pipeline_recipes",
                                                                                                "hydra_plugins")}
    assert sorted(setuptools["packages"]) == sorted(expected), "re-run the conversion: a package was added or removed"
    tops = {p.split(".")[1] for p in expected if p.count(".") == 1 and p.startswith("pipeline_recipes.")}
    assert setuptools["package-dir"] == {"pipeline_recipes": "src/pipeline_recipes",
                                         **{f"pipeline_recipes.{t}": f"src/{t}" for t in tops},
                                         **{p: "src/" + p.replace(".", "/") for p in plugins}}
    assert plugins == {"hydra_plugins.pipeline_recipes_slurm"}
    assert all(p == "pipeline_recipes" or p.startswith("pipeline_recipes.") for p in setuptools["packages"]
               if p not in plugins)


def test_the_commands_name_existing_scripts_and_functions() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == set(cli.COMMANDS)
    for command, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target
        assert (ROOT / cli.COMMANDS[command]).is_file(), command
    assert cli.ROOT == ROOT


def test_a_command_runs_its_script_with_the_arguments(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["pipeline-schedule", "gpipe", "--stages", "2", "--micro-batches", "3", "--json"])
    with pytest.raises(SystemExit) as exit_:
        cli.schedule()
    assert exit_.value.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert (out["schedule"], out["stages"], out["micro_batches"]) == ("gpipe", 2, 3)
    assert [sum(a["kind"] == "F" for a in worker) for worker in out["workers"]] == [3, 3]


def test_a_command_without_its_checkout_names_the_missing_script(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.run_script("scripts/schedule.py", root=tmp_path)
    assert "scripts/schedule.py not found" in str(exit_.value.code) and "pip install -e ." in str(exit_.value.code)
