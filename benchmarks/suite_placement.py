"""A suite's wall time one run at a time vs spread over devices, measured one after the other in one
invocation (never at once: they would share the cores), each run with ``--threads`` torch threads.
Prints both wall times, their ratio, and per run whether every metric (timings aside) and the final
weights are identical in the two placements.

On a CPU machine the devices are stand-ins (``--devices 0,1``: two runs at a time, one per core):

    python benchmarks/suite_placement.py suites/demo_all.toml --out /tmp/placement --threads 1 --devices 0,1
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from suite_kill_resume import untimed

from grpolab.studies.manifest import SuiteManifest
from grpolab.studies.suite.completion import progress_of


def with_threads(suite: Path, threads: int, out: Path) -> Path:
    """A copy of the suite file whose [base] sets ``threads`` (refused when the file sets it already)."""
    text = suite.read_text()
    if re.search(r"^\s*threads\s*=", text, re.M) or not re.search(r"^\[base\]\s*$", text, re.M):
        raise SystemExit(f"{suite}: needs a [base] table and no threads setting of its own")
    copy = out / suite.name
    copy.write_text(re.sub(r"^\[base\]\s*$", f"[base]\nthreads = {threads}", text, count=1, flags=re.M))
    return copy


def timed_suite(suite: Path, root: Path, log: Path, *extra: str) -> float:
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "grpolab.commands.cli",
                "suite",
                "run",
                str(suite),
                "--output-root",
                str(root),
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    seconds = time.monotonic() - started
    print(f"{root.name}: exit {code}, {seconds:.0f} s (log {log})", flush=True)
    if code != 0:
        raise SystemExit(f"the suite failed; see {log}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--devices", default="0,1", help="the spread placement's device list")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True)
    suite = with_threads(args.suite, args.threads, args.out)
    one = timed_suite(suite, args.out / "one_at_a_time", args.out / "one_at_a_time.log")
    spread = timed_suite(suite, args.out / "spread", args.out / "spread.log", "--devices", args.devices)
    print(
        f"one at a time {one:.0f} s, on devices {args.devices} {spread:.0f} s: {one / spread:.2f}x faster "
        f"({args.threads} thread(s) per run)"
    )
    a, b = SuiteManifest.load(args.out / "one_at_a_time"), SuiteManifest.load(args.out / "spread")
    print(f"{'run':<18} {'final acc':>9} {'devices':>8}  metrics equal  weights equal")
    for x, y in zip(a.runs, b.runs):
        same = untimed(Path(x.run_dir) / "metrics.jsonl") == untimed(Path(y.run_dir) / "metrics.jsonl")
        print(
            f"{x.name:<18} {progress_of(Path(x.run_dir)).accuracy:>9.3f} {','.join(y.devices or []):>8}  "
            f"{str(same):<13}  {x.final_checkpoint_sha256 == y.final_checkpoint_sha256}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
