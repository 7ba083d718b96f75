"""``grpolab report`` on hand-made run directories: it replaces only its own marked folder (never a run
directory, a user's folder or a file named ``report``), counts torn lines, and pools seeds and 2x2 cells
only at a common step on shared items, flagging the runs that stopped early."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from report_runs import eval_item, train_record, val_record
from test_report import md_table

from grpolab.commands.cli import main
from grpolab.common.atomic import temp_path
from grpolab.studies.manifest import RunRecord, SuiteManifest
from grpolab.studies.report.runs import find_runs

MARKER = ".grpolab-report"


def correctness(seed: int, step: int, items: int) -> np.ndarray:
    """A run's 0/1 outcomes at ``step``: item i of every run is the same item; each run and step differ."""
    rng = np.random.default_rng(1000 * seed + step)
    return (rng.random(items) < 0.3 + 0.01 * step).astype(float)


def write_run(
    path: Path,
    seed: int,
    steps: int = 50,
    done: int | None = None,
    items: int = 100,
    every: int = 10,
    settings: str = "grpo",
) -> Path:
    """A run directory as the trainer leaves it: config.json, metrics.jsonl (a train record per step and a
    validation record per evaluation), eval/step_NNNNNN.jsonl per evaluation and, when it got to ``steps``,
    summary.json. ``done``: the last step it got to (default ``steps``)."""
    done = steps if done is None else done
    (path / "eval").mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "steps": steps,
                "algorithm": {"name": settings},
                "eval": {"every": every, "n_examples": items},
                "output_dir": str(path),
            }
        )
    )
    lines = []
    for step in range(0, done + 1):
        if step:
            lines.append(train_record(step))
        if step % every == 0 or step == steps:
            correct = correctness(seed, step, items)
            records = [eval_item(f"{i:03d}", c, 5) for i, c in enumerate(correct)]
            (path / "eval" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            lines.append(val_record(step, float(correct.mean()), 5.0))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if done == steps:
        (path / "summary.json").write_text(json.dumps({"wall_seconds": 1.0}))
    return path


def listing(root: Path) -> dict[str, str]:
    """Every path under ``root`` (hidden ones too) with a hash of its content, a link's target or 'dir'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                out[key] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                out[key] = "dir"
            else:
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def folder(tmp_path) -> Path:
    """A folder of two small runs."""
    root = tmp_path / "runs"
    for name, seed in (("a", 0), ("b", 1)):
        write_run(root / name, seed, steps=4, every=2, items=10)
    return root


def refused(root: Path, capsys) -> str:
    """Run the report and check it refused: exit 2, one error line, nothing under ``root`` changed."""
    before = listing(root)
    assert main(["report", str(root)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("error:") == 1
    assert listing(root) == before
    return out


def test_a_run_directory_named_report_is_a_run_and_is_never_replaced(folder, capsys):
    write_run(folder / "report", 2, steps=4, every=2, items=10)  # made with --output-dir runs/report
    assert [r.name for r in find_runs(folder)[1]] == ["a", "b", "report"]
    out = refused(folder, capsys)
    assert f"{folder / 'report'} exists and is not a grpolab report (no {MARKER}); not replaced" in out
    assert (folder / "report" / "metrics.jsonl").is_file() and (folder / "report" / "eval").is_dir()


@pytest.mark.parametrize("kind", ["folder", "file", "link", "empty folder", "fake marker"])
def test_anything_else_named_report_is_left_alone(folder, tmp_path, capsys, kind):
    target = folder / "report"
    if kind == "folder":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "file":
        target.write_text("mine")
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / MARKER).write_text(json.dumps({"kind": "grpolab report"}))
        target.symlink_to(tmp_path / "elsewhere")
    elif kind == "empty folder":
        target.mkdir()
    else:
        target.mkdir()
        (target / MARKER).write_text("not the report's marker")
    assert "is not a grpolab report" in refused(folder, capsys)
    assert (tmp_path / "elsewhere").is_dir() or kind != "link"


def test_the_report_marks_its_folder_replaces_only_that_and_is_not_a_run(folder):
    assert main(["report", str(folder)]) == 0
    assert json.loads((folder / "report" / MARKER).read_text()) == {"kind": "grpolab report"}
    (folder / "report" / "config.json").write_text("{}")  # even with a config.json the report is not a run
    assert [r.name for r in find_runs(folder)[1]] == ["a", "b"]
    assert main(["report", str(folder)]) == 0  # its own marked folder is replaced
    assert not (folder / "report" / "config.json").exists() and (folder / "report" / "report.md").is_file()
    assert sorted(p.name for p in folder.iterdir()) == ["a", "b", "report"]


def test_leftovers_of_a_killed_report_go_only_when_its_process_is_gone(folder):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    mine = temp_path(folder / "report")
    killed = mine.with_name(mine.name.replace(f"-{os.getpid()}-", f"-{dead}-"))  # a killed report's temp folder
    for path in (mine, killed):  # ``mine``: a report still being written by a live process
        path.mkdir()
        (path / MARKER).write_text(json.dumps({"kind": "grpolab report"}))
    for name in (".report-old-mine", ".report-keep"):  # someone else's, not named by a writer
        (folder / name).mkdir()
        (folder / name / "data.txt").write_text("mine")
    assert main(["report", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".report-keep", ".report-old-mine", mine.name, "a", "b", "report"]
    )
    assert (folder / ".report-keep" / "data.txt").read_text() == "mine"


def test_an_unmarked_report_old_is_not_deleted(folder):
    (folder / ".report-old").mkdir()
    (folder / ".report-old" / "data.txt").write_text("mine")
    assert main(["report", str(folder)]) == 0
    assert main(["report", str(folder)]) == 0
    assert (folder / ".report-old" / "data.txt").read_text() == "mine"


def test_torn_lines_are_skipped_and_counted(folder):
    with (folder / "a" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')  # a kill mid-line
    with (folder / "b" / "eval" / "step_000004.jsonl").open("a") as f:
        f.write('{"id": "item-0\n')
    with (folder / "b" / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")  # JSON, but not a record
    assert main(["report", str(folder)]) == 0
    data = json.loads((folder / "report" / "report.json").read_text())
    rows = {r["run"]: r for r in data["runs"]}
    assert rows["a"]["skipped_lines"] == 1 and rows["b"]["skipped_lines"] == 2
    assert rows["a"]["steps_done"] == 4 and rows["a"]["final_step"] == 4
    text = (folder / "report" / "report.md").read_text()
    assert "run a: 1 unreadable line skipped" in text and "run b: 2 unreadable lines skipped" in text
    # b's step-4 accuracy is that of its readable records
    assert data["comparisons"][0]["items"] == 10


def test_seed_table_uses_the_common_step_and_shared_items_and_flags_the_early_stop(tmp_path):
    root = tmp_path / "runs"
    write_run(root / "s0", 0)
    write_run(root / "s1", 1, done=10, items=20)  # stopped at step 10 of 50, evaluated on 20 items
    write_run(root / "s2", 2)
    write_run(root / "other", 0, settings="dr_grpo")  # other settings: not in the group
    assert main(["report", str(root), "--baseline", "s0"]) == 0
    data = json.loads((root / "report" / "report.json").read_text())
    (group,) = data["seed_groups"]
    expected = [correctness(seed, 10, 100)[:20].mean() for seed in (0, 1, 2)]  # step 10, the 20 shared items
    assert group["runs"] == ["s0", "s1", "s2"] and group["seeds"] == [0, 1, 2]
    assert (group["step"], group["items"], group["items_per_run"]) == (10, 20, [100, 20, 100])
    assert group["accuracy"] == pytest.approx(expected, abs=1e-12)
    assert group["mean"] == pytest.approx(np.mean(expected), abs=1e-12)
    assert group["std"] == pytest.approx(np.std(expected, ddof=1), abs=1e-12)
    assert group["stopped_early"] == ["s1"] and group["last_eval_step"] == [50, 10, 50]
    assert group["steps_done"] == [50, 10, 50] and group["configured_steps"] == [50, 50, 50]
    text = (root / "report" / "report.md").read_text()
    row = md_table(text, "runs (same settings)")["s0, s1*, s2"]
    assert row[1:5] == ["0, 1, 2", "10", "20", ", ".join(f"{a:.3f}" for a in expected)]
    assert row[5:7] == [f"{np.mean(expected):.3f}", f"{np.std(expected, ddof=1):.3f}"]
    assert "s1 last evaluated at step 10 of 50" in text


def test_seeds_without_a_common_step_are_not_pooled(tmp_path):
    root = tmp_path / "runs"
    write_run(root / "s0", 0, steps=20)
    write_run(root / "s1", 1, steps=20, every=7)  # evaluated at 7, 14, 20 (and 0, removed below)
    (root / "s0" / "eval" / "step_000000.jsonl").unlink()
    (root / "s0" / "eval" / "step_000020.jsonl").unlink()
    assert main(["report", str(root)]) == 0
    (group,) = json.loads((root / "report" / "report.json").read_text())["seed_groups"]
    assert group["step"] is None and "mean" not in group and "no evaluation step common" in group["note"]
    text = (root / "report" / "report.md").read_text()
    assert md_table(text, "runs (same settings)")["s0*, s1"][2:5] == ["-", "-", "-"]
    assert "no evaluation step common to all runs" in text


def test_the_2x2_uses_the_common_step_on_shared_items(tmp_path):
    root = tmp_path / "suite"
    cells = {
        "a": ("std", "seq", 0),
        "b": ("std", "seq", 1),
        "c": ("none", "const", 2),
        "d": ("std", "const", 3),
        "e": ("none", "seq", 4),
    }
    for name, (_, _, seed) in cells.items():
        if name == "e":
            write_run(root / "runs" / name, seed, done=10, items=20)
        else:
            write_run(root / "runs" / name, seed)
    SuiteManifest(
        suite="fixture",
        source_file="x",
        runs=[
            RunRecord(
                name=n,
                run_dir=str(root / "runs" / n),
                state="running" if n == "e" else "completed",
                pid=None,
                factors={"norm": norm, "agg": agg},
                config_file="x",
                config_sha256="x",
            )
            for n, (norm, agg, _) in cells.items()
        ],
    ).save(root)
    assert main(["report", str(root)]) == 0
    f = json.loads((root / "report" / "report.json").read_text())["factorial"]
    y = {n: correctness(seed, 10, 100)[:20] for n, (_, _, seed) in cells.items()}
    y00, y01, y10, y11 = (y["a"] + y["b"]) / 2, y["d"], y["e"], y["c"]
    assert (f["step"], f["items"], f["stopped_early"]) == (10, 20, ["e"])
    assert f["cell_accuracy"] == pytest.approx(
        {"std x seq": y00.mean(), "std x const": y01.mean(), "none x seq": y10.mean(), "none x const": y11.mean()},
        abs=1e-12,
    )
    assert f["interaction"]["estimate"] == pytest.approx(np.mean((y11 - y01) - (y10 - y00)), abs=1e-12)
    text = (root / "report" / "report.md").read_text()
    assert "none x seq: e*" in text and "At step 10" in text and "over the 20 items" in text
    assert "e last evaluated at step 10 of 50" in text


@pytest.mark.parametrize("name", ["summary.json", "config.json", "manifest.json"])  # manifest: the run journal's
def test_an_unreadable_json_file_is_one_error_line_naming_it(folder, capsys, name):
    (folder / "a" / name).write_text("" if name != "config.json" else '{"seed": 0, "ste')  # empty, torn
    out = refused(folder, capsys)
    assert str(folder / "a" / name) in out, out
