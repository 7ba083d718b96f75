"""How long the grpolab command takes to answer when it only reads settings, side by side in one run.

    python benchmarks/cli_startup.py                  # 7 rounds
    python benchmarks/cli_startup.py --repeats 15 --config configs/gsm8k_cpu_check.toml
    python benchmarks/cli_startup.py --quick          # one round (what the test runs)

Each round runs every command once as a fresh process, in turn (rounds interleaved, so that a load on the
machine slows every command alike): ``python -c pass`` (the interpreter's own start), ``grpolab --help``,
``grpolab train --help`` (every config field), ``grpolab config --config FILE``, a mistyped field refused
(``--optim.lrr``) and ``grpolab algorithms``. Prints each command's median, min and max wall-clock seconds and
its median over ``python -c pass``'s. Target: each grpolab command at most 1.0 s on an idle core (7 s before the
settings were split from the model code, which imports torch and transformers). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0


def grpolab_command() -> list[str]:
    """The installed ``grpolab`` entry point beside this interpreter, else ``python -m grpolab``."""
    script = Path(sys.executable).parent / "grpolab"
    if script.is_file():
        return [str(script)]
    found = shutil.which("grpolab")
    return [found] if found else [sys.executable, "-m", "grpolab"]


def commands(config: str) -> dict[str, tuple[list[str], int]]:
    """label -> (its command line, the exit status it must end with)."""
    grpolab = grpolab_command()
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], 0),
        "grpolab --help": ([*grpolab, "--help"], 0),
        "grpolab train --help": ([*grpolab, "train", "--help"], 0),
        f"grpolab config --config {config}": ([*grpolab, "config", "--config", config], 0),
        "grpolab train ... --optim.lrr 1 (refused)": ([*grpolab, "train", "--config", config, "--optim.lrr", "1"], 2),
        "grpolab algorithms": ([*grpolab, "algorithms"], 0),
    }


def run_once(argv: list[str], status: int) -> float:
    """Wall-clock seconds of one run; SystemExit when it ends otherwise than ``status``."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"})
    seconds = time.perf_counter() - start
    if done.returncode != status:
        raise SystemExit(f"{' '.join(argv)}: exit status {done.returncode}, not {status}\n{done.stdout}{done.stderr}")
    return seconds


def measure(cases: dict[str, tuple[list[str], int]], repeats: int, warm_up: bool = True) -> dict[str, list[float]]:
    """``repeats`` rounds, each running every case once in turn, after an untimed one (``warm_up``: the files in
    the disk cache)."""
    for argv, status in cases.values() if warm_up else ():
        run_once(argv, status)
    times: dict[str, list[float]] = {label: [] for label in cases}
    for _ in range(repeats):
        for label, (argv, status) in cases.items():
            times[label].append(run_once(argv, status))
    return times


def table(times: dict[str, list[float]]) -> list[str]:
    base = statistics.median(times["python -c pass"])
    width = max(len(label) for label in times)
    lines = [f"{'command':<{width}}  {'median s':>8}  {'min s':>6}  {'max s':>6}  {'x python -c pass':>16}"]
    for label, seconds in times.items():
        median = statistics.median(seconds)
        lines.append(
            f"{label:<{width}}  {median:8.3f}  {min(seconds):6.3f}  {max(seconds):6.3f}  {median / base:16.1f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (each command once per round)")
    parser.add_argument("--quick", action="store_true", help="one timed round, no untimed one before")
    parser.add_argument(
        "--config", default="configs/smollm2_arithmetic.toml", help="the config file (relative to the checkout)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here (never overwritten)")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.json is not None and args.json.exists():
        parser.error(f"{args.json} exists; choose another --json path or move it away")
    from grpolab.common.provenance import code_commit, cpu_description, describe_cpu

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    times = measure(commands(args.config), repeats, warm_up=not args.quick)
    print(
        f"grpolab's start: {repeats} round(s), interleaved; {datetime.date.today()}, commit {code_commit() or '-'}; "
        f"{describe_cpu(cpu_description())}, {os.cpu_count()} CPUs, load average {load} before"
    )
    print("\n".join(table(times)))
    slow = [label for label, s in times.items() if label.startswith("grpolab") and statistics.median(s) > TARGET_S]
    print(f"target: each grpolab command <= {TARGET_S:g} s: {'met' if not slow else 'missed by ' + ', '.join(slow)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"repeats": repeats, "commit": code_commit(), "seconds": times}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
