"""Helpers of the suite tests: the tiny two-run suite file, runners in processes of their own, code run at the
start of every run process, and the checks that a suite's runs equal a reference's."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import TASK, untimed

from grpolab.commands.cli import main
from grpolab.run.rundir import read_metrics
from grpolab.studies.manifest import SuiteManifest


def write_suite(tmp_path: Path, name: str, base: str, runs: str) -> Path:
    """``tmp_path/suite.toml``: suite ``name``, its [base] tables ``base`` and its [[runs]] tables ``runs`` (TOML)."""
    path = tmp_path / "suite.toml"
    path.write_text(f'\n[suite]\nname = "{name}"\n{base}{runs}')
    return path


def toml_runs(*runs: dict) -> str:
    """The [[runs]] tables of a suite file, one a dict of a run's fields (a dict value is an inline table)."""

    def value(v) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)  # a TOML string, number or boolean

    return "".join("[[runs]]\n" + "".join(f"{k} = {value(v)}\n" for k, v in run.items()) for run in runs)


def tiny_base(model_dir: Path) -> str:
    """The [base] tables of the tiny suite: 3-step runs of the model in ``model_dir`` on TASK, a checkpoint a
    step, one validation at the end."""
    task = "\n".join(f"{k} = {v}" for k, v in TASK.items())
    return f"""[base]
steps = 3
threads = 1
reference = "frozen"
[base.model]
path = "{model_dir}"
[base.task]
{task}
[base.rollout]
prompts_per_step = 4
max_new_tokens = 40
[base.optim]
micro_batch_size = 16
lr = 1e-3
[base.eval]
every = 3
[base.checkpoint]
every = 1
"""


def suite_file(tmp_path: Path, model_dir: Path, first_overrides: str = "") -> Path:
    """Two 3-step runs: a (GRPO; ``first_overrides``, TOML, among its fields), then b (Dr. GRPO, seed 1)
    warm-started from a's final checkpoint."""
    a = toml_runs({"name": "a", "algo": "grpo"}) + first_overrides + "\n"
    b = toml_runs({"name": "b", "algo": "dr_grpo", "seed": 1, "init_from": "a", "factors": {"start": "warm"}})
    return write_suite(tmp_path, "tiny", tiny_base(model_dir), a + b)


def one_run_suite(tmp_path: Path, model_dir: Path) -> Path:
    """The tiny suite with run a alone."""
    path = suite_file(tmp_path, model_dir)
    text = path.read_text()
    path.write_text(text[: text.index("[[runs]]", text.index("[[runs]]") + 1)])
    return path


def _runner_main(args: list[str], log: str) -> None:
    out = open(log, "w", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out  # not pytest's capture, which this copy of the process would keep to itself
    code = main(args)
    out.flush()
    os._exit(code)


def forked_runner(*args: str, log: Path | None = None) -> multiprocessing.Process:
    """``grpolab suite ARGS`` in a forked copy of this process (its imports done: started at once), the
    runner that a test kills or signals; its output to ``log``; its runs inherit this process's environment
    (PYTHONPATH: the fake trainer)."""
    runner = multiprocessing.get_context("fork").Process(
        target=_runner_main, args=(["suite", *args], str(log or os.devnull))
    )
    runner.start()
    return runner


def cli_process(*args: str, env: dict | None = None, stdout=subprocess.DEVNULL, text: bool = False) -> subprocess.Popen:
    """``python -m grpolab.commands.cli ARGS`` in a process of its own (a runner a test kills or signals, whose
    imports are its own), with ``env`` (default: this process's) and its stderr into ``stdout``."""
    command = [sys.executable, "-m", "grpolab.commands.cli", *args]
    return subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=text)


def write_hook(tmp_path: Path, code: str) -> Path:
    """A folder ``tmp_path/hook`` whose sitecustomize.py is ``code``: on PYTHONPATH, ``code`` runs at the start of
    every run process."""
    folder = tmp_path / "hook"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return folder


def wait_for_steps(
    run_dirs: list[Path], steps: int, running: Callable[[], bool], seconds: float = 120, interval: float = 0.02
) -> None:
    """Until every run of ``run_dirs`` has recorded ``steps`` training steps, or ``running()`` is false (the
    runner ended), or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and running() and min(steps_recorded(d) for d in run_dirs) < steps:
        time.sleep(interval)


def steps_recorded(run_dir: Path) -> int:
    """How many training records a run's metrics.jsonl holds so far."""
    metrics = Path(run_dir) / "metrics.jsonl"
    return metrics.read_text().count('"reward_mean"') if metrics.exists() else 0


def trainers_of(root: Path, name: str) -> set[int]:
    """Live ``grpolab.commands.cli train`` processes of run ``name`` of the suite in ``root``, from /proc."""
    marks = {str(root / "configs" / f"{name}.json"), str(root / "runs" / name)}
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "grpolab.commands.cli" in args and "train" in args and marks & set(args):
            found.add(int(entry))
    return found


def assert_same_metrics(root: Path, reference: Path, names: tuple[str, ...] = ("a", "b")) -> None:
    """Every record of runs ``names`` (no step lost or repeated) equals the reference's, timings aside."""
    for name in names:
        got = untimed(read_metrics(root / "runs" / name / "metrics.jsonl"))
        want = untimed(read_metrics(reference / "runs" / name / "metrics.jsonl"))
        assert got == want, (name, got, want)


def assert_same_runs(root: Path, reference: Path, names: tuple[str, ...] = ("a", "b")) -> None:
    """Every record (no step lost or repeated) and every final checkpoint's weights equal the reference's."""
    assert_same_metrics(root, reference, names)
    hashes = [r.final_checkpoint_sha256 for r in SuiteManifest.load(root).runs]
    want = [r.final_checkpoint_sha256 for r in SuiteManifest.load(reference).runs]
    assert hashes == want and all(hashes), (hashes, want)
