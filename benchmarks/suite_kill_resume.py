"""A suite run twice side by side: once uninterrupted, once killed with SIGKILL (runner and run) in the
middle of one run and resumed with `grpolab suite resume`. Prints, per run, the final validation
accuracy of both and whether every metric (timings aside) and the final weights are identical.

With ``--runner-only`` the runner alone is killed (as when its terminal is closed): its run, in its own
session, trains on, and the resume, started at once, must wait for it instead of starting a second
trainer; the killed run's log then shows how many trainers it had (one).

    python benchmarks/suite_kill_resume.py suites/demo_all.toml --out /tmp/kill_resume --kill-run 5 --kill-step 20
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpolab.run.rundir import read_metrics
from grpolab.studies.manifest import SuiteManifest
from grpolab.studies.suite.runner import progress_of


def suite(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "grpolab.commands.cli", "suite", *args], stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def untimed(path: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in read_metrics(path)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite")
    parser.add_argument("--out", required=True, help="a new directory")
    parser.add_argument("--kill-run", type=int, default=5, help="kill during the k-th run (1-based)")
    parser.add_argument("--kill-step", type=int, default=20, help="once that run has logged this many steps")
    parser.add_argument("--runner-only", action="store_true", help="kill the runner alone: its run trains on")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True)
    started = time.monotonic()
    reference = suite("run", args.suite, "--output-root", str(out / "uninterrupted"), log=out / "uninterrupted.log")
    killed_root = out / "killed"
    victim = suite("run", args.suite, "--output-root", str(killed_root), log=out / "killed.log")
    while victim.poll() is None:
        try:
            record = SuiteManifest.load(killed_root).runs[args.kill_run - 1]
        except (FileNotFoundError, ValueError):
            record = None
        if record is not None and record.state == "running" and progress_of(Path(record.run_dir))[0] >= args.kill_step:
            victim.kill()
            if not args.runner_only:
                os.killpg(record.pid, signal.SIGKILL)
            print(
                f"killed {'the runner during ' if args.runner_only else ''}run {record.name} at step "
                f"{progress_of(Path(record.run_dir))[0]} after {time.monotonic() - started:.0f} s",
                flush=True,
            )
            break
        time.sleep(0.2)
    victim.wait()
    resumed = suite("resume", str(killed_root), log=out / "resumed.log")
    print(
        f"resume exit {resumed.wait()}, uninterrupted exit {reference.wait()}, "
        f"{time.monotonic() - started:.0f} s in all",
        flush=True,
    )
    a, b = SuiteManifest.load(out / "uninterrupted"), SuiteManifest.load(killed_root)
    print(f"{'run':<18} {'state':<20} {'final acc':>9} {'resumed acc':>11}  metrics equal  weights equal")
    for x, y in zip(a.runs, b.runs):
        same = untimed(Path(x.run_dir) / "metrics.jsonl") == untimed(Path(y.run_dir) / "metrics.jsonl")
        print(
            f"{x.name:<18} {x.state + '/' + y.state:<20} {progress_of(Path(x.run_dir))[1]:>9.3f} "
            f"{progress_of(Path(y.run_dir))[1]:>11.3f}  {str(same):<13}  "
            f"{x.final_checkpoint_sha256 == y.final_checkpoint_sha256}",
            flush=True,
        )
    victim_run = b.runs[args.kill_run - 1]
    log = killed_root / "logs" / f"{victim_run.name}.log"
    trainers = [
        line for line in log.read_text().splitlines() if line.startswith("# ") and "grpolab.commands.cli train" in line
    ]
    print(
        f"run {victim_run.name}: {len(trainers)} trainer command(s) in its log; the resume waited for "
        f"{[w['pid'] for w in victim_run.waits] or 'no process'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
