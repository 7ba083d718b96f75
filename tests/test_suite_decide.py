"""Decision suites (``[decide]``): arms run seed by seed in rounds, the arms a confidence sequence decides get no
further seed, the decisions are in the manifest and a killed suite resumes to the same ones (fake runs: seconds)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from suite_runs import assert_same_metrics, forked_runner, tiny_base, toml_runs, write_suite

from grpolab.commands.cli import main
from grpolab.config import ConfigError
from grpolab.studies.manifest import SuiteManifest
from grpolab.studies.suite.spec import load_suite

pytest_plugins = ["suite_fixtures"]

ACCURACY = {"base": 0.8, "bad": 0.2, "same": 0.8}
ALGO = {"base": "grpo", "bad": "grpo", "same": "dr_grpo"}  # the fake's items are drawn from the run's settings
DECIDE = """[decide]
baseline = "base"
delta = 0.15
alpha = 0.05
seeds = [0, 1, 2]
sequence = "normal"
seed_sd = 0.05
"""


def decide_suite(tmp_path: Path, model_dir: Path, decide: str = DECIDE, runs: str | None = None) -> Path:
    arms = runs or toml_runs(*({"name": arm, "algo": ALGO[arm]} for arm in ACCURACY))
    return write_suite(tmp_path, "decide", tiny_base(model_dir) + decide, arms)


def run_decided(fake_runs, model_dir: Path, tmp_path: Path, capsys) -> Path:
    """The decision suite run uninterrupted with fake runs; what it printed in ``said.txt`` beside it."""
    fake_runs.use(accuracy=ACCURACY)
    root = tmp_path / "reference"
    assert main(["suite", "run", str(decide_suite(tmp_path, model_dir)), "--output-root", str(root)]) == 0
    (tmp_path / "said.txt").write_text(capsys.readouterr().out)
    return root


@pytest.fixture(scope="module")
def reference(fake_hook, warm_model_dir, tmp_path_factory) -> Path:
    """The decision suite run once for the tests that only read it."""
    from suite_fixtures import FakeRuns  # the plugin's own module (pytest_plugins), imported once it is loaded

    tmp_path = tmp_path_factory.mktemp("decided")
    with pytest.MonkeyPatch.context() as mp:
        fake_runs = FakeRuns(mp, fake_hook, tmp_path)
        fake_runs.use(accuracy=ACCURACY)
        root = tmp_path / "reference"
        log = tmp_path / "said.txt"
        with log.open("w") as out, contextlib.redirect_stdout(out):
            assert main(["suite", "run", str(decide_suite(tmp_path, warm_model_dir)), "--output-root", str(root)]) == 0
    return root


@pytest.fixture
def decided(fake_runs, warm_model_dir, tmp_path, capsys) -> Path:
    """A decision suite of this test's own, for the tests that change it."""
    return run_decided(fake_runs, warm_model_dir, tmp_path, capsys)


def states(root: Path) -> dict[str, str]:
    return {r.name: r.state for r in SuiteManifest.load(root).runs}


def test_a_decided_arm_gets_no_further_seed_and_the_answered_question_ends_the_suite(reference):
    decided = reference
    manifest = SuiteManifest.load(decided)
    assert [r.name for r in manifest.runs][:3] == ["base.s0", "bad.s0", "same.s0"]  # round by round
    assert {r.name: (r.arm, r.round) for r in manifest.runs}["same.s2"] == ("same", 2)
    first, second = manifest.decisions
    assert first["verdicts"]["bad"]["status"] == "worse" and first["verdicts"]["bad"]["round"] == 0
    assert first["verdicts"]["same"]["status"] == "open"
    assert second["verdicts"]["same"]["status"] == "within" and second["runs"] == ["base.s1", "same.s1"]
    assert states(decided) == {
        "base.s0": "completed",
        "bad.s0": "completed",
        "same.s0": "completed",
        "base.s1": "completed",
        "bad.s1": "dropped",
        "same.s1": "completed",
        "base.s2": "dropped",
        "bad.s2": "dropped",
        "same.s2": "dropped",
    }
    assert not (decided / "runs" / "bad.s1").exists() and not (decided / "runs" / "same.s2").exists()
    reasons = {r.name: r.reason for r in manifest.runs}
    assert reasons["bad.s1"].startswith("not needed: bad is worse at round 0 (bad - base <= ")
    assert reasons["same.s2"] == reasons["base.s2"] == "not needed: the question is answered after round 1"
    out = (decided.parent / "said.txt").read_text()
    assert "round 0: bad is worse (bad - base <= " in out and "round 0: 2 queued run(s) dropped: bad.s1, bad.s2" in out
    assert "round 1: same is within (same - base >= " in out
    assert "round 1: the question is answered; 2 queued run(s) dropped" in out
    assert "suite decide: decided; 5 of 9 runs completed, the others dropped" in out
    from grpolab.studies.suite.status import status_table

    caption = str(status_table(decided).caption)
    assert caption == "decisions after round 1: base baseline; bad worse at round 0; same within at round 1"


def test_a_decision_suite_killed_outright_resumes_to_the_same_decisions(reference, fake_runs, warm_model_dir, tmp_path):
    decided = reference
    """A power cut in round 1, after round 0's decision: the same decisions, runs and numbers as uninterrupted."""
    fake_runs.use(accuracy=ACCURACY, slow={"same.s1": 0.3})
    root = tmp_path / "out"
    runner = forked_runner("run", str(decide_suite(tmp_path, warm_model_dir)), "--output-root", str(root))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and runner.is_alive():
        if (
            (root / "suite_manifest.json").exists()
            and states(root).get("same.s1") == "running"
            and (root / "runs" / "same.s1" / "metrics.jsonl").exists()
        ):
            break
        time.sleep(0.02)
    child = next(r.pid for r in SuiteManifest.load(root).runs if r.name == "same.s1")
    runner.kill()
    os.killpg(child, signal.SIGKILL)
    runner.join()
    assert len(SuiteManifest.load(root).decisions) == 1 and states(root)["bad.s1"] == "dropped"
    assert main(["suite", "resume", str(root)]) == 0
    got, want = SuiteManifest.load(root), SuiteManifest.load(decided)
    assert got.decisions == want.decisions and states(root) == states(decided)
    assert_same_metrics(root, decided, ("base.s0", "bad.s0", "same.s0", "base.s1", "same.s1"))


def test_a_recorded_decision_its_runs_no_longer_give_stops_resume_in_one_line(decided, capsys):
    root = decided
    before = SuiteManifest.load(root).model_dump()
    records = root / "runs" / "bad.s0" / "eval" / "step_000003.jsonl"
    flipped = [{**r, "correct": True} for r in map(json.loads, records.read_text().splitlines())]
    records.write_text("".join(json.dumps(r) + "\n" for r in flipped))
    capsys.readouterr()
    assert main(["suite", "resume", str(root)]) == 2
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "recorded decision" in line]
    want = (
        "the recorded decision is not what its runs give now (a run's evaluation records changed); nothing was started"
    )
    assert lines == [f"error: round 0: {want}", f"error: round 1: {want}"]  # round 1 reads round 0's difference too
    assert SuiteManifest.load(root).model_dump() == before  # nothing moved


@pytest.mark.parametrize(
    "decide, runs, message",
    [
        (
            DECIDE,
            toml_runs({"name": "base", "algo": "grpo", "seed": 1}, {"name": "x", "algo": "grpo"}),
            "each run is an arm",
        ),
        (DECIDE.replace('"base"', '"nope"'), None, "decide.baseline 'nope' is not one of the runs"),
        (DECIDE.replace("seed_sd = 0.05\n", ""), None, "set both or neither"),
        (DECIDE.replace("[0, 1, 2]", "[0, 0]"), None, "lists a seed twice"),
        ("", toml_runs({"name": "a", "algo": "grpo", "round": 1}), "arm and round are set by [decide]"),
    ],
)
def test_a_bad_decide_section_is_refused_in_one_line(decide, runs, message, warm_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_suite(decide_suite(tmp_path, warm_model_dir, decide, runs))


def test_the_report_says_what_was_decided_with_its_compute_and_draws_the_sequences(reference, tmp_path):
    decided = reference
    from grpolab.studies.report.decisions import decision_data, decision_figure, decision_section

    d = decision_data(decided)
    rows = {r["arm"]: r for r in d["arms"]}
    assert (rows["bad"]["decision"], rows["bad"]["round"], rows["bad"]["seeds_run"]) == ("worse", 0, 1)
    assert (rows["same"]["decision"], rows["same"]["round"], rows["same"]["steps_run"]) == ("within", 1, 6)
    assert rows["base"]["decision"] == "baseline" and (d["steps_run"], d["steps_budget"]) == (15, 27)
    text = "\n".join(decision_section(d))
    assert "| bad | worse | 0 | bad - base <= " in text and "| 1/3 | 3/9 |" in text
    assert "Compute: 15 of 27 training steps (44% saved)." in text and "The question is answered." in text
    title, name = decision_figure(d, tmp_path)
    assert (tmp_path / name).stat().st_size > 10_000 and "confidence sequence" in title
    assert decision_data(tmp_path) is None  # not a suite


def test_the_dry_run_plans_the_seeds_and_forecasts_the_compute_from_a_pilot(
    reference, warm_model_dir, tmp_path, capsys
):
    decided = reference
    (tmp_path / "plan").mkdir()
    suite = decide_suite(tmp_path / "plan", warm_model_dir)
    out_root = tmp_path / "never"
    assert main(["suite", "run", str(suite), "--output-root", str(out_root), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "decision plan: 3 arms, 2 comparisons at alpha 0.05 / 2 each, delta 0.15, normal sequence" in said
    widths = next(line for line in said.splitlines() if line.startswith("  half-width:")).split()[1:]
    assert len(widths) == 3 and float(widths[0]) > float(widths[1]) > float(widths[2]) > 0
    assert "budget: 27 training steps; a pilot (--pilot DIR) forecasts" in said and not out_root.exists()
    assert main(["suite", "run", str(suite), "--output-root", str(out_root), "--dry-run", "--pilot", str(decided)]) == 0
    said = capsys.readouterr().out
    bad = next(line for line in said.splitlines() if line.strip().startswith("bad: pilot difference"))
    assert "decided within the budget 100% (worse 100%); expected seeds 1.0 of 3" in bad
    assert "expected compute:" in said and "of 27 training steps" in said
    assert main(["suite", "run", str(suite), "--output-root", str(out_root), "--pilot", str(decided)]) == 2
    assert "--pilot forecasts a decision suite's plan: use it with --dry-run" in capsys.readouterr().out


def test_a_dropped_arm_can_be_run_anyway_and_its_verdict_stays(decided, fake_runs, capsys):
    fake_runs.use(accuracy=ACCURACY)
    before = SuiteManifest.load(decided).decisions
    assert main(["suite", "resume", str(decided), "--run-dropped", "nope"]) == 2
    assert "--run-dropped nope: not an arm of this suite (base, bad, same)" in capsys.readouterr().out
    assert main(["suite", "resume", str(decided), "--run-dropped", "bad"]) == 0
    manifest = SuiteManifest.load(decided)
    assert states(decided)["bad.s1"] == states(decided)["bad.s2"] == "completed"
    assert states(decided)["same.s2"] == "dropped" and manifest.decide["run_anyway"] == ["bad"]
    assert manifest.decisions == before  # recorded decisions read what they read: the new runs change none
    assert "--run-dropped: 2 dropped run(s) of bad queued again" in capsys.readouterr().out
    assert main(["suite", "resume", str(decided)]) == 0  # and a later resume finds the decisions as recorded
