"""The GPU path: NCCL process groups, CUDA tensors through the executor, bf16 mixed precision.

The ``gpu`` tests are skipped without CUDA (CI is CPU-only; the bf16-autocast comparison and the
timeout path also run on CPU over gloo, and every case's model, schedule and ``train.py`` layout is
built on the meta device, so a case that cannot run fails in CI); run wherever a GPU is available with
``python -m pytest -q -n 0 -m gpu tests/strategies/runtime/test_gpu.py``, or every GPU check at once with
``bash scripts/gpu_check.sh OUT_DIR``.

* Over NCCL, one rank per GPU, on every visible GPU (the largest of 8, 4, 2, 1): every schedule and
  Chimera's variants at D = world and at W = 2 replicas, eager gradient sync (``eager``,
  ``eager_opt``), recomputation, bf16 with and without recomputation, and a model whose boundary
  activations are several MB (past NCCL's eager buffers, where a send waits for its receive).
* On one GPU, ranks sharing it over gloo (messages staged through the host): the same schedules on
  CUDA tensors, with bf16, CUDA-event timelines and CUDA memory figures.
* ``train.py`` with bf16-mixed on the GPUs (every synchronous schedule and both asynchronous ones; on
  one GPU the runs go side by side), its reserved-memory figures, and a rank that stops answering
  inside a step.

The reference is the unsplit ``transformers`` GPT-2 trained on the same GPU in fp32 with TF32 off;
bf16 autocast runs are compared with the reference under the same autocast. The measured timeline
(CUDA events on a GPU) must lie inside the step, in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distributed import run_world
from toy_model import train_sgd

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[3]
STEPS, B, LR, MOMENTUM = 3, 2, 0.1, 0.9
TOL_FP32, TOL_BF16 = 1e-5, 3e-2
GPT2 = {"n_layer": 4, "n_embd": 64, "n_head": 2, "vocab_size": 256, "seq_len": 32, "tie_word_embeddings": False}


# boundary activations of 4 MB at B = 2 (fp32); positions for the whole sequence (gpt2-tiny has 64)
LARGE = {"n_embd": 1024, "n_head": 8, "seq_len": 512, "n_positions": 512}


def _world() -> int:
    """The largest of 8, 4, 2, 1 ranks the visible GPUs take (one GPU per rank)."""
    count = torch.cuda.device_count()
    return next(n for n in (8, 4, 2, 1) if count >= n)


def _case(schedule: str, W: int, D: int, N: int, *, model: dict | None = None, **extra) -> dict:
    """One comparison; the model gets a block per worker where the tiny GPT-2's 4 cannot fill D stages."""
    model = dict(model or {})
    if D > GPT2["n_layer"]:
        model.setdefault("n_layer", D)
    return {"schedule": schedule, "W": W, "D": D, "N": N, "recompute": "none", "grad_sync": "end", "bf16": False,
            "concat": "direct", "model": model, **extra}


def _layout(case: dict, device: str = "meta") -> tuple:
    """The case's model (built on ``device``, ``init_seed=0``) and its layout (as the launcher derives it): what every
    rank of the GPU tests builds, and what the CPU check of the case lists builds on the meta device."""
    from pipeline_recipes.models import build_model
    from pipeline_recipes.strategies.schedules import derive_layout

    model = build_model("gpt2-tiny", init_seed=0, device=device, **{**GPT2, **case["model"]})
    W, D = case["W"], case["D"]
    layout = derive_layout(case["schedule"], W * D, D, W * case["N"] * B, B=B, concat=case["concat"],
                           grad_sync=case["grad_sync"], recompute=case["recompute"], chunks=case.get("chunks"),
                           shard_optimizer=case.get("shard_optimizer", False))
    return model, layout


def _cases(world: int) -> list[dict]:
    layouts = [(1, world)] + ([(2, world // 2)] if world >= 4 else [])
    cases = []
    for W, D in layouts:
        for schedule in ("gpipe", "dapple", "gems", "chimera"):
            if schedule in ("gems", "chimera") and D % 2:
                continue  # two pipelines in opposite directions: even D only
            for N in (D, 2 * D + 1):
                cases.append(_case(schedule, W, D, N))
        if D % 2 == 0:
            cases.append(_case("chimera", W, D, 2 * D, concat="forward_doubling"))
            cases.append(_case("chimera", W, D, D, concat="backward_halving", grad_sync="eager"))
            cases.append(_case("chimera", W, D, D, grad_sync="eager_opt"))
        cases.append(_case("dapple", W, D, 2 * D, recompute="always", grad_sync="eager"))
        deep = {"n_layer": 2 * D}  # two stages per worker: S = 2D stages
        cases.append(_case("interleaved_1f1b", W, D, 2 * D, chunks=2, model=deep))
        cases.append(_case("zb_h1", W, D, 2 * D))
        cases.append(_case("zb_h2", W, D, 2 * D, grad_sync="eager"))
        cases.append(_case("zbv", W, D, 2 * D, model=deep, recompute="always"))
        cases.append(_case("dualpipev", W, D, 2 * D, model=deep))
        cases.append(_case("zbv", W, D, 2 * D, model=deep, bf16=True))
        if D % 2 == 0:
            cases.append(_case("chimera_zb", W, D, D))
            cases.append(_case("chimera", W, D, D, shard_optimizer=True))  # NCCL's reduce-scatter and all-gather
        if W > 1:
            cases.append(_case("dapple", W, D, 2 * D, shard_optimizer=True, grad_sync="eager"))
        cases.append(_case("gpipe", W, D, 2 * D, bf16=True))
        cases.append(_case("dapple", W, D, 2 * D, bf16=True, recompute="always"))
    D = world
    cases.append(_case("dapple", 1, D, D, model={**LARGE, "n_layer": max(D, 4)}))
    if D % 2 == 0:
        cases.append(_case("chimera", 1, D, D, model={**LARGE, "n_layer": max(D, 4)}))
    return cases


def _shared_gpu_cases() -> list[dict]:
    """Four ranks on one GPU: every schedule, Chimera's doubling with eager sync, W = 2 in bf16, sharded optimizer
    state (gloo's collectives on CUDA tensors)."""
    cases = [_case(s, 1, 4, 4) for s in ("gpipe", "dapple", "gems", "chimera")]
    cases += [_case(s, 1, 4, 8, model={"n_layer": 8}) for s in ("interleaved_1f1b", "zbv", "dualpipev")]
    cases += [_case(s, 1, 4, 4) for s in ("zb_h1", "zb_h2", "chimera_zb")]
    cases += [_case("chimera", 1, 4, 8, concat="forward_doubling", grad_sync="eager_opt"),
              _case("dapple", 2, 2, 4, bf16=True, recompute="always"), _case("chimera", 2, 2, 4, bf16=True),
              _case("chimera", 2, 2, 4, shard_optimizer=True), _case("dapple", 2, 2, 4, shard_optimizer=True, bf16=True)]
    return cases


def _bf16_cpu_cases() -> list[dict]:
    return [_case(s, 1, 2, 4, recompute=r, bf16=True) for s, r in (("chimera", "none"), ("dapple", "always"),
                                                                    ("zb_h1", "none"))]


def _pipeline_vs_hf_on_gpu(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from pipeline_recipes.datamodules import SyntheticGPT2Dataset
    from pipeline_recipes.recipe.worker.metrics import peak_memory_bytes
    from pipeline_recipes.strategies.runtime.engine import build_engine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", rank)
    elif torch.cuda.is_available():  # ranks sharing one GPU over gloo: messages staged through the host
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")  # the CPU run of the bf16 comparison
    out = []
    for case in cases:
        W, N = case["W"], case["N"]
        model, layout = _layout(case)  # on the meta device: each rank materialises its stages
        twin = _layout(case, device="cpu")[0].to(device)  # the unsplit reference, same init
        samples = W * N * B
        data = SyntheticGPT2Dataset(STEPS * samples, twin.seq_len, twin.config.vocab_size, seed=3)
        batches = [{k: v.to(device) for k, v in default_collate([data[i] for i in range(s * samples, (s + 1) * samples)]).items()}
                   for s in range(STEPS)]
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=case["bf16"])

        hf = twin.reference()

        def hf_loss(batch: dict) -> torch.Tensor:
            with autocast:
                return hf(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

        ref_losses, ref_params = train_sgd(twin, hf_loss, batches, LR, MOMENTUM, trained=hf)
        names = {id(p): n for n, p in model.named_parameters()}  # the pipeline's names equal the twin's
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine = build_engine(model, layout, device, partition=model.partition(layout.stages), timeout_s=60.0)
        params = engine.local_parameters()
        assert all(p.device == device for p in params)
        opt = engine.build_optimizer(lambda groups: torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM),
                                     [{"params": params}])  # strategy.shard_optimizer: this rank's slices
        replica = engine.topology.replica_of(rank)
        losses = []
        for batch in batches:
            mine = {k: v[replica * N * B:(replica + 1) * N * B] for k, v in batch.items()}
            start = time.perf_counter()
            with autocast:
                losses.append(engine.train_step(mine).item())  # .item(): the step's GPU work is done
            wall = time.perf_counter() - start
            opt.step()
        boxes = engine.last_record.timeline  # CUDA events on a GPU: execution, not launch, times
        ordered = all(s <= e for _, s, e in boxes) and all(a[2] <= b[1] + 1e-6 for a, b in zip(boxes, boxes[1:]))
        inside = start - 1e-3 <= boxes[0][1] and boxes[-1][2] <= start + wall + 1e-3
        errs = {names[id(p)]: (p.detach() - ref_params[names[id(p)]]).abs().max().item() for p in params}
        memory_ok = True
        if device.type == "cuda":  # reserved (what must fit) covers allocated; results.json reports reserved
            reserved, allocated = torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
            memory_ok = reserved >= allocated > 0 and peak_memory_bytes(device) == reserved
        out.append({**case, "backend": dist.get_backend(), "errs": errs, "losses": losses, "ref_losses": ref_losses,
                    "timeline_ok": ordered and inside, "memory_ok": memory_ok, "device": str(device),
                    "peak_stored_bytes": engine.last_record.peak_stored_bytes if engine.last_record else 0})
        dist.barrier()
    return out


def _check(cases: list[dict], results: list[list[dict]], world: int, backend: str) -> None:
    worst: dict[str, float] = {}
    for i, case in enumerate(cases):
        label = " ".join(f"{k}={v}" for k, v in case.items())
        tol = TOL_BF16 if case["bf16"] else TOL_FP32
        for per_rank in (r[i] for r in results):
            assert per_rank["backend"] == backend
            assert per_rank["timeline_ok"], f"{label}: measured boxes out of order or outside the step"
            assert per_rank["memory_ok"], f"{label}: CUDA peak memory figures inconsistent"
            assert per_rank["losses"] == pytest.approx(per_rank["ref_losses"], abs=tol), label
            for name, err in per_rank["errs"].items():
                assert err < tol, f"{label}: {name} differs by {err:.2e}"
            key = "bf16" if case["bf16"] else "fp32"
            worst[key] = max([worst.get(key, 0.0), *per_rank["errs"].values()])
    print(f"world={world} over {backend}: max |param - HF param| after {STEPS} steps:",
          {k: f"{v:.2e}" for k, v in worst.items()})


def _case_lists() -> dict[str, tuple[int, list[dict]]]:
    """Every case list of this file, with the world size it runs on."""
    lists = {f"nccl world={w}": (w, _cases(w)) for w in (1, 2, 4, 8)}
    lists["four ranks on one GPU"] = (4, _shared_gpu_cases())
    lists["bf16 on CPU"] = (2, _bf16_cpu_cases())
    return lists


@pytest.mark.parametrize("name", list(_case_lists()))
@pytest.mark.slow
def test_every_case_of_the_gpu_tests_builds_on_the_meta_device(name: str) -> None:
    """Each case's model and layout, built as every rank of the GPU tests builds them but on the meta
    device: a case that cannot run fails here, on a CPU, instead of when a GPU is at hand."""
    from pipeline_recipes.strategies.runtime.engine import check_layout
    from pipeline_recipes.strategies.runtime.topology import Topology

    world, cases = _case_lists()[name]
    assert cases
    for case in cases:
        label = " ".join(f"{k}={v}" for k, v in case.items())
        model, layout = _layout(case)
        assert all(t.is_meta for t in model.parameters()), label
        assert model.seq_len <= model.config.n_positions, f"{label}: more tokens than position embeddings"
        check_layout(layout)  # the schedule's rules at this N, its placement the layout's
        assert Topology.from_layout(layout).world_size == world, label
        partition = model.partition(layout.stages)
        assert [i for r in partition for i in r] == list(range(len(model.pipeline_layers()))), label
        assert len(partition) == layout.stages and all(len(r) for r in partition), label


# data.num_workers=0: the runs go side by side on one GPU; loader processes would only crowd the CPUs
TRAIN = ("trainer=gpu", "logger=none", "model=gpt2-tiny", "data.global_batch_size=16", "trainer.max_steps=30",
         "trainer.log_every_n_steps=5", "data.num_workers=0")
GPT2_TINY_BLOCKS = 4  # conf/model/gpt2-tiny.yaml: n_layer
TRAIN_STRATEGIES = ("gpipe", "dapple", "gems", "chimera", "pipedream_2bw", "pipedream", "single", "interleaved_1f1b",
                    "zb_h1", "zb_h2", "zbv", "dualpipev", "chimera_zb")


def _train_overrides(strategy: str, world: int) -> list[str] | None:
    """``train.py``'s overrides (after ``TRAIN``) of the bf16 run of ``strategy`` on ``world`` GPUs; None where
    the strategy needs an even D."""
    D = world if strategy != "single" else 1
    if strategy in ("gems", "chimera", "chimera_zb") and D % 2:
        return None
    extra = [] if strategy == "single" else [f"strategy.D={D}"]
    if strategy == "pipedream":
        extra.append(f"data.global_batch_size={B}")  # N = 1: one micro-batch per update
    if strategy in ("interleaved_1f1b", "zbv", "dualpipev"):
        extra.append(f"model.n_layer={max(2 * D, 2)}")  # S = 2D stages
    elif D > GPT2_TINY_BLOCKS:
        extra.append(f"model.n_layer={D}")  # a block per stage
    if strategy == "dualpipev":
        extra.append(f"data.global_batch_size={max(16, 2 * D)}")  # N ≥ 2D
    return [f"strategy={strategy}", f"trainer.devices={world if strategy != 'single' else 1}", *extra]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.slow
def test_every_train_py_case_of_the_gpu_tests_resolves_its_layout(world: int) -> None:
    """The bf16 ``train.py`` runs' configs, composed as ``train.py`` composes them, pass the launcher's layout
    and model checks (what it checks before any process starts) on a CPU."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline_recipes.recipe.launch.main import num_layers
    from pipeline_recipes.recipe.check.settings import check_model, resolve_layout

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for strategy in TRAIN_STRATEGIES:
            overrides = _train_overrides(strategy, world)
            if overrides is None:
                continue
            cfg = OmegaConf.to_container(compose("config", overrides=[*TRAIN, *overrides]), resolve=True)
            layout = resolve_layout(cfg["strategy"], cfg["trainer"], cfg["data"]["global_batch_size"],
                                    num_layers(cfg["model"]))
            check_model(cfg["model"], cfg["data"])
            processes = 1 if strategy == "single" else world
            assert layout.world_size == processes and layout.W * layout.D == processes, overrides


class _TrainJob:
    """One ``train.py`` run in its own directory (its output in ``train.log``), started on demand."""

    def __init__(self, job: Path, overrides: list[str]) -> None:
        self.job, self.overrides = job, overrides
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.job / "train.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={self.job / 'run'}", *TRAIN, *self.overrides],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def result(self) -> dict:
        if self.proc is None:
            self.start()
        code = self.proc.wait(timeout=600)
        assert code == 0, (self.job / "train.log").read_text()[-6000:]
        return json.loads((self.job / "run" / "results.json").read_text())

    def stop(self) -> None:
        """End a run left running (its test failed or timed out), its ranks with it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def train_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The selected bf16 ``train.py`` runs by strategy. On one GPU they all start at once (the GPU holds the
    tiny one-rank jobs side by side: they take about as long as the slowest, not their sum); on several,
    one after the other (NCCL jobs sharing GPUs would contend for them)."""
    wanted = {item.callspec.params["strategy"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_train_py_bf16_on_gpu"}
    world = _world()
    jobs = {strategy: _TrainJob(tmp_path_factory.mktemp(f"train_{strategy}"), overrides)
            for strategy in TRAIN_STRATEGIES
            if strategy in wanted and (overrides := _train_overrides(strategy, world)) is not None}
    if world == 1:
        for job in jobs.values():
            job.start()
    yield jobs
    for job in jobs.values():
        job.stop()


@pytest.mark.gpu
@needs_gpu
def test_nccl_pipeline_equals_unsplit_gpt2_on_gpu() -> None:
    world = _world()
    cases = _cases(world)
    _check(cases, run_world(world, _pipeline_vs_hf_on_gpu, cases, backend="nccl", timeout=900), world, "nccl")


@pytest.mark.gpu
@needs_gpu
def test_ranks_sharing_one_gpu_run_every_schedule_on_cuda_tensors() -> None:
    """Four ranks on GPU 0 over gloo (NCCL refuses two ranks on one GPU): the executor's CUDA compute,
    bf16, recomputation, CUDA-event timelines and CUDA memory figures with messages staged through the host."""
    cases = _shared_gpu_cases()
    results = run_world(4, _pipeline_vs_hf_on_gpu, cases, backend="gloo", timeout=900)
    assert all(r["device"] == "cuda:0" for rank in results for r in rank)
    _check(cases, results, 4, "gloo")


@pytest.mark.slow
def test_bf16_autocast_pipeline_matches_reference_on_cpu() -> None:
    """The same bf16-autocast comparison over gloo on CPU (what CI can run of the mixed-precision path),
    with and without recomputation (autocast's cached casts must not cost the weights their gradients), and
    with split backwards (GPT-2's ``Conv1D`` layers deferring their weight gradients under autocast)."""
    cases = _bf16_cpu_cases()
    _check(cases, run_world(2, _pipeline_vs_hf_on_gpu, cases), 2, "gloo")


def _silent_peer(rank: int, world: int, backend: str, timeout_s: float, silent_s: float) -> str:
    """Rank 1 stops answering before its second step; rank 0 must name it within the timeout."""
    import torch.distributed as dist

    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout
    from toy_model import ToyMLP, toy_batches

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    engine = build_engine(ToyMLP(layers=4, width=8), derive_layout("dapple", 2, 2, 8, B=2), device,
                          timeout_s=timeout_s)
    batches = [{k: v.to(device) for k, v in b.items()} for b in toy_batches(2, 8)]
    engine.train_step(batches[0]).item()
    if rank == 1:
        time.sleep(silent_s)  # alive and silent (its heartbeat would go on)
        return "slept"
    start = time.monotonic()
    try:
        engine.train_step(batches[1]).item()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{time.monotonic() - start:.1f}s: {err}"
    finally:
        dist.barrier() if backend == "gloo" else None
    return "no error"


def _check_silent_peer(results: list[str], timeout_s: float) -> None:
    seconds, message = results[0].split("s: ", 1)
    assert "rank 1 stopped answering" in message, message
    assert float(seconds) < timeout_s + 10, results[0]


@pytest.mark.slow
def test_a_silent_peer_is_named_within_the_timeout_on_cpu() -> None:
    _check_silent_peer(run_world(2, _silent_peer, "gloo", 3.0, 6.0, timeout=120), 3.0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_silent_peer_is_named_within_the_timeout_on_nccl() -> None:
    """Stream-ordered waits never block the host; the end-of-step wait gives up after strategy.timeout_s."""
    _check_silent_peer(run_world(2, _silent_peer, "nccl", 10.0, 25.0, timeout=180), 10.0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("strategy", TRAIN_STRATEGIES)
def test_train_py_bf16_on_gpu(train_jobs: dict, strategy: str) -> None:
    if _train_overrides(strategy, _world()) is None:
        pytest.skip(f"{strategy} needs an even D: two GPUs or more")
    res = train_jobs[strategy].result()
    assert res["status"] == "ok", res["reason"]
    losses = res["loss_history"]
    assert all(map(lambda x: x == x and abs(x) < 1e4, losses))
    assert losses[-1] < losses[0] - 0.1, losses  # bf16-mixed trains
    assert all(m > 0 for m in res["peak_memory_bytes"])  # CUDA max allocated, per rank
    assert res["samples_per_s"] > 0 and res["iteration_s"] > 0  # rank 0's windows, the device synchronised per window
