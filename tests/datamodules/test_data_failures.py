"""Data failures named at their cause: refused before launch (no such file, offline with an empty cache,
no answer from the hub), or, when a rank fails after launch, the job's last line is that rank's first
exception (not Lightning's teardown on meta layers, nor a heartbeat of a peer waiting on it). The
data is prepared once by the launcher, so the ranks only read the cache. No network is used: the
"no network" case points the hub at a closed local port."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_recipes.core.failures import describe_exception, first_exception
from pipeline_recipes.recipe.launch.main import launch_workers
from pipeline_recipes.recipe.check.settings import resolve_layout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_data import write_corpus  # noqa: E402

FAST_S = 120  # a guard against hanging: what made the old failures slow (hub retries, workers) is asserted absent


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE") and not k.startswith("HF_")}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
            "PYTHONUNBUFFERED": "1", **extra}


def _train(tmp_path: Path, *overrides: str, env: dict[str, str], timeout: int = FAST_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", "logger=none",
           "trainer.max_steps=2", *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def _refused_before_launch(tmp_path: Path, result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert not (tmp_path / "run" / "logs").exists()  # no worker started
    assert "Traceback" not in result.stderr
    return _last_line(result)


@pytest.mark.slow
def test_a_missing_data_file_is_refused_before_launch(tmp_path: Path) -> None:
    result = _train(tmp_path, "data=text", "data.data_files=nosuch.txt", f"data.cache_dir={tmp_path / 'cache'}",
                    env=_env(tmp_path))
    last = _refused_before_launch(tmp_path, result)
    assert last.startswith("error: data.data_files=nosuch.txt: FileNotFoundError"), last
    assert repr(str(tmp_path / "nosuch.txt")) in last and "data=synthetic" in last


@pytest.mark.slow
def test_offline_with_an_empty_cache_is_refused_before_launch(tmp_path: Path) -> None:
    result = _train(tmp_path, "data=wikitext2", "data.offline=true", f"data.cache_dir={tmp_path / 'cache'}",
                    env=_env(tmp_path))
    last = _refused_before_launch(tmp_path, result)
    assert last.startswith("error: data=wikitext2: dataset 'Salesforce/wikitext' (wikitext-2-raw-v1) is not in the "
                           f"local cache {tmp_path / 'cache' / 'datasets'}"), last
    assert "offline mode (data.offline=true" in last
    assert "Fixes: run once with network" in last and "data.data_files=" in last and "data=synthetic" in last


@pytest.mark.slow
def test_no_answer_from_the_hub_is_refused_before_launch(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    result = _train(tmp_path, "data=wikitext2", f"data.cache_dir={tmp_path / 'cache'}",
                    env=_env(tmp_path, HF_ENDPOINT=endpoint))
    last = _refused_before_launch(tmp_path, result)
    assert last.startswith(f"error: data=wikitext2: couldn't reach the Hugging Face Hub ({endpoint}) for dataset "
                           "'Salesforce/wikitext': ConnectError"), last
    assert "Retry" not in result.stdout + result.stderr  # one look-up, no retries
    assert "Fixes: run once with network" in last and "data=synthetic" in last


@pytest.mark.slow
def test_a_hub_tokenizer_without_an_answer_is_refused_before_launch(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    corpus = write_corpus(tmp_path / "corpus.txt", docs=5)
    result = _train(tmp_path, "data=text", f"data.data_files={corpus}", "data.tokenizer=gpt2",
                    f"data.cache_dir={tmp_path / 'cache'}", env=_env(tmp_path, HF_ENDPOINT=endpoint))
    last = _refused_before_launch(tmp_path, result)
    assert last.startswith(f"error: data.tokenizer=gpt2: couldn't reach the Hugging Face Hub ({endpoint}): "
                           "ConnectError"), last
    assert "Retry" not in result.stdout + result.stderr and "data.tokenizer=null" in last


FAILING_DATA = '''
import os

from pipeline_recipes.datamodules import build_datamodule


def build(**kwargs):
    """The synthetic datamodule, except that rank 1 cannot read its data (before any layer exists)."""
    data = build_datamodule(**kwargs)
    if os.environ["RANK"] == "1":
        def setup(stage=None):
            raise FileNotFoundError("simulated: rank 1 cannot read corpus.txt")
        data.setup = setup
    return data
'''


@pytest.mark.slow
def test_a_rank_that_raises_after_launch_is_named_by_its_first_exception(tmp_path: Path) -> None:
    (tmp_path / "failing_data.py").write_text(FAILING_DATA)
    env = _env(tmp_path, HF_HUB_OFFLINE="1", PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    result = _train(tmp_path, "strategy=gpipe", "trainer.devices=2", "data.global_batch_size=4",
                    "data._target_=failing_data.build", env=env, timeout=120)
    cause = f"rank 1 ({socket.gethostname()}) raised FileNotFoundError: simulated: rank 1 cannot read corpus.txt"
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert _last_line(result) == f"error: job failed: {cause}", result.stderr[-3000:]
    reason = json.loads((tmp_path / "run" / "results.json").read_text())["reason"]
    assert reason == cause
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("rank*.log"))
    assert "simulated: rank 1 cannot read corpus.txt" in logs
    assert "Cannot copy out of meta tensor" not in logs  # the teardown leaves the meta layers alone


def test_the_first_exception_is_the_one_a_teardown_interrupted() -> None:
    try:
        try:
            raise FileNotFoundError("nosuch.txt")
        except FileNotFoundError:
            raise NotImplementedError("Cannot copy out of meta tensor; no data!")  # noqa: B904 - as a teardown
    except NotImplementedError as err:
        teardown = err
    assert describe_exception(teardown) == "FileNotFoundError: nosuch.txt"
    try:
        try:
            raise KeyError("row")
        except KeyError as inner:
            raise ValueError("column 'text' not in the file") from inner
    except ValueError as err:
        chosen = err
    assert first_exception(chosen) is chosen  # an explicit cause keeps the message its author chose


PEER_WORKER = '''
import os, sys, time
from pipeline_recipes.core.failures import HEARTBEAT_ENV, error_path, record_error
from pipeline_recipes.recipe.worker.heartbeat import start_heartbeat

start_heartbeat(os.environ[HEARTBEAT_ENV], interval_s=0.2)
rank = os.environ["RANK"]
first = error_path(os.environ[HEARTBEAT_ENV]).with_name("rank1.error")
try:
    if rank == "1":
        raise ConnectionError("simulated: the hub did not answer")
    while not first.exists():  # rank 0 waits on rank 1, then fails because of it
        time.sleep(0.05)
    time.sleep(0.2)
    raise RuntimeError("simulated: connection closed by peer")
except Exception as err:
    record_error(error_path(os.environ[HEARTBEAT_ENV]), err)
    sys.exit(1)
'''


def test_the_launcher_names_the_first_rank_that_raised(tmp_path: Path) -> None:
    """Rank 1 raises; rank 0, waiting on it, raises later: the job's reason is rank 1's exception."""
    (tmp_path / "peer_worker.py").write_text(PEER_WORKER)
    layout = resolve_layout({"name": "gpipe", "D": 2, "micro_batch_size": 1}, {"devices": 2}, 8, num_layers=6)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}:{old}"
    try:
        outcome = launch_workers(tmp_path / "job.yaml", layout.world_size, 2, tmp_path / "logs", module="peer_worker",
                                 grace_s=5.0, hang_s=30.0)
    finally:
        os.environ["PYTHONPATH"] = old
    assert not outcome.ok
    assert outcome.reason == f"rank 1 ({socket.gethostname()}) raised ConnectionError: simulated: the hub did not answer"


def test_the_launcher_prepares_the_data_the_ranks_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After :func:`prepare_data` (the launcher, with the job's ``cfg.data``), the datamodule of a rank
    builds from the cache alone: loading the text again would fail."""
    from hydra.utils import instantiate

    from pipeline_recipes.datamodules import factory
    from pipeline_recipes.datamodules.prepare import prepare_data

    corpus = write_corpus(tmp_path / "corpus.txt", docs=20)
    data = {"_target_": "pipeline_recipes.datamodules.build_datamodule", "name": "text", "family": "gpt2",
            "seq_len": 16, "vocab_size": 320, "global_batch_size": 4, "seed": 3, "num_samples": None,
            "num_workers": 0, "pin_memory": False, "data_files": str(corpus), "text_column": "text",
            "rows_are": "lines", "val_fraction": 0.1, "mlm_probability": 0.15, "streaming": False, "max_rows": None,
            "cache_dir": str(tmp_path / "cache"), "tokenizer": None, "offline": False, "num_proc": None,
            "prepare_timeout_s": 60}
    prepare_data(data)

    def not_again(**kwargs: object) -> None:
        raise AssertionError("a rank loaded the text again")

    monkeypatch.setattr(factory, "load_text_dataset", not_again)
    module = instantiate(data, batch_size=4)
    module.setup("fit")
    assert len(module.train_set) > 0 and module.val_set is not None


def _text_data(tmp_path: Path, corpus: Path, **overrides: object) -> dict[str, object]:
    """``cfg.data`` of ``data=text`` (resolved), as the launcher passes it to :func:`prepare_data`."""
    return {"_target_": "pipeline_recipes.datamodules.build_datamodule", "name": "text", "family": "gpt2",
            "seq_len": 16, "vocab_size": 320, "global_batch_size": 4, "seed": 3, "num_samples": None,
            "num_workers": 0, "pin_memory": False, "data_files": str(corpus), "text_column": "text",
            "rows_are": "lines", "val_fraction": 0.1, "mlm_probability": 0.15, "streaming": False, "max_rows": None,
            "cache_dir": str(tmp_path / "cache"), "tokenizer": None, "offline": False, "num_proc": None,
            "prepare_timeout_s": 60, **overrides}


def test_a_missing_local_tokenizer_directory_is_not_a_hub_failure(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``data.tokenizer=/missing/dir`` is a mistyped path: named as missing, the hub never asked."""
    from pipeline_recipes.datamodules import tokenizer
    from pipeline_recipes.core.errors import DataError

    def no_lookup(*args: object, **kwargs: object) -> None:
        raise AssertionError("a local path was looked up on the hub")

    monkeypatch.setattr(tokenizer, "hub_unreachable", no_lookup)
    missing = tmp_path / "missing" / "dir"
    for name in (str(missing), "./tok_dir", "~/no/such/tokenizer", "tokenizer.json"):
        with pytest.raises(DataError) as raised:
            tokenizer.load_tokenizer(name, "gpt2")
        message = str(raised.value)
        assert message.startswith(f"data.tokenizer={name}: FileNotFoundError: no such directory or file"), message
        assert "couldn't reach" not in message and "data.tokenizer=null" in message
        if name == str(missing):
            assert repr(str(missing)) in message
    assert tokenizer.is_hub_id("gpt2") and tokenizer.is_hub_id("openai-community/gpt2")
    assert not any(tokenizer.is_hub_id(p) for p in (str(missing), "./tok", "~/tok", "a/b/c", "https://x/y"))


def test_an_unknown_data_option_is_a_config_error(tmp_path: Path) -> None:
    from pipeline_recipes.datamodules.prepare import check_data, prepare_data
    from pipeline_recipes.recipe.check.settings import ConfigError

    corpus = write_corpus(tmp_path / "corpus.txt", docs=5)
    for check in (check_data, prepare_data):
        with pytest.raises(ConfigError, match=r"^data.text_colum=x: data=text has no option 'text_colum' \(did you "
                                              r"mean data.text_column\?\).*~data.text_colum"):
            check(_text_data(tmp_path, corpus, text_colum="x"))
    assert not (tmp_path / "cache").exists()  # refused before anything was built


def test_data_source_failures_name_their_fix_and_bugs_keep_their_type(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline_recipes.datamodules import factory
    from pipeline_recipes.core.errors import DataError
    from pipeline_recipes.datamodules.prepare import prepare_data

    corpus = write_corpus(tmp_path / "corpus.txt", docs=5)
    with pytest.raises(DataError, match=r"^data.text_column=article: column 'article' not in the data's columns "
                                        r"\['text'\]. Fixes: data.text_column=text"):
        prepare_data(_text_data(tmp_path, corpus, text_column="article"))

    def fails(error: BaseException):  # noqa: ANN202
        @functools.wraps(factory.build_source)  # the same options
        def build_source(name: str, **kwargs: object) -> None:
            raise error
        return build_source

    monkeypatch.setattr(factory, "build_source", fails(FileNotFoundError(2, "No such file", "gone.txt")))
    with pytest.raises(DataError, match=r"^data=text: FileNotFoundError: .*gone.txt.*Fixes: data.data_files=.*"
                                        r"data=synthetic"):
        prepare_data(_text_data(tmp_path, corpus))
    monkeypatch.setattr(factory, "build_source", fails(ConnectionError("no route to host")))
    with pytest.raises(DataError, match=r"^data=text: ConnectionError: no route to host. Fixes: run once with network"):
        prepare_data(_text_data(tmp_path, corpus))
    for bug in (ValueError("a bug"), TypeError("build_source() got an unexpected keyword argument 'x'"),
                KeyError("row")):
        monkeypatch.setattr(factory, "build_source", fails(bug))
        with pytest.raises(type(bug)) as raised:
            prepare_data(_text_data(tmp_path, corpus))
        assert not isinstance(raised.value, DataError)


def test_a_local_copy_without_the_validation_split_names_the_split_settings(tmp_path: Path) -> None:
    from pipeline_recipes.core.errors import DataError
    from pipeline_recipes.datamodules.prepare import prepare_data

    corpus = write_corpus(tmp_path / "corpus.txt", docs=8)
    data = _text_data(tmp_path, corpus, name="wikitext2", path="Salesforce/wikitext", hf_name="wikitext-2-raw-v1",
                      split="train", val_split="validation", val_fraction=None)
    del data["val_fraction"]
    with pytest.raises(DataError, match=r"^split 'validation' \(data.split / data.val_split\) is not in the data, "
                                        r"whose splits are \['train'\].*data.val_split=null"):
        prepare_data(data)


@pytest.mark.slow
def test_a_refused_layout_does_not_import_the_data_modules_or_torch(tmp_path: Path) -> None:
    """The launcher's error handler needs no data import: a layout error stays a fraction of a second."""
    cmd = [sys.executable, "-X", "importtime", str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}",
           "logger=none", "trainer=cpu", "strategy.D=3"]
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=FAST_S)
    assert result.returncode == 2, result.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported and not any(m.startswith("pipeline_recipes.datamodules") for m in imported)
    assert any(line.startswith("error: strategy.D = 3") for line in result.stderr.splitlines())
