"""What the code sandbox costs per call, side by side in one run: the same programs run unsandboxed (a plain
subprocess of the same interpreter with the same rlimits: the sandbox's ``unsafe`` mode) and in bubblewrap, at 1
and 2 workers.

    python benchmarks/sandbox_overhead.py              # 200 calls per row
    python benchmarks/sandbox_overhead.py --calls 40   # quicker

Prints, per mode and worker count, calls per second and the median and 90th-percentile wall-clock seconds of
one call, and the sandbox's median added latency (sandboxed median minus unsandboxed median at 1 worker).
Rows are interleaved in rounds so that a load on the machine slows every mode alike. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpolab.tools.code_sandbox import CodeSandbox  # noqa: E402

PROGRAM = "import math\nprint(sum(math.isqrt(i) for i in range(2000)))"


def one_round(sandbox: CodeSandbox, calls: int) -> tuple[float, list[float]]:
    """(calls per second, each call's seconds) for ``calls`` calls through the sandbox's pool."""
    start = time.monotonic()
    runs = sandbox.run_many([PROGRAM] * calls)
    elapsed = time.monotonic() - start
    if any(r.status != "ok" for r in runs):
        raise SystemExit(f"a call failed: {next(r for r in runs if r.status != 'ok')}")
    return calls / elapsed, [r.seconds for r in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per mode and worker count")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds the calls are split into")
    args = parser.parse_args()
    rows = {}
    for unsafe in (True, False):
        for workers in (1, 2):
            rows[("plain" if unsafe else "bubblewrap", workers)] = (CodeSandbox(unsafe=unsafe, workers=workers), [], [])
    per_round = max(1, args.calls // args.rounds)
    for _ in range(args.rounds):
        for sandbox, rates, seconds in rows.values():
            rate, each = one_round(sandbox, per_round)
            rates.append(rate)
            seconds.extend(each)
    print(f"{'mode':<11} {'workers':>7} {'calls/s':>8} {'median s':>9} {'p90 s':>7}")
    medians = {}
    for (mode, workers), (_, rates, seconds) in rows.items():
        ordered = sorted(seconds)
        medians[mode, workers] = statistics.median(ordered)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(f"{mode:<11} {workers:>7} {statistics.median(rates):>8.1f} {medians[mode, workers]:>9.4f} {p90:>7.4f}")
    added = medians["bubblewrap", 1] - medians["plain", 1]
    print(f"the sandbox adds {added * 1000:.1f} ms per call (median, 1 worker); program: {PROGRAM!r}")
    print(
        json.dumps(
            {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "added_ms": round(added * 1000, 2)}
        )
    )


if __name__ == "__main__":
    main()
