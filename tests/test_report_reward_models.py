"""The report's reward model section: the score by completion length decile against hand-computed groups,
and the section of a hand-made run directory (as the trainer leaves one with ``model:`` reward terms)
against the numbers written in its files; a run without reward models gets no such section."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from report_runs import eval_item, train_record, val_record

from grpolab.commands.cli import main
from grpolab.studies.report.reward_models import length_deciles

# the final evaluation's items: length, "rm" score, correct (hand-computed deciles in test_deciles_by_rank)
LENGTHS = [7, 3, 3, 3, 1, 9, 12, 5, 5, 2, 8, 6]
SCORES = [0.7, 0.3, 0.1, 0.5, -1.0, 0.9, 2.0, 0.4, 0.6, 0.0, 1.0, 0.2]
CORRECT = [1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1]
# ranked by length (ties in item order): items 4, 9 | 1, 2 | 3 | 7 | 8 | 11 | 0 | 10 | 5 | 6
DECILES = [  # (min length, max length, items, mean score, accuracy)
    (1, 2, 2, -0.5, 0.0),
    (3, 3, 2, 0.2, 0.5),
    (3, 3, 1, 0.5, 0.0),
    (5, 5, 1, 0.4, 1.0),
    (5, 5, 1, 0.6, 1.0),
    (6, 6, 1, 0.2, 1.0),
    (7, 7, 1, 0.7, 1.0),
    (8, 8, 1, 1.0, 0.0),
    (9, 9, 1, 0.9, 1.0),
    (12, 12, 1, 2.0, 0.0),
]


def rows(found: list[dict]) -> list[tuple]:
    return [(d["min_length"], d["max_length"], d["items"], d["mean_score"], d["accuracy"]) for d in found]


def same(found: list[dict], expected: list[tuple]) -> bool:
    """``found``'s rows (``rows``) equal ``expected``: lengths and counts exactly, means to rounding."""
    got = rows(found)
    return (
        len(got) == len(expected)
        and all(g[:3] == e[:3] for g, e in zip(got, expected))
        and np.allclose([g[3:] for g in got], [e[3:] for e in expected], rtol=0, atol=1e-12)
    )


def test_deciles_by_rank():
    found = length_deciles(np.array(LENGTHS), np.array(SCORES), np.array(CORRECT))
    assert [d["decile"] for d in found] == list(range(1, 11))
    assert same(found, DECILES)


def test_deciles_of_25_items_put_the_extra_items_first():
    lengths = np.array([13, 2, 24, 7, 0, 18, 11, 5, 21, 9, 16, 1, 23, 4, 14, 20, 8, 3, 19, 12, 6, 22, 10, 17, 15])
    found = length_deciles(lengths, lengths / 10, lengths % 2 == 0)
    assert same(
        found,
        [
            (0, 2, 3, 0.1, 2 / 3),
            (3, 5, 3, 0.4, 1 / 3),
            (6, 8, 3, 0.7, 2 / 3),
            (9, 11, 3, 1.0, 1 / 3),
            (12, 14, 3, 1.3, 2 / 3),
            (15, 16, 2, 1.55, 0.5),
            (17, 18, 2, 1.75, 0.5),
            (19, 20, 2, 1.95, 0.5),
            (21, 22, 2, 2.15, 0.5),
            (23, 24, 2, 2.35, 0.5),
        ],
    )


def test_equal_lengths_share_deciles_in_item_order_and_few_items_give_fewer_rows():
    found = length_deciles(np.full(20, 4), np.arange(20.0), np.arange(20) < 5)
    assert same(found, [(4, 4, 2, 2 * k + 0.5, [1, 1, 0.5, 0, 0, 0, 0, 0, 0, 0][k]) for k in range(10)])
    assert rows(length_deciles(np.array([30, 10, 20]), np.array([3.0, 1.0, 2.0]), np.array([1, 0, 0]))) == [
        (10, 10, 1, 1.0, 0.0),
        (20, 20, 1, 2.0, 0.0),
        (30, 30, 1, 3.0, 1.0),
    ]
    assert length_deciles(np.array([]), np.array([]), np.array([])) == []
    with pytest.raises(ValueError, match="differ in size"):
        length_deciles(np.array([1, 2]), np.array([1.0]), np.array([1, 0]))


# per training step 1..4: "rm" (mean, std, min, max, corr_correct or None when constant); "judge" the same
RM_STEPS = [
    (0.10, 0.5, -0.9, 1.1, 0.80),
    (0.30, 0.4, -0.5, 1.2, 0.60),
    (0.50, 0.3, -0.1, 1.4, None),
    (0.90, 0.2, 0.4, 1.5, 0.20),
]
JUDGE_STEPS = [
    (2.0, 1.0, 0.0, 4.0, None),
    (2.5, 1.0, 0.5, 4.5, 0.10),
    (3.0, 1.0, 1.0, 5.0, 0.40),
    (3.5, 1.0, 1.5, 5.5, None),
]
VAL = {0: {"rm": (0.05, 0.70), "judge": (2.0, None)}, 4: {"rm": (0.45, 0.25), "judge": (3.25, 0.35)}}


def write_run(path: Path, models: bool) -> Path:
    """A finished 4-step run as the trainer leaves it: config.json, metrics.jsonl (a train record per step, a
    validation record at steps 0 and 4), eval/step_NNNNNN.jsonl and summary.json; with ``models``, the
    reward models "rm" and "judge" in the task, their metrics, and their scores in the records."""
    (path / "eval").mkdir(parents=True)
    rewards = (
        [
            {"function": "model:/models/rm-small", "name": "rm", "weight": 0.5},
            {"function": "model:/models/judge", "name": "judge", "weight": 0.1},
        ]
        if models
        else []
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "seed": 0,
                "steps": 4,
                "algorithm": {"name": "grpo"},
                "task": {"name": "dataset", "rewards": rewards},
                "output_dir": str(path),
            }
        )
    )
    lines: list[dict] = []
    for step in range(5):
        if step:
            record = train_record(step)
            for name, stats in (("rm", RM_STEPS[step - 1]), ("judge", JUDGE_STEPS[step - 1])) if models else ():
                record[f"reward/{name}"] = stats[0]
                record |= {
                    f"reward_model/{name}/{k}": v
                    for k, v in zip(("mean", "std", "min", "max", "corr_correct"), stats)
                    if v is not None
                }
            lines.append(record)
        if step in VAL:
            lengths = LENGTHS if step == 4 else [5] * len(LENGTHS)
            scored = [
                {"rewards": {"correct": c, "rm": s if step == 4 else 0.0, "judge": 10.0 + i}} if models else {}
                for i, (s, c) in enumerate(zip(SCORES, CORRECT))
            ]
            items = [
                eval_item(f"{i:02d}", c, n) | scores for i, (n, c, scores) in enumerate(zip(lengths, CORRECT, scored))
            ]
            (path / "eval" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
            record = val_record(step, float(np.mean(CORRECT)), float(np.mean(lengths)))
            for name, (mean, corr) in VAL[step].items() if models else ():
                record |= {
                    f"val/reward_model/{name}/mean": mean,
                    f"val/reward_model/{name}/std": 0.1,
                    f"val/reward_model/{name}/min": -1.0,
                    f"val/reward_model/{name}/max": 2.0,
                }
                if corr is not None:
                    record[f"val/reward_model/{name}/corr_correct"] = corr
            lines.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "summary.json").write_text(json.dumps({"wall_seconds": 1.0}))
    return path


def table_after(text: str, header_start: str) -> list[list[str]]:
    """The cells of the rows of the first markdown table after the line that starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    start = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    out = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip("|").split("|")])
    return out


def report(root: Path) -> tuple[str, dict]:
    assert main(["report", str(root)]) == 0
    return (root / "report" / "report.md").read_text(), json.loads((root / "report" / "report.json").read_text())


def test_the_section_shows_each_models_last_step_drift_final_evaluation_and_deciles(tmp_path):
    root = tmp_path / "runs"
    write_run(root / "judged", models=True)
    write_run(root / "plain", models=False)
    text, data = report(root)
    assert text.count("## Reward models") == 1
    assert table_after(text, "## Reward models") == [
        # run, model, step, mean, std, min, max, corr (step 4), change over the steps with one, final evaluation
        ["judged", "rm", "4", "0.900", "0.200", "0.400", "1.500", "0.200", "-0.600 (1 -> 4)", "4", "0.450", "0.250"],
        ["judged", "judge", "4", "3.500", "1.000", "1.500", "5.500", "-", "+0.300 (2 -> 3)", "4", "3.250", "0.350"],
    ]
    assert "first sign of reward hacking" in text
    assert table_after(text, "**judged / rm**: score by completion length decile, evaluation at step 4 (12 items)") == [
        [str(k + 1), f"{lo}-{hi}", str(n), f"{score:.3f}", f"{acc:.3f}"]
        for k, (lo, hi, n, score, acc) in enumerate(DECILES)
    ]
    judge = table_after(text, "**judged / judge**: score by completion length decile")
    assert [r[3] for r in judge] == [
        "16.500",
        "11.500",
        "13.000",
        "17.000",
        "18.000",
        "21.000",
        "10.000",
        "20.000",
        "15.000",
        "16.000",
    ]  # 10 + item index, items ranked as in DECILES
    assert "plain" not in {r["run"] for r in data["reward_models"]}
    found = {r["model"]: r for r in data["reward_models"]}
    assert found["rm"]["corr_first"] == 0.8 and found["rm"]["corr_last"] == 0.2
    assert same(found["rm"]["deciles"], DECILES)


def test_a_run_without_reward_models_has_no_section(tmp_path):
    write_run(tmp_path / "plain", models=False)
    text, data = report(tmp_path / "plain")
    assert data["reward_models"] == []
    assert "Reward model" not in text and "reward model" not in text and "decile" not in text
