"""What a report reads: the runs of a suite directory (or one run directory, or a folder of them), with
their state, config, metrics and per-item evaluation records, whatever stage they reached."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from grpolab.run.rundir import JsonLines, eval_record_steps, eval_records_path, read_json_lines
from grpolab.studies.manifest import MANIFEST, SuiteManifest, pid_alive
from grpolab.studies.report.folder import ReportError, is_report, read_json

NOT_TRAINING = ("seed", "output_dir", "eval", "checkpoint", "warn", "log", "log_every", "threads")


@dataclass
class Run:
    """One run as found on disk. ``state``: completed, running, failed, stopped, queued or incomplete
    (a run directory without summary.json outside a suite); ``reason`` says why it did not complete."""

    name: str
    path: Path
    state: str
    reason: str | None = None
    factors: dict[str, str] = field(default_factory=dict)
    config_file: Path | None = None  # a suite's copy of the config, for runs that have not started
    _records: dict[int, JsonLines] = field(default_factory=dict, repr=False)

    @cached_property
    def config(self) -> dict[str, Any]:
        for path in (self.path / "config.json", self.config_file):
            if path is not None and path.is_file():
                return read_json(path)
        return {}

    @cached_property
    def _metrics_file(self) -> JsonLines:
        return read_json_lines(self.path / "metrics.jsonl")

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The readable records of metrics.jsonl (a line torn by a kill, or being written, is skipped)."""
        return self._metrics_file.records

    @cached_property
    def summary(self) -> dict[str, Any] | None:
        path = self.path / "summary.json"
        return read_json(path) if path.is_file() else None

    @property
    def train(self) -> list[dict[str, Any]]:
        """Training records (one per step), in order."""
        return [r for r in self.metrics if "reward_mean" in r]

    @property
    def evals(self) -> list[dict[str, Any]]:
        """Validation records (``val/...``), in order of step."""
        return sorted((r for r in self.metrics if "val/accuracy" in r), key=lambda r: r["step"])

    @cached_property
    def eval_steps(self) -> list[int]:
        """Steps with per-item records."""
        return eval_record_steps(self.path) if (self.path / "eval").is_dir() else []

    def records(self, step: int) -> list[dict[str, Any]]:
        """The readable per-item records of ``step``, read once."""
        if step not in self._records:
            self._records[step] = read_json_lines(eval_records_path(self.path, step))
        return self._records[step].records

    def skipped_lines(self) -> int:
        """Unreadable lines in metrics.jsonl and in every evaluation record file (each file is read)."""
        for step in self.eval_steps:
            self.records(step)
        return self._metrics_file.skipped + sum(self._records[s].skipped for s in self.eval_steps)

    def questions(self) -> dict[str, str]:
        """Validation questions by item id, rebuilt from the run's task settings ({} when its data cannot be
        read any more): records keep the completion, not the question."""
        from grpolab.tasks import build_task

        try:
            return {e.id: e.question for e in build_task(dict(self.config.get("task", {}))).validation_examples()}
        except Exception:  # moved data or an older task version: examples are shown without their question
            return {}

    @property
    def seed(self) -> int | None:
        return self.config.get("seed")

    @property
    def algorithm(self) -> str:
        return self.config.get("algorithm", {}).get("name", "?")

    @property
    def total_steps(self) -> int | None:
        return self.config.get("steps")

    def setting_key(self) -> str:
        """The settings that decide training (the config less seed, output directory, evaluation, checkpoint,
        logging and threads): runs with equal keys differ only in their training seed."""
        settings = {k: v for k, v in self.config.items() if k not in NOT_TRAINING}
        return json.dumps(settings, sort_keys=True)


def _suite_runs(root: Path) -> list[Run]:
    def here(path: str, kind: str, name: str) -> Path:
        """The recorded path, or its place under ``root`` when the suite directory was moved."""
        moved = root / kind / name
        return moved if not Path(path).exists() and moved.exists() else Path(path)

    manifest = SuiteManifest.load(root)
    return [
        Run(
            r.name,
            here(r.run_dir, "runs", r.name),
            "running (process gone: suite resume)" if r.state == "running" and not pid_alive(r.pid) else r.state,
            r.reason,
            dict(r.factors),
            here(r.config_file, "configs", f"{r.name}.json"),
        )
        for r in manifest.runs
        if r.state != "dropped"  # a decision suite's run it needed no more: never started
    ]


def _plain_run(path: Path) -> Run:
    state, reason = (
        ("completed", None)
        if (path / "summary.json").is_file()
        else ("incomplete", "no summary.json: still running, stopped or failed")
    )
    return Run(path.name, path, state, reason)


def find_runs(directory: Path) -> tuple[str, list[Run]]:
    """(title, runs) of a suite directory, a run directory or a folder of run directories (a report's own
    folder is not a run; a run directory that is merely named ``report`` is)."""
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return f"suite {SuiteManifest.load(directory).suite}", _suite_runs(directory)
    if (directory / "config.json").is_file():
        return f"run {directory.name}", [_plain_run(directory)]
    found = sorted(directory.iterdir()) if directory.is_dir() else []
    runs = [_plain_run(p) for p in found if (p / "config.json").is_file() and not is_report(p)]
    if not runs:
        raise ReportError(
            f"{directory}: not a suite directory ({MANIFEST}), a run directory (config.json) "
            "or a folder of run directories"
        )
    return f"runs in {directory.name}", runs


@dataclass(frozen=True)
class Outcomes:
    """One run's per-item outcomes at one evaluation step: ids and prompt hashes [items] and correct as a 0/1 array
    [items], of the items whose evaluation did not fail; ``failed``: the ids of those that did (an unknown
    outcome: in no accuracy, left out of any pairing); ``records``: all of them."""

    step: int
    ids: list[str]
    prompt_hashes: list[str]
    correct: np.ndarray
    records: list[dict[str, Any]]
    failed: frozenset[str] = frozenset()


def outcomes(run: Run, step: int | None = None) -> Outcomes | None:
    """The records of ``step`` (default the run's last evaluation), or None when there are none."""
    steps = run.eval_steps
    if not steps:
        return None
    step = steps[-1] if step is None else step
    records = run.records(step)
    known = [r for r in records if not r.get("failed")]
    return Outcomes(
        step,
        [r["id"] for r in known],
        [r["prompt_sha256"] for r in known],
        np.array([bool(r["correct"]) for r in known], dtype=np.float64),
        records,
        frozenset(r["id"] for r in records if r.get("failed")),
    )


@dataclass(frozen=True)
class Paired:
    """Two runs' outcomes on their shared items [shared], and what could not be paired."""

    a: np.ndarray
    b: np.ndarray
    shared: int
    only_one: int  # items evaluated in one run only
    differing: int  # same id, different prompt: not the same item, left out
    failed: int = 0  # items of both runs whose evaluation failed in either: an unknown outcome, left out


def pair(a: Outcomes, b: Outcomes) -> Paired:
    """Align two runs' outcomes by item id, keeping the items whose prompt hashes agree."""
    b_at = {i: k for k, i in enumerate(b.ids)}
    keep_a, keep_b, differing = [], [], 0
    for k, item in enumerate(a.ids):
        j = b_at.get(item)
        if j is None:
            continue
        if a.prompt_hashes[k] != b.prompt_hashes[j]:
            differing += 1
            continue
        keep_a.append(k)
        keep_b.append(j)
    in_a, in_b = set(a.ids) | a.failed, set(b.ids) | b.failed
    failed = len(in_a & in_b & (a.failed | b.failed))
    return Paired(a.correct[keep_a], b.correct[keep_b], len(keep_a), len(in_a ^ in_b), differing, failed)
