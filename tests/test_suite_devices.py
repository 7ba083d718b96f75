"""A suite spread over devices: runs on disjoint device sets, two at a time, one of them a 2-process
torchrun job (gloo on CPU; ``CUDA_VISIBLE_DEVICES`` is the stand-in placement each run records). The
numbers must equal the same suite run one at a time, through a fail-stop and a runner killed outright.

Each claim is tested twice: with fake runs (tests/fake_trainer.py: the scheduler's placement, stops and
resumes in seconds; default tier) and with real ``grpolab train`` runs and a real torchrun job (slow tier)."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
from suite_runs import (
    assert_same_runs,
    cli_process,
    forked_runner,
    tiny_base,
    toml_runs,
    trainers_of,
    wait_for_steps,
    write_hook,
    write_suite,
)
from test_suite import INJECT, ROOT

from grpolab.commands.cli import main
from grpolab.studies.manifest import SuiteManifest

pytest_plugins = ["suite_fixtures"]  # the fake trainer

NAMES = ("a", "b", "c", "d")


def slow(runs: tuple[str, ...], seconds: float) -> str:
    """A hook that sleeps ``seconds`` before each checkpoint of ``runs`` (so that they overlap, outlive a
    runner killed after their first step, or are still training when another run fails)."""
    return f"""
import time
import grpolab.run.checkpoints as checkpoints
_save = checkpoints.save_checkpoint
def save_checkpoint(model, tokenizer, run_dir, step, *args, **kwargs):
    if str(run_dir).endswith({tuple("/" + run for run in runs)!r}):
        time.sleep({seconds})
    return _save(model, tokenizer, run_dir, step, *args, **kwargs)
checkpoints.save_checkpoint = save_checkpoint
"""


NAN_IN_B = 'import sys\nif any(arg.endswith(("/b.json", "/b")) for arg in sys.argv):\n' + textwrap.indent(
    INJECT["loss"], "    "
)


def four_run_suite(tmp_path: Path, model_dir: Path) -> Path:
    """a and b (one device each), c (two devices: torchrun), d (from a's final checkpoint)."""
    runs = toml_runs(
        {"name": "a", "algo": "grpo"},
        {"name": "b", "algo": "dr_grpo", "seed": 1},
        {"name": "c", "algo": "grpo", "seed": 2, "devices_per_run": 2},
        {"name": "d", "algo": "dr_grpo", "init_from": "a"},
    )
    return write_suite(tmp_path, "tiny", tiny_base(model_dir), runs)


def hook(tmp_path: Path, monkeypatch, code: str) -> None:
    """``code`` runs at the start of every run process (a sitecustomize module on PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", str(write_hook(tmp_path, code)))


def sessions_where(root: Path, name: str) -> list[dict]:
    return [s["where"] for s in json.loads((root / "runs" / name / "manifest.json").read_text())["sessions"]]


def run_on_two_devices(tmp_path: Path, model_dir: Path, root: Path) -> int:
    """``grpolab suite run`` of the four-run suite into ``root`` on devices 0 and 1: its exit code."""
    spec = four_run_suite(tmp_path, model_dir)
    return main(["suite", "run", str(spec), "--output-root", str(root), "--devices", "0,1"])


def assert_two_at_a_time_with_the_numbers_of_one_at_a_time(root: Path, one_at_a_time: Path, capsys) -> None:
    """The suite in ``root``, run on devices 0 and 1: a and b at once on a device each, c on both after them
    (torchrun, 2 processes), d on device 0, each placement recorded; every number ``one_at_a_time``'s."""
    assert_same_runs(root, one_at_a_time, NAMES)
    manifest = SuiteManifest.load(root)
    a, b, c, d = manifest.runs
    assert manifest.placement == {"launcher": "local", "devices": ["0", "1"], "slurm": None}
    assert [r.devices for r in (a, b, c, d)] == [["0"], ["1"], ["0", "1"], ["0"]]
    assert [r.world_size for r in (a, b, c, d)] == [1, 1, 2, 1] and c.command[2] == "torch.distributed.run"
    assert a.started <= b.started < a.ended <= c.started and b.ended <= c.started  # a and b at once; c on both
    assert sessions_where(root, "a")[0]["devices"] == "0" and sessions_where(root, "b")[0]["devices"] == "1"
    assert sessions_where(root, "c") == [{**sessions_where(root, "c")[0], "devices": "0,1", "world_size": 2}]
    sequential = SuiteManifest.load(one_at_a_time)
    assert all(r.devices is None for r in sequential.runs) and sequential.runs[2].world_size == 2
    assert sessions_where(one_at_a_time, "a")[0]["devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert main(["suite", "status", str(root)]) == 0
    assert "devices 0,1 (2 processes)" in capsys.readouterr().out


def assert_b_failed_and_stopped_a_resumably(root: Path, capsys) -> None:
    """The suite in ``root``, whose run b failed (a non-finite loss) while a trained beside it: a stopped,
    resumable from its first checkpoint, c and d still queued, the suite stopped at b."""
    out = capsys.readouterr().out
    a, b, c, d = SuiteManifest.load(root).runs
    assert (a.state, b.state, c.state, d.state) == ("stopped", "failed", "queued", "queued")
    assert "non-finite loss" in b.reason and a.reason.startswith("stopped because run b failed: ")
    assert "resumable from its newest checkpoint step_00000" in a.reason
    assert "suite stopped at run b (failed)" in out


def resume_on_devices_1_0_finishes_exactly(root: Path, one_at_a_time: Path) -> None:
    """``suite resume`` of ``root`` on devices 1 and 0: a resumed from its stop, c on both devices in their new
    order, every number ``one_at_a_time``'s."""
    assert main(["suite", "resume", str(root), "--devices", "1,0"]) == 0
    assert_same_runs(root, one_at_a_time, NAMES)
    resumed = SuiteManifest.load(root).runs
    assert resumed[0].attempts[-1]["state"] == "stopped" and resumed[0].command[-2] == "--resume"
    assert resumed[2].devices == ["1", "0"]


@pytest.fixture(scope="module")
def one_at_a_time(warm_model_dir, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sequential")
    assert main(["suite", "run", str(four_run_suite(tmp, warm_model_dir)), "--output-root", str(tmp / "out")]) == 0
    return tmp / "out"


@pytest.mark.slow  # default tier: the same claim with fake runs below
def test_two_at_a_time_on_devices_gives_the_numbers_of_one_at_a_time(
    one_at_a_time, warm_model_dir, tmp_path, monkeypatch, capsys
):
    hook(tmp_path, monkeypatch, slow(("a", "b"), 1.5))
    monkeypatch.setenv("COLUMNS", "250")  # status tables on one line a row
    root = tmp_path / "out"
    assert run_on_two_devices(tmp_path, warm_model_dir, root) == 0
    assert_two_at_a_time_with_the_numbers_of_one_at_a_time(root, one_at_a_time, capsys)


@pytest.mark.slow  # default tier: the same claim with fake runs below
def test_a_failing_run_stops_the_one_beside_it_resumably_and_resume_finishes_both_exactly(
    one_at_a_time, warm_model_dir, tmp_path, monkeypatch, capsys
):
    hook(tmp_path, monkeypatch, slow(("a",), 4) + NAN_IN_B)
    root = tmp_path / "out"
    assert run_on_two_devices(tmp_path, warm_model_dir, root) == 1
    assert_b_failed_and_stopped_a_resumably(root, capsys)
    monkeypatch.delenv("PYTHONPATH")
    resume_on_devices_1_0_finishes_exactly(root, one_at_a_time)


def resume_waits_for_the_orphans_and_never_starts_a_run_twice(root: Path, one_at_a_time: Path) -> None:
    """``suite resume`` of ``root``, whose killed runner left runs a and b training (one process each): sampled
    all along, never a second trainer; both waited for, c and d placed, every number ``one_at_a_time``'s."""
    orphans = {name: trainers_of(root, name) for name in ("a", "b")}
    assert all(len(pids) == 1 for pids in orphans.values()), orphans
    samples: list[dict[str, set[int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append({name: trainers_of(root, name) for name in ("a", "b")})
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        assert main(["suite", "resume", str(root)]) == 0
    finally:
        stop.set()
        sampler.join()
        for pids in orphans.values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert samples and all(s[name] <= orphans[name] for s in samples for name in s)  # never a second trainer
    a, b, c, d = SuiteManifest.load(root).runs
    assert [w["pid"] for w in a.waits] == list(orphans["a"]) and [w["pid"] for w in b.waits] == list(orphans["b"])
    assert not a.attempts and not b.attempts and [r.devices for r in (c, d)] == [["0", "1"], ["0"]]
    assert_same_runs(root, one_at_a_time, NAMES)


@pytest.mark.slow  # default tier: the same claim with fake runs below
def test_a_runner_killed_outright_then_resumed_never_starts_a_run_twice_and_finishes_exactly(
    one_at_a_time, warm_model_dir, tmp_path, monkeypatch
):
    """SIGKILL to the runner alone: its runs (in their own sessions) train on; resume at once waits for
    both on their devices, then runs c and d, and every number equals the one-at-a-time suite's."""
    hook(tmp_path, monkeypatch, slow(("a", "b"), 1.5))
    root = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]])}
    spec = four_run_suite(tmp_path, warm_model_dir)
    proc = cli_process("suite", "run", str(spec), "--output-root", str(root), "--devices", "0,1", env=env)
    wait_for_steps([root / "runs" / n for n in ("a", "b")], 1, lambda: proc.poll() is None, seconds=300, interval=0.05)
    proc.kill()
    proc.wait()
    resume_waits_for_the_orphans_and_never_starts_a_run_twice(root, one_at_a_time)


# ---- the same claims with fake runs: the scheduler alone, in seconds -----------------------------------
@pytest.fixture(scope="module")
def fake_one_at_a_time(warm_model_dir, fake_hook, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fake_sequential")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(fake_hook))
        for setting in ("GRPOLAB_FAKE_SLOW", "GRPOLAB_FAKE_FAIL", "GRPOLAB_FAKE_STEP_SECONDS"):
            patch.delenv(setting, raising=False)
        assert main(["suite", "run", str(four_run_suite(tmp, warm_model_dir)), "--output-root", str(tmp / "out")]) == 0
    return tmp / "out"


def test_two_at_a_time_on_devices_gives_the_numbers_of_one_at_a_time_with_fake_runs(
    fake_one_at_a_time, fake_runs, warm_model_dir, tmp_path, monkeypatch, capsys
):
    fake_runs.use(slow={"a": 0.7, "b": 0.7})  # a and b overlap by more than a second (the manifest's resolution)
    monkeypatch.setenv("COLUMNS", "250")
    root = tmp_path / "out"
    assert run_on_two_devices(tmp_path, warm_model_dir, root) == 0
    assert_two_at_a_time_with_the_numbers_of_one_at_a_time(root, fake_one_at_a_time, capsys)


def test_a_failing_run_stops_the_one_beside_it_resumably_and_resume_finishes_both_exactly_with_fake_runs(
    fake_one_at_a_time, fake_runs, warm_model_dir, tmp_path, capsys
):
    fake_runs.use(slow={"a": 1.5, "b": 0.3}, fail={"b": 2})  # b fails while a is in its first step
    root = tmp_path / "out"
    assert run_on_two_devices(tmp_path, warm_model_dir, root) == 1
    assert_b_failed_and_stopped_a_resumably(root, capsys)
    fake_runs.use()
    resume_on_devices_1_0_finishes_exactly(root, fake_one_at_a_time)


def test_a_runner_killed_outright_then_resumed_never_starts_a_run_twice_and_finishes_exactly_with_fake_runs(
    fake_one_at_a_time, fake_runs, warm_model_dir, tmp_path
):
    """SIGKILL to the runner alone: its runs (in their own sessions) train on; resume at once waits for
    both on their devices, then runs c and d, and every number equals the one-at-a-time suite's."""
    fake_runs.use(slow={"a": 0.5, "b": 0.5})
    root = tmp_path / "out"
    runner = forked_runner(
        "run", str(four_run_suite(tmp_path, warm_model_dir)), "--output-root", str(root), "--devices", "0,1"
    )
    wait_for_steps([root / "runs" / n for n in ("a", "b")], 1, runner.is_alive)
    runner.kill()
    runner.join()
    resume_waits_for_the_orphans_and_never_starts_a_run_twice(root, fake_one_at_a_time)
