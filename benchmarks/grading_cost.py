"""What grading a rollout batch costs with each kind of reward, side by side in one process.

    python benchmarks/grading_cost.py                 # 256 completions (32 prompts x 8), 3 repeats
    python benchmarks/grading_cost.py --samples 1024 --repeats 5

Grades the same completions of the tiny MATH-like fixture (``tests/data/math_tiny``) with a dataset
task per reward setting: the in-process numeric verifier, math-verify (worker processes), a user
function by import path (worker processes; ``benchmarks/grading_cost.py:length_bonus`` stands in),
and all three weighted together. Workers start before timing. Prints seconds per batch, milliseconds
per completion and the ratio to the numeric verifier.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "math_tiny"


def length_bonus(completion: str, answer: str, truncated: bool) -> float:
    """A user reward: 1 for a completion under 200 characters that stopped by itself."""
    return float(len(completion) < 200 and not truncated)


SETTINGS = {
    "numeric": [{"function": "numeric"}],
    "math": [{"function": "math"}],
    "user function": [{"function": "numeric"}, {"function": "grading_cost:length_bonus", "weight": 0.1}],
    "math + user + numeric": [
        {"function": "math"},
        {"function": "grading_cost:length_bonus", "weight": 0.1},
        {"function": "numeric", "name": "plain", "weight": 0.5},
    ],
}


def completions(task, n: int, seed: int = 0) -> list[tuple[str, object, bool]]:
    """n graded items: right, wrong and unboxed answers to the fixture's problems."""
    rng = random.Random(seed)
    examples = task.train_examples()
    items = []
    for i in range(n):
        e = examples[i % len(examples)]
        answer = rng.choice([e.answer, e.answer + "1", "\\frac{7}{9}", None])
        stated = "so the answer is \\boxed{" + answer + "}." if answer else "no idea"
        text = "Working it out step by step... " + stated
        items.append((text, e, rng.random() < 0.05))
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpolab.tasks import build_task

    results = {}
    for label, rewards in SETTINGS.items():
        task = build_task(
            {
                "name": "dataset",
                "train": str(FIXTURE / "train.jsonl"),
                "validation": str(FIXTURE / "test.jsonl"),
                "question_field": "problem",
                "prompt": {"format": "template", "template": "{problem}", "answer": "boxed"},
                "rewards": rewards,
            }
        )
        items = completions(task, args.samples)
        task.grade_batch(items[:8])  # start the workers
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            grades = task.grade_batch(items)
            seconds.append(time.perf_counter() - start)
        results[label] = statistics.median(seconds)
        accuracy = sum(g.answer_reward for g in grades) / len(grades)
        print(
            f"{label:>24}: {results[label]:.3f} s per {args.samples} completions "
            f"({1000 * results[label] / args.samples:.2f} ms each, median of {args.repeats}; accuracy {accuracy:.3f}) "
            f"= {results[label] / results['numeric']:.1f}x numeric",
            flush=True,
        )


if __name__ == "__main__":
    main()
