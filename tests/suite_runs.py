"""Helpers of the suite tests: the tiny two-run suite file, runners in processes of their own, and the checks
that a suite's runs equal a reference's."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

from conftest import TASK

from grpolab.commands.cli import main
from grpolab.run.rundir import read_metrics
from grpolab.studies.manifest import SuiteManifest


def suite_file(tmp_path: Path, model_dir: Path, first_overrides: str = "") -> Path:
    """Two 3-step runs: a (GRPO), then b (Dr. GRPO, seed 1) warm-started from a's final checkpoint."""
    task = "\n".join(f"{k} = {v}" for k, v in TASK.items())
    path = tmp_path / "suite.toml"
    path.write_text(f"""
[suite]
name = "tiny"
[base]
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
[[runs]]
name = "a"
algo = "grpo"
{first_overrides}
[[runs]]
name = "b"
algo = "dr_grpo"
seed = 1
init_from = "a"
factors = {{ start = "warm" }}
""")
    return path


def one_run_suite(tmp_path: Path, model_dir: Path) -> Path:
    """The tiny suite with run a alone."""
    path = suite_file(tmp_path, model_dir)
    text = path.read_text()
    path.write_text(text[: text.index("[[runs]]", text.index("[[runs]]") + 1)])
    return path


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in records]


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


def assert_same_runs(root: Path, reference: Path, names: tuple[str, ...] = ("a", "b")) -> None:
    """Every record (no step lost or repeated) and every final checkpoint's weights equal the reference's."""
    for name in names:
        got = untimed(read_metrics(root / "runs" / name / "metrics.jsonl"))
        want = untimed(read_metrics(reference / "runs" / name / "metrics.jsonl"))
        assert got == want, (name, got, want)
    hashes = [r.final_checkpoint_sha256 for r in SuiteManifest.load(root).runs]
    want = [r.final_checkpoint_sha256 for r in SuiteManifest.load(reference).runs]
    assert hashes == want and all(hashes), (hashes, want)
