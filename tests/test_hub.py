"""Hub ids (``--model org/name``) against a real Hugging Face cache laid out on disk by the test, offline
(``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE`` / ``HF_HOME`` at the test's folder): the snapshot a run trains from, the
commit it records, a revision pin, a moved ``refs/main`` refused at resume, the one line for an absent id,
``grpolab download`` offline; and online against a hub on localhost (``tests/local_hub.py``: the real
``huggingface_hub`` client over HTTP): a run downloading its model with plain progress lines when piped,
``grpolab download`` bringing ``main`` up to date, the hub's answers as one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TASK, quick_config
from huggingface_hub import constants
from local_hub import LocalHub
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.commands.cli import main
from grpolab.config import ConfigError, load_config
from grpolab.models.hub import is_hub_id, resolve, snapshot_of
from grpolab.models.sources import FolderRequest, check_model_spec, resolve_model_dir
from grpolab.run.trainer import train
from grpolab.studies.suite.prepare import frozen_config

REPO = "tiny-org/tiny-model"
FIRST, SECOND = "1" * 40, "2b" * 20  # commits: one of digits only (reads as a TOML integer)
ROOT = Path(__file__).resolve().parents[1]


def cache_snapshot(cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """``source``'s files as the hub's cache holds them: content-addressed blobs, a snapshot folder of
    relative symlinks to them, and ``refs/NAME`` files holding ``commit``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    set_ref(cache, repo_id, commit, refs)
    return snapshot


def set_ref(cache: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",)) -> None:
    folder = cache / f"models--{repo_id.replace('/', '--')}" / "refs"
    folder.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (folder / ref).write_text(commit)


@pytest.fixture(scope="module")
def saved_model(warm_model_dir, tmp_path_factory) -> Path:
    """The warm-started tiny model and its tokenizer, as save_pretrained writes them."""
    folder = tmp_path_factory.mktemp("saved")
    AutoModelForCausalLM.from_pretrained(warm_model_dir).save_pretrained(folder)
    AutoTokenizer.from_pretrained(warm_model_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def module_cache(saved_model, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_snapshot(cache, REPO, FIRST, saved_model, refs=("main", "v1"))
    return cache


def offline(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """HF_HUB_CACHE at ``cache`` and HF_HUB_OFFLINE=1, for this process (huggingface_hub read both at import)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def hub_run(module_cache, tmp_path_factory) -> Path:
    """A 2-step run of ``--model tiny-org/tiny-model``, offline, from the cache alone."""
    run = tmp_path_factory.mktemp("hub_run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        offline(mp, module_cache)
        train(quick_config(REPO, run))
    return run


@pytest.fixture
def cache(module_cache, tmp_path, monkeypatch) -> Path:
    """A copy of the module's cache this test may change, offline."""
    copy = tmp_path / "hf" / "hub"
    shutil.copytree(module_cache, copy, symlinks=True)
    offline(monkeypatch, copy)
    return copy


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_a_run_by_hub_id_trains_from_the_cached_snapshot_and_records_its_commit(hub_run, module_cache):
    manifest = json.loads((hub_run / "manifest.json").read_text())
    snapshot = module_cache / "models--tiny-org--tiny-model" / "snapshots" / FIRST
    assert manifest["model"]["hub_id"] == REPO and manifest["model"]["revision"] == FIRST
    assert manifest["model"]["dir"] == str(snapshot)
    config = json.loads((hub_run / "config.json").read_text())
    assert config["model"]["path"] == REPO and config["model"]["revision"] is None  # the id as given
    assert (hub_run / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert (hub_run / "checkpoints" / "step_000002" / "tokenizer.json").is_file()  # the snapshot's tokenizer


def test_revisions_resolve_in_the_cache_a_pin_holds_when_main_moves(cache, saved_model, warm_model_dir):
    cache_snapshot(cache, REPO, SECOND, saved_model)  # refs/main moves to a second commit
    task = None  # a hub id needs no task
    assert resolve_model_dir(REPO, FolderRequest(task)) == cache / "models--tiny-org--tiny-model" / "snapshots" / SECOND
    for revision in (FIRST, "v1"):  # a commit, a tag
        folder = resolve_model_dir(REPO, FolderRequest(task, revision=revision))
        assert snapshot_of(folder) == (REPO, FIRST)
    assert resolve(REPO, FIRST).commit == FIRST and resolve(REPO).commit == SECOND
    with pytest.raises(FileNotFoundError, match=f"model {REPO} at revision v2 is not in the Hugging Face cache"):
        check_model_spec(REPO, "v2")


def test_a_moved_main_is_refused_at_resume_naming_both_commits_and_the_pin(
    hub_run, cache, saved_model, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(hub_run, run)
    cache_snapshot(cache, REPO, SECOND, saved_model)  # refs/main moved since the run started
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 2
    lines = error_lines(capsys.readouterr().out)
    assert lines == [
        f"error: model {REPO} (revision main) is now commit {SECOND}, but run {run} started from commit {FIRST} "
        f"(manifest.json); a resumed run keeps its model: grpolab train --resume {run} --model.revision {FIRST}"
    ]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing moved
    assert main(["train", "--resume", str(run), "--steps", "3", "--model.revision", SECOND]) == 2
    assert f"--model.revision {SECOND}: run {run} started from commit {FIRST}" in capsys.readouterr().out

    assert main(["train", "--resume", str(run), "--steps", "3", "--model.revision", FIRST]) == 0  # the pin
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumes"][-1]["changed"]["model"]["to"]["revision"] == FIRST
    assert json.loads((run / "config.json").read_text())["model"]["revision"] == FIRST  # kept for later resumes
    assert (run / "checkpoints" / "step_000003").is_dir()


def test_an_absent_id_offline_is_one_line_before_the_run_directory_exists(cache, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--model", "Qwen/Qwen3-0.6B", "--output_dir", str(run), "--task.n_train", "8"]
    assert main(args) == 2
    assert error_lines(capsys.readouterr().out) == [
        f"error: model Qwen/Qwen3-0.6B is not in the Hugging Face cache {cache} (HF_HUB_OFFLINE=1): run "
        "'grpolab download Qwen/Qwen3-0.6B' on a machine with network, or give a local folder"
    ]
    assert not run.exists()


def test_an_interrupted_download_is_named_offline(cache):
    tree_cache = pytest.importorskip(
        "huggingface_hub._tree_cache",
        reason="huggingface_hub 1.x keeps no file listing of a download: it reads an interrupted one as whole",
    )
    entry = tree_cache.TreeCacheEntry
    listing = {"config.json": entry(size=1, blob_id="a"), "model.safetensors": entry(1, "b")}
    repo = cache / "models--tiny-org--partial"
    (repo / "snapshots" / FIRST).mkdir(parents=True)
    (repo / "snapshots" / FIRST / "config.json").write_text("{}")
    set_ref(cache, "tiny-org/partial", FIRST)
    tree_cache.write_tree_cache(str(repo), FIRST, listing)  # the listing a download writes before its files
    with pytest.raises(FileNotFoundError, match="is only partly in the Hugging Face cache .* to complete it"):
        check_model_spec("tiny-org/partial")


def test_a_string_is_a_local_folder_when_it_exists_else_a_hub_id_of_the_form_org_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("allenai/OLMo-2-0425-1B")
    for spec in ("gpt2", "./org/name", "/abs/org/name", "a/b/c", "org--x/name", "org/na..me", "gguf:x/y"):
        assert not is_hub_id(spec), spec
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert not is_hub_id("Qwen/Qwen3-0.6B")  # an existing local path wins
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_spec("Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="model.revision main applies to a Hugging Face hub id .* a local folder"):
        check_model_spec("Qwen/Qwen3-0.6B", "main")
    with pytest.raises(ConfigError, match="model.revision applies to a Hugging Face hub id"):
        load_config(None, {"model.path": "like:qwen3-0.6b", "model.revision": "main"})


def test_a_suite_pins_the_commit_its_hub_id_names_when_prepared(cache, tmp_path):
    cfg = quick_config(REPO, tmp_path / "run")
    frozen = frozen_config(cfg, {"task_paths": {}}, None)
    assert (frozen.model.path, frozen.model.revision) == (REPO, FIRST)


def test_download_offline_prints_the_cached_commit_and_folder_and_one_line_for_an_absent_id(module_cache, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(module_cache, home / "hub", symlinks=True)  # HF_HOME/hub is the cache
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    cache_snapshot(home / "hub", "tiny-org/rows", SECOND, data)
    (home / "hub" / "models--tiny-org--rows").rename(home / "hub" / "datasets--tiny-org--rows")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)

    def download(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "grpolab", "download", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    done = download(REPO)
    folder = home / "hub" / "models--tiny-org--tiny-model" / "snapshots" / FIRST
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == f"download: model {REPO} (main) commit {FIRST} -> {folder}".split()
    rows = download("tiny-org/rows", "--dataset")
    assert rows.returncode == 0 and f"commit {SECOND}" in rows.stdout and "data files: train.jsonl" in rows.stdout
    absent = download(REPO, "tiny-org/absent")
    assert absent.returncode == 2
    assert error_lines(absent.stdout) == [
        f"error: model tiny-org/absent is not in the Hugging Face cache {home / 'hub'} (HF_HUB_OFFLINE=1): "
        "run 'grpolab download tiny-org/absent' on a machine with network"
    ]
    assert f"commit {FIRST}" in absent.stdout  # the cached one still answered


def test_online_a_cached_id_needs_no_hub_and_an_absent_one_says_the_hub_cannot_be_reached(
    module_cache, monkeypatch, tmp_path
):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(module_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the network is down
    assert resolve(REPO).commit == FIRST
    check_model_spec("tiny-org/absent")  # online, a missing id is left to the download
    with pytest.raises(
        FileNotFoundError, match="tiny-org/absent is not in the Hugging Face cache .* cannot be reached"
    ):
        resolve("tiny-org/absent")


def test_a_download_shows_hugging_face_bars_on_a_terminal_and_plain_lines_when_piped():
    from io import StringIO

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from rich.console import Console

    from grpolab.common.progress import Reporter
    from grpolab.models.hub import _progress

    disable_progress_bars()  # as the train command leaves them (transformers' switch turns the hub's off too)
    piped, terminal = StringIO(), StringIO()
    with _progress(Reporter(Console(file=piped, force_terminal=False)), "download model a/b"):
        assert are_progress_bars_disabled()  # no bars in a log file
    assert "download model a/b: done" in piped.getvalue()
    with _progress(Reporter(Console(file=terminal, force_terminal=True)), "download model a/b"):
        assert not are_progress_bars_disabled() or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    assert terminal.getvalue().strip() == "download model a/b" and are_progress_bars_disabled()  # restored


def test_a_suite_dry_run_counts_a_cached_hub_models_checkpoints(cache, tmp_path):
    from grpolab.studies.suite.footprint import parameter_count

    cfg = quick_config(REPO, tmp_path / "run")
    assert (
        parameter_count(cfg, {"run": cfg})
        == AutoModelForCausalLM.from_pretrained(
            cache / "models--tiny-org--tiny-model" / "snapshots" / FIRST
        ).num_parameters()
    )
    absent = quick_config("tiny-org/absent", tmp_path / "run2")
    assert parameter_count(absent, {"run": absent}) is None


@pytest.fixture
def local_hub(saved_model):
    hub = LocalHub()
    hub.add(REPO, FIRST, saved_model)
    yield hub
    hub.close()


def online(monkeypatch: pytest.MonkeyPatch, cache: Path, hub: LocalHub) -> None:
    """Downloads allowed, from ``hub``, into ``cache`` (huggingface_hub read these settings at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")


def test_online_a_run_downloads_a_missing_id_with_plain_lines_when_piped(local_hub, tmp_path, monkeypatch, capfd):
    cache = tmp_path / "hub"
    online(monkeypatch, cache, local_hub)
    run = tmp_path / "run"
    args = ["train", "--model", REPO, "--output_dir", str(run), "--steps", "1", "--eval.every", "1"]
    assert main([*args, "--checkpoint.every", "1", *[f"--task.{k}={v}" for k, v in TASK.items()]]) == 0
    out = capfd.readouterr()
    assert f"download model {REPO}: done" in out.out  # the reporter's phase: a log gets lines
    assert "it/s]" not in out.out + out.err and "B/s]" not in out.out + out.err  # and no tqdm bars
    assert (cache / "models--tiny-org--tiny-model" / "refs" / "main").read_text() == FIRST
    assert json.loads((run / "manifest.json").read_text())["model"]["revision"] == FIRST
    requests = len(local_hub.requests)
    assert resolve(REPO).commit == FIRST and len(local_hub.requests) == requests  # then the cache alone answers


def test_download_brings_main_up_to_date_and_the_hubs_answers_are_one_line(local_hub, saved_model, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": local_hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_OFFLINE", None)

    def download(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "grpolab", "download", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    folder = tmp_path / "hub" / "models--tiny-org--tiny-model" / "snapshots"
    first = download(REPO)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"download: model {REPO} (main) commit {FIRST} -> {folder / FIRST}" in " ".join(first.stdout.split())
    local_hub.add(REPO, SECOND, saved_model)  # main moves on the hub
    again = download(REPO)
    assert f"commit {SECOND} -> {folder / SECOND}" in " ".join(again.stdout.split())
    assert (tmp_path / "hub" / "models--tiny-org--tiny-model" / "refs" / "main").read_text() == SECOND
    bad = download("tiny-org/absent", REPO, "--revision", "v9")
    assert bad.returncode == 2
    assert error_lines(" ".join(bad.stdout.split()).replace(" error:", "\nerror:")) == [
        "error: model tiny-org/absent at revision v9: no such repository on the Hugging Face hub (a private or "
        "gated one needs 'hf auth login' and its terms accepted on its page)",
        f"error: model {REPO} at revision v9: the hub has no such revision (a branch, a tag or a 40-character commit)",
    ]


def test_a_suite_run_started_from_another_runs_checkpoint_drops_the_hub_revision(tmp_path):
    from grpolab.studies.suite.spec import SuiteSpec, resolve_runs

    spec = SuiteSpec.model_validate(
        {
            "base": {"model": {"path": REPO, "revision": "v1"}, "task": TASK, "steps": 2},
            "runs": [{"name": "a", "algo": "grpo"}, {"name": "b", "algo": "grpo", "init_from": "a"}],
        }
    )
    configs = resolve_runs(spec, tmp_path)
    assert (configs["a"].model.path, configs["a"].model.revision) == (REPO, "v1")
    assert configs["b"].model.path.startswith(str(tmp_path / "runs" / "a")) and configs["b"].model.revision is None
