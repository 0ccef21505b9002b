"""Sharded checkpoints, resuming (same and other layouts), consolidation and the transformers export.

Fast tests work in-process on ``strategies.checkpoint`` and the resumable loader. The slow ones run
``train.py`` on CPU: uninterrupted 6-step GPipe (D=2) runs, without and with dropout, that also save
checkpoints at steps 3 and 6 (saving does not change training), then three resumes from step 3,
started together since each spends most of its time importing Lightning: GPipe D=2 with dropout
from its sharded checkpoint (data position and random streams continue), DAPPLE W=2 D=1 from the
consolidated file, Chimera D=2 from the sharded checkpoint directly. Same global batch, so
the resumed losses must be the uninterrupted ones, and the step-6 checkpoints the DAPPLE and Chimera
runs save must consolidate to the uninterrupted run's step-6 state.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from pipeline_recipes.datamodules.resumable import ResumableDataLoader
from pipeline_recipes.strategies import checkpoint as ckpt
from pipeline_recipes.strategies.lightning.strategy import PipelineModule
from pipeline_recipes.core.pipeline_model import sequential_loss

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
COMMON = ["data.global_batch_size=8", "logger=none", "trainer.devices=2", "preflight=false",  # no memory estimate
          "scheduler.warmup_steps=2"]  # warm-up before the checkpoint at step 3, cosine decay after it
DROPOUT = ["model.resid_pdrop=0.1", "model.attn_pdrop=0.1", "model.embd_pdrop=0.1"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_config(name: str, **overrides) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")), **overrides}


def _trained_module(**overrides) -> tuple[PipelineModule, torch.optim.Optimizer, dict]:
    """Tiny GPT-2 (tied embeddings) after two AdamW steps on the unsplit model."""
    from hydra.utils import instantiate

    config = _model_config("gpt2-tiny", **{"n_layer": 2, **overrides})
    torch.manual_seed(0)
    module = PipelineModule(instantiate(config), model_config=config)
    optimizer = module.configure_optimizers()
    batch = {"input_ids": torch.randint(0, 1000, (2, 32))}
    for _ in range(2):
        optimizer.zero_grad()
        sequential_loss(module.model, batch).backward()
        optimizer.step()
    return module, optimizer, config


def _save_two_stages(module: PipelineModule, optimizer: torch.optim.Optimizer, path: Path) -> Path:
    """A sharded checkpoint of ``module`` split into stages [0, 2) and [2, 4), written in one process."""
    index = ckpt.ModelIndex.of(module, module.model.pipeline_layers())
    state = module.state_dict()
    partition = [range(0, 2), range(2, 4)]
    payloads = {s: ckpt.stage_payload(layers, module, state, [optimizer], index, with_common=s == 0)
                for s, layers in enumerate(partition)}
    meta = {"format": ckpt.SHARDED_FORMAT, "version": 1, "schedule": "gpipe", "D": 2, "W": 1,
            "world_size": 2, "partition": [[0, 2], [2, 4]], "num_layers": 4, "global_step": 2,
            "has_optimizer_states": True, "index": index.as_dict()}
    return ckpt.save_sharded(path, rank=0, write_parts=ckpt.stage_files(payloads), meta=meta,
                             trainer_state={"global_step": 2, "model_config": module.model_config},
                             write_trainer_state=lambda s, p: torch.save(dict(s), p), any_failed=lambda failed: failed)


def _drop(module: PipelineModule, keep: set[int]) -> PipelineModule:
    """A copy holding only layers ``keep`` (what a pipeline rank holds)."""
    local = copy.deepcopy(module)
    layers = local.model.pipeline_layers()
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = nn.Identity()
    return local


def test_model_index_names_tied_and_deduplicated_parameters() -> None:
    from hydra.utils import instantiate

    gpt2 = PipelineModule(instantiate(_model_config("gpt2-tiny", n_layer=2)))
    index = ckpt.ModelIndex.of(gpt2, gpt2.model.pipeline_layers())
    assert index.aliases == {"model.layers.3.lm_head.weight": "model.layers.0.wte.weight"}
    assert index.layer_of("model.layers.2.block.attn.c_attn.weight") == 2 and index.layer_of("other.w") is None
    assert "model.layers.3.lm_head.weight" not in index.param_order
    bert = PipelineModule(instantiate(_model_config("bert-tiny", num_hidden_layers=2)))
    aliases = ckpt.ModelIndex.of(bert, bert.model.pipeline_layers()).aliases
    assert aliases == {"model.layers.3.cls.predictions.decoder.bias": "model.layers.3.cls.predictions.bias"}


@pytest.mark.slow
def test_stages_consolidate_to_the_unsplit_state_and_load_into_any_split(tmp_path: Path) -> None:
    module, optimizer, _ = _trained_module()
    path = _save_two_stages(module, optimizer, tmp_path / "step-2.ckpt")
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "rng", "stage0.pt", "stage1.pt", "trainer.pt"]
    # consolidated = the unsplit module's own Lightning state: every key, torch's positional optimizer state
    full = ckpt.consolidate(path)
    reference = module.state_dict()
    assert full["state_dict"].keys() == reference.keys()
    assert all(torch.equal(full["state_dict"][k], v) for k, v in reference.items())
    expected = optimizer.state_dict()
    assert full["optimizer_states"][0]["param_groups"] == expected["param_groups"]
    for i, state in expected["state"].items():
        assert all(torch.equal(full["optimizer_states"][0]["state"][i][k], v) for k, v in state.items())
    # a rank holding layers {2, 3} (the tied head among them) of another split reads its part by name
    torch.save(full, tmp_path / "full.ckpt")
    plain = {k: v for k, v in full.items() if k != ckpt.PIPELINE_KEY}  # as strategy=single/ddp save it:
    plain[ckpt.OPTIMIZER_NAMES_KEY] = full[ckpt.PIPELINE_KEY]["param_names"]  # each position's parameter
    torch.save(plain, tmp_path / "plain.ckpt")
    for source in (path, tmp_path / "full.ckpt", tmp_path / "plain.ckpt"):
        local = _drop(module, {2, 3})
        with torch.no_grad():
            for p in local.parameters():
                p.zero_()
        local_opt = local.configure_optimizers()
        index = ckpt.ModelIndex.of(module, module.model.pipeline_layers())
        data = ckpt.read_checkpoint(source, index)
        local.load_state_dict(ckpt.select_model_state(data, local.state_dict()))
        local_opt.load_state_dict(ckpt.select_optimizer_state(data.optimizers[0], local_opt,
                                                              ckpt.parameter_names(local, index), str(source)))
        by_id = {id(p): n for n, p in module.named_parameters()}
        originals = {by_id[id(p)]: optimizer.state[p] for p in module.parameters()}
        for name, p in local.named_parameters():
            canonical = index.canonical(name)
            assert torch.equal(p, dict(module.named_parameters(remove_duplicate=False))[name])
            assert torch.equal(local_opt.state[p]["exp_avg"], originals[canonical]["exp_avg"]), name


@pytest.mark.slow
def test_a_one_group_optimizer_state_fills_the_weight_decay_groups() -> None:
    """Optimizer state saved with one parameter group (before biases and norms got their own) loads into
    the two groups by name; each group keeps its weight decay, the rest of the hyper-parameters come along."""
    module, _, _ = _trained_module()
    index = ckpt.ModelIndex.of(module, module.model.pipeline_layers())
    names = ckpt.parameter_names(module, index)
    old = torch.optim.AdamW(module.parameters(), lr=5e-4, weight_decay=0.0)
    for p in module.parameters():
        old.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.full_like(p, 0.5),
                        "exp_avg_sq": torch.full_like(p, 0.25)}
    saved = ckpt.OptimizerState({names[id(p)]: old.state[p] for p in module.parameters()},
                                [{"lr": 5e-4, "weight_decay": 0.0, "params": [names[id(p)] for p in module.parameters()]}])
    new = module.configure_optimizers()  # two groups: weight matrices, then biases and norms
    new.param_groups[0]["weight_decay"] = 0.1  # as optim.weight_decay=0.1 would configure it
    new.load_state_dict(ckpt.select_optimizer_state(saved, new, names, "old.ckpt"))
    assert [(g["lr"], g["weight_decay"]) for g in new.param_groups] == [(5e-4, 0.1), (5e-4, 0.0)]
    assert all(torch.equal(new.state[p]["exp_avg"], torch.full_like(p, 0.5)) for p in module.parameters())


@pytest.mark.slow
def test_checkpoint_errors_name_the_problem(tmp_path: Path) -> None:
    module, optimizer, _ = _trained_module()
    path = _save_two_stages(module, optimizer, tmp_path / "a.ckpt")
    wider, _, _ = _trained_module(n_embd=32)
    data = ckpt.read_checkpoint(path)
    with pytest.raises(ckpt.CheckpointError, match="shape .* another model configuration"):
        ckpt.select_model_state(data, wider.state_dict())
    deeper = _trained_module(n_layer=3)[0]  # 5 pipeline layers, the checkpoint has 4
    index = ckpt.ModelIndex.of(deeper, deeper.model.pipeline_layers())
    with pytest.raises(ckpt.CheckpointError, match="layer 4 is not in the checkpoint.*another model"):
        ckpt.stages_holding(data.meta, {index.layer_of(k) for k in deeper.state_dict()})
    (tmp_path / "b.ckpt.partial").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="did not finish"):
        ckpt.read_meta(tmp_path / "b.ckpt.partial")
    consolidate = _script("consolidate_ckpt")
    assert consolidate.main([str(tmp_path), str(tmp_path / "out.ckpt")]) == 2


@pytest.mark.slow
def test_ddp_and_single_ask_for_a_consolidated_checkpoint(tmp_path: Path) -> None:
    from pipeline_recipes.recipe.check.settings import ConfigError
    from pipeline_recipes.recipe.check.resume import resolve_resume

    module, optimizer, config = _trained_module()
    path = _save_two_stages(module, optimizer, tmp_path / "s.ckpt")

    def resume(value: Path, strategy: str) -> str | None:  # checked by the launcher, before any process starts
        return resolve_resume(OmegaConf.create({"ckpt_path": str(value), "model": config}), tmp_path, strategy).path

    assert resume(path, "gpipe") == str(path)
    with pytest.raises(ConfigError, match="consolidate it first: python scripts/consolidate_ckpt.py"):
        resume(path, "single")
    with pytest.raises(ConfigError, match="does not exist"):
        resume(tmp_path / "missing.ckpt", "gpipe")


def test_resumable_loader_continues_the_epoch_on_any_number_of_replicas() -> None:
    data = TensorDataset(torch.arange(64))

    def batches(replicas: int, epoch: int, state: dict | None = None, passes: int = 1) -> list[list[int]]:
        out = []
        for rank in range(replicas):
            sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=3)
            loader = ResumableDataLoader(data, batch_size=8 // replicas, sampler=sampler, drop_last=True)
            sampler.set_epoch(0)  # Lightning sets the epoch only after its first fetch
            if state:
                loader.load_state_dict(state)
            else:
                sampler.set_epoch(epoch)
            assert len(loader) == 64 // 8
            for _ in range(passes):
                rows = [b[0].tolist() for b in loader]
            out.append(rows)
        return [sorted(sum(rows, [])) for rows in zip(*out)]  # the global batch of each step

    full = batches(1, epoch=1)
    state = {"epoch": 1, "batches": 3, "epoch_batches": 8, "global_batch_size": 8}
    assert batches(1, 1, state) == full[3:]
    assert batches(2, 1, state) == full[3:]  # other W, same global batches
    assert batches(1, 1, state, passes=2) == batches(1, 1)  # later epochs are not skipped
    assert batches(2, 2, {**state, "batches": 8}) == batches(1, 2)  # saved at the epoch's end
    loader = ResumableDataLoader(data, batch_size=4, position=lambda: {})
    loader.position.global_batch_size = 4
    with pytest.raises(ValueError, match="resume with data.global_batch_size=8"):
        loader.load_state_dict(state)


@pytest.mark.slow
def test_export_bert_keeps_the_trained_output_bias(tmp_path: Path) -> None:
    from hydra.utils import instantiate
    from transformers import BertForPreTraining

    config = _model_config("bert-tiny", num_hidden_layers=2)
    torch.manual_seed(0)
    model = instantiate(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # "trained": the output bias is no longer zero
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "model_config": config},
               tmp_path / "bert.ckpt")  # a Lightning checkpoint of the unsplit module
    _script("export_hf").export(tmp_path / "bert.ckpt", tmp_path / "hf")
    loaded = BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 1000, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        want = model.eval().reference()(input_ids=ids, attention_mask=mask)
        got = loaded(input_ids=ids, attention_mask=mask)
    assert torch.equal(want.prediction_logits, got.prediction_logits)
    assert torch.equal(want.seq_relationship_logits, got.seq_relationship_logits)


# -- train.py runs ------------------------------------------------------------------------------


def _train(out: Path, *overrides: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={out}", *COMMON, *overrides],
                            cwd=out, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: int = 300) -> str:
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]
    return output


def _losses(out: Path, key: str = "loss_history") -> list[float]:
    return json.loads((out / "results.json").read_text())[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    full = ("strategy=gpipe", "strategy.D=2", "trainer.max_steps=6", "checkpoint.every_n_steps=3",
            "checkpoint.keep=all")
    for proc in [_train(root / "full", *full), _train(root / "full_dropout", *full, *DROPOUT)]:
        _finish(proc)
    step3 = root / "full" / "checkpoints" / "step-000003.ckpt"
    assert _script("consolidate_ckpt").main([str(step3), str(root / "step3.ckpt")]) == 0
    resumes = {  # the same layout with dropout: each rank's random stream must continue too
        "gpipe": ("strategy=gpipe", "strategy.D=2", *DROPOUT,
                  f"ckpt_path={root / 'full_dropout' / 'checkpoints' / 'step-000003.ckpt'}"),
        "dapple": ("strategy=dapple", "strategy.D=1", f"ckpt_path={root / 'step3.ckpt'}", "checkpoint.every_n_steps=6"),
        "chimera": ("strategy=chimera", "strategy.D=2", f"ckpt_path={step3}", "checkpoint.every_n_steps=6"),
        # two stages per worker in a V: 4 stages from GPipe's 2, the tied ends on one rank
        "zbv": ("strategy=zbv", "strategy.D=2", f"ckpt_path={step3}", "checkpoint.every_n_steps=6"),
    }
    procs = {name: _train(root / name, "trainer.max_steps=6", *args) for name, args in resumes.items()}
    for proc in procs.values():
        _finish(proc)
    return {"root": root, "full": root / "full", "full_dropout": root / "full_dropout", "step3": step3,
            **{name: root / name for name in resumes}}


@pytest.mark.slow
def test_a_checkpoint_is_one_dcp_state_under_the_unsplit_names_that_torch_reads(runs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert sorted(p.name for p in (runs["full"] / "checkpoints").iterdir()) == ["step-000003.ckpt", "step-000006.ckpt"]
    step3 = runs["full"] / "checkpoints" / "step-000003.ckpt"
    assert sorted(p.name for p in step3.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rng",
                                                       "trainer.pt"]
    meta = json.loads((step3 / "meta.json").read_text())
    assert (meta["schedule"], meta["D"], meta["W"], meta["global_step"], meta["partition"]) == ("gpipe", 2, 1, 3,
                                                                                                 [[0, 3], [3, 6]])
    assert meta["version"] == 2 and meta["storage"] == "dcp"
    # torch's own converter: one file of the unsplit names, each tensor once (the tied head under the embedding's
    # name), Adam's moments shaped like their parameters
    dcp_to_torch_save(step3, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    index = ckpt.ModelIndex.from_dict(meta["index"])
    consolidated = ckpt.consolidate(step3)  # our reader; its state dict has every name of the unsplit module
    assert index.aliases and not set(index.aliases) & set(whole)
    assert {k for k in whole if k.startswith("model.")} == {index.canonical(k) for k in consolidated["state_dict"]}
    moments = [k for k in whole if k.endswith(".exp_avg")]
    assert len(moments) == len(consolidated["pipeline"]["param_names"][0])
    for key in moments:
        assert whole[key].shape == whole[key.removeprefix("optimizer.0.state.").removesuffix(".exp_avg")].shape
    for key, value in consolidated["state_dict"].items():  # our reader agrees with torch's
        assert torch.equal(whole[index.canonical(key)], value), key


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["gpipe", "dapple", "chimera", "zbv"])
def test_resuming_gives_the_uninterrupted_losses(runs: dict[str, Path], resumed: str) -> None:
    full, losses = _losses(runs["full_dropout" if resumed == "gpipe" else "full"]), _losses(runs[resumed])
    assert len(full) == len(losses) == 6
    assert losses[:3] == full[:3]  # the history before the checkpoint comes with it
    tolerance = 1e-6 if resumed == "gpipe" else 1e-5  # other layouts sum in another order
    assert max(abs(a - b) for a, b in zip(full[3:], losses[3:])) <= tolerance, (full, losses)
    # the learning-rate schedule (checkpointed with the trainer state) continues where it stopped
    full_lr, resumed_lr = _losses(runs["full"], "lr_history"), _losses(runs[resumed], "lr_history")
    assert resumed_lr == full_lr and len(set(full_lr)) == 6, (full_lr, resumed_lr)
    result = json.loads((runs[resumed] / "results.json").read_text())
    assert (result["strategy"], result["D"], result["W"]) == {"gpipe": ("gpipe", 2, 1), "dapple": ("dapple", 1, 2),
                                                              "chimera": ("chimera", 2, 1), "zbv": ("zbv", 2, 1)}[resumed]


@pytest.mark.slow
def test_other_layouts_save_the_same_state(runs: dict[str, Path]) -> None:
    """Step 6 as saved by GPipe D=2 (uninterrupted), DAPPLE W=2 D=1 (two copies of one stage),
    Chimera D=2 (every rank holds both stages) and ZBV D=2 (four stages, two per rank in a V): the same
    model and optimizer state once consolidated."""
    states = {name: ckpt.consolidate(runs[name] / "checkpoints" / "step-000006.ckpt")
              for name in ("full", "dapple", "chimera", "zbv")}
    reference = states.pop("full")
    for name, state in states.items():
        assert state["state_dict"].keys() == reference["state_dict"].keys()
        for key, value in reference["state_dict"].items():
            torch.testing.assert_close(state["state_dict"][key], value, rtol=0, atol=1e-5, msg=f"{name} {key}")
        assert state["pipeline"]["param_names"] == reference["pipeline"]["param_names"]
        for i, entry in reference["optimizer_states"][0]["state"].items():
            torch.testing.assert_close(state["optimizer_states"][0]["state"][i]["exp_avg"], entry["exp_avg"],
                                       rtol=0, atol=1e-6)
    meta = json.loads((runs["dapple"] / "checkpoints" / "step-000006.ckpt" / "meta.json").read_text())
    assert (meta["W"], meta["D"]) == (2, 1)
    meta = json.loads((runs["zbv"] / "checkpoints" / "step-000006.ckpt" / "meta.json").read_text())
    assert (meta["D"], meta["S"]) == (2, 4)


@pytest.mark.slow
def test_exported_gpt2_has_the_trained_weights(runs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    export = _script("export_hf")
    export.export(runs["step3"], tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    trained = export.load_trained(runs["root"] / "step3.ckpt")  # the consolidated file
    fresh = export.build_model(torch.load(runs["root"] / "step3.ckpt", weights_only=True)["model_config"])
    ids = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        want = trained.reference()(ids).logits
        assert torch.equal(loaded(ids).logits, want)
        assert not torch.allclose(fresh.eval().reference()(ids).logits, want)
