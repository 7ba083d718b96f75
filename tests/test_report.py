"""``grpolab report`` / ``compare`` on real runs: the numbers in report.md equal the files they summarise,
figures are real PNGs, unfinished runs are reported as such, and bad input is one error line."""

from __future__ import annotations

import json
import os
import shutil
from math import comb
from pathlib import Path

import numpy as np
import pytest
from conftest import TASK, quick_config
from matplotlib import image

from grpolab.commands.cli import main
from grpolab.common.provenance import code_commit, cpu_description, describe_cpu
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import train
from grpolab.studies.manifest import RunRecord, SuiteManifest
from grpolab.studies.report.markdown import num
from grpolab.tasks import make_task

# name -> (algorithm, seed, overrides, factors)
RUNS = {
    "a": ("grpo", 0, {"eval.pass_k": [1, 2, 4], "eval.pass_n": 4}, {"norm": "std", "agg": "seq"}),
    "b": ("grpo", 1, {}, {"norm": "std", "agg": "seq"}),
    "c": ("dr_grpo", 0, {}, {"norm": "none", "agg": "const"}),
    "d": ("grpo_constant", 0, {}, {"norm": "std", "agg": "const"}),
    "e": ("grpo", 0, {"algorithm.normalizer": "none"}, {"norm": "none", "agg": "seq"}),
}


@pytest.fixture(scope="module")
def runs(warm_model_dir, tmp_path_factory) -> Path:
    """Five real 4-step runs (evaluations at 0, 2, 4) in one folder."""
    root = tmp_path_factory.mktemp("report") / "runs"
    for name, (algo, seed, overrides, _) in RUNS.items():
        train(
            quick_config(
                warm_model_dir, root / name, seed=seed, steps=4, threads=1, **{"algorithm.name": algo}, **overrides
            )
        )
    return root


def records(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def md_table(text: str, first_header: str) -> dict[str, list[str]]:
    """Rows of the markdown table whose header starts with ``first_header``, by their first cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def mcnemar_reference(only_a: int, only_b: int) -> float:
    n = only_a + only_b
    return 1.0 if n == 0 else min(1.0, 2 * sum(comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n)


def test_report_numbers_equal_the_metrics_and_records(runs):
    assert main(["report", str(runs), "--baseline", "a"]) == 0
    text = (runs / "report" / "report.md").read_text()
    table = md_table(text, "run")
    assert set(table) == set(RUNS)
    for name in RUNS:
        metrics = read_metrics(runs / name / "metrics.jsonl")
        evals = {r["step"]: r for r in metrics if "val/accuracy" in r}
        train_records = [r for r in metrics if "reward_mean" in r]
        best_step = max(evals, key=lambda s: (evals[s]["val/accuracy"], -s))
        summary = json.loads((runs / name / "summary.json").read_text())
        _, state, algo, seed, steps, start, final, best, fmt, length, trunc, updates, tokens, _ = table[name]
        assert (state, algo, seed, steps) == ("completed", RUNS[name][0], str(RUNS[name][1]), "4/4")
        assert start == f"{evals[0]['val/accuracy']:.3f}" and final == f"{evals[4]['val/accuracy']:.3f}"
        assert best == f"{evals[best_step]['val/accuracy']:.3f} ({best_step})"
        assert fmt == f"{evals[4]['val/format_rate']:.3f}" and length == f"{evals[4]['val/completion_len_mean']:.1f}"
        assert trunc == f"{evals[4]['val/truncation_rate']:.3f}"
        assert updates == f"{summary['updates']['actual']}/{summary['updates']['attempted']}"
        assert tokens == str(sum(r["response_tokens"] for r in train_records))
        # and the records agree with the metrics they were summarised into
        assert f"{np.mean([r['correct'] for r in records(runs / name, 4)]):.3f}" == final

    comparisons = md_table(text, "run | step")
    data = json.loads((runs / "report" / "report.json").read_text())
    base = {r["id"]: r["correct"] for r in records(runs / "a", 4)}
    p_values = {}
    for name in "bcde":
        mine = {r["id"]: r["correct"] for r in records(runs / name, 4)}
        a, b = np.array([mine[i] for i in base], float), np.array([base[i] for i in base], float)
        only_run, only_base = int(np.sum((a == 1) & (b == 0))), int(np.sum((a == 0) & (b == 1)))
        row = comparisons[name]
        assert row[1:6] == [
            "4 vs 4",
            str(len(base)),
            f"{a.mean():.3f}",
            f"{b.mean():.3f}",
            f"{a.mean() - b.mean():+.3f}",
        ]
        assert row[7:9] == [str(only_run), str(only_base)]
        assert row[9] == f"{mcnemar_reference(only_run, only_base):.3g}"
        p_values[name] = mcnemar_reference(only_run, only_base)
        c = next(c for c in data["comparisons"] if c["run"] == name)
        assert row[6] == f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]" and c["ci_low"] <= c["difference"] <= c["ci_high"]
    learned = md_table(text, "run | steps")  # each run's last evaluation against its start, paired
    for name in RUNS:
        start = {r["id"]: r["correct"] for r in records(runs / name, 0)}
        end = {r["id"]: r["correct"] for r in records(runs / name, 4)}
        gained, lost = sum(end[i] and not start[i] for i in start), sum(start[i] and not end[i] for i in start)
        assert learned[name][1:6] == [
            "0 -> 4",
            str(len(start)),
            f"{np.mean(list(start.values())):.3f}",
            f"{np.mean(list(end.values())):.3f}",
            f"{np.mean(list(end.values())) - np.mean(list(start.values())):+.3f}",
        ]
        assert learned[name][7:] == [str(gained), str(lost), f"{mcnemar_reference(gained, lost):.3g}"]
    # Holm: the k-th smallest of m p-values times (m - k + 1), made non-decreasing, capped at 1
    ranked = sorted(p_values, key=p_values.get)
    holm_p = {n: min(1.0, max((4 - j) * p_values[ranked[j]] for j in range(ranked.index(n) + 1))) for n in ranked}
    assert {n: comparisons[n][10] for n in "bcde"} == {n: f"{holm_p[n]:.3g}" for n in "bcde"}
    assert "do not cover training-seed variance" in text


def test_the_report_says_when_where_and_on_what_code_each_run_ran(runs):
    assert main(["report", str(runs), "--baseline", "a"]) == 0
    text = (runs / "report" / "report.md").read_text()
    where = md_table(text[text.index("Where and when") :], "run")
    assert set(where) == set(RUNS)
    for name in RUNS:
        manifest = json.loads((runs / name / "manifest.json").read_text())
        _, started, commit, cpu, device, versions = where[name]
        assert started == manifest["started"] and device == "cpu"
        assert commit == (code_commit() or "-")
        assert cpu == describe_cpu(cpu_description()) != "-"
        assert versions == f"{manifest['torch']} / {manifest['transformers']}"


def test_seed_groups_pass_at_k_and_failures_come_from_the_records(runs):
    main(["report", str(runs)])
    data = json.loads((runs / "report" / "report.json").read_text())
    (group,) = data["seed_groups"]  # a and b: the same settings at seeds 0 and 1 (e differs in its normalizer)
    finals = [np.mean([r["correct"] for r in records(runs / n, 4)]) for n in ("a", "b")]
    assert group["runs"] == ["a", "b"] and group["mean"] == pytest.approx(np.mean(finals))
    assert (group["step"], group["items"], group["stopped_early"]) == (4, len(records(runs / "a", 4)), [])
    assert group["std"] == pytest.approx(np.std(finals, ddof=1))
    curves = data["pass_at_k"]["a"]
    assert set(curves) == {"0", "4"} and set(curves["4"]) == {"1", "2", "4"}
    counts = [r["pass_correct"] for r in records(runs / "a", 4)]
    assert curves["4"]["1"] == pytest.approx(np.mean(counts) / 4)
    assert curves["4"]["4"] == pytest.approx(np.mean([c > 0 for c in counts]))
    questions = {e.id: e.question for e in make_task("arithmetic", **TASK).validation_examples()}
    for name, kinds in data["failures"].items():
        last = {r["id"]: r for r in records(runs / name, 4)}
        for record in kinds["wrong answer"]:
            assert record.pop("question") == questions[record["id"]]
            assert last[record["id"]] == record and record["format_ok"] and not record["correct"]


def test_figures_are_real_pngs_with_content(runs):
    main(["report", str(runs)])
    text = (runs / "report" / "report.md").read_text()
    pngs = sorted((runs / "report").glob("*.png"))
    names = {p.name for p in pngs}
    assert {
        "val_accuracy.png",
        "reward.png",
        "differences.png",
        "phase_seconds.png",
        "pass_at_k.png",
        "entropy.png",
        "grad_norm.png",
    } <= names
    # one update per batch: every ratio is 1 and nothing is clipped, which a flat figure would only hide
    assert not {"clip_fraction.png", "ratio_mean.png"} & names
    assert "- clip fraction (low + high): 0 at every step of all 5 runs (no figure)" in text
    assert "- importance ratio (mean): 1 at every step of all 5 runs (no figure)" in text
    assert json.loads((runs / "report" / "report.json").read_text())["figure_notes"] == [
        line.removeprefix("- ")
        for line in text.split("Not drawn, as a figure would show nothing more:")[1].split("\n\n")[1].splitlines()
    ]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in text
        pixels = image.imread(png)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400
        colours = np.unique(pixels.reshape(-1, pixels.shape[-1]).round(2), axis=0)
        assert len(colours) > 20  # lines, text and bands, not a blank canvas


def suite_dir(runs: Path, root: Path) -> Path:
    """A suite directory over the real runs, as the runner leaves it mid-queue: e still running (torn
    last metrics line, no summary, its last evaluation not written yet), one failed, one queued."""
    root.mkdir()
    shutil.copytree(runs / "e", root / "e")
    (root / "e" / "summary.json").unlink()
    (root / "e" / "eval" / "step_000004.jsonl").unlink()
    lines = (root / "e" / "metrics.jsonl").read_text().splitlines()
    (root / "e" / "metrics.jsonl").write_text("\n".join(lines[:-2]) + '\n{"step": 4, "rew')
    record = dict(config_file="x", config_sha256="x")
    manifest = SuiteManifest(
        suite="fixture",
        source_file="x",
        runs=[
            *[
                RunRecord(name=n, run_dir=str(runs / n), state="completed", factors=RUNS[n][3], **record)
                for n in "abcd"
            ],
            RunRecord(
                name="e", run_dir=str(root / "e"), state="running", pid=os.getpid(), factors=RUNS["e"][3], **record
            ),
            RunRecord(name="f", run_dir=str(root / "f"), state="failed", reason="error: out of memory", **record),
            RunRecord(name="g", run_dir=str(root / "g"), **record),
            RunRecord(name="h", run_dir=str(root / "h"), state="running", pid=None, **record),
        ],
    )
    manifest.save(root)
    return root


def test_a_suite_with_running_failed_and_queued_runs_is_reported_as_such(runs, tmp_path):
    root = suite_dir(runs, tmp_path / "suite")
    assert main(["report", str(root)]) == 0
    text = (root / "report" / "report.md").read_text()
    assert "e is running" in text and "f is failed (error: out of memory)" in text and "g is queued" in text
    assert "h is running (process gone: suite resume)" in text
    table = md_table(text, "run")
    assert (
        table["e"][4] == "3/4"
        and table["e"][6] == f"{np.mean([r['correct'] for r in records(root / 'e', 2)]):.3f} (step 2)"
    )
    assert table["f"][4] == "0/-" or table["f"][5:8] == ["-", "-", "-"]
    assert "- f: no evaluation records yet" in text and "- g: no evaluation records yet" in text
    assert "run e: 1 unreadable line skipped" in text  # its torn last metrics line
    # the 2x2: cells std x seq (a, b), std x const (d), none x const (c), none x seq (e, stopped after its
    # evaluation at step 2): every cell at step 2, the latest step all of them evaluated
    data = json.loads((root / "report" / "report.json").read_text())
    f = data["factorial"]
    assert (f["step"], f["stopped_early"]) == (2, ["e"]) and "e last evaluated at step 2 of 4" in text
    cell = {n: np.array([r["correct"] for r in records(root / n if n == "e" else runs / n, 2)], float) for n in "abcde"}
    y00, y01, y10, y11 = (cell["a"] + cell["b"]) / 2, cell["d"], cell["e"], cell["c"]
    assert f["interaction"]["estimate"] == pytest.approx(np.mean((y11 - y01) - (y10 - y00)), abs=1e-12)
    assert f["cell_accuracy"] == pytest.approx(
        {"std x seq": y00.mean(), "std x const": y01.mean(), "none x seq": y10.mean(), "none x const": y11.mean()}
    )
    assert f"{num(f['interaction']['estimate'], '+.3f')} | [{num(f['interaction']['low'], '+.3f')}" in text
    assert main(["report", str(root)]) == 0  # a second report replaces the first
    assert not list(root.glob(".report-*"))


def test_compare_prints_the_paired_difference_ci_and_p(runs, capsys):
    assert main(["compare", str(runs / "b"), str(runs / "a")]) == 0
    out = capsys.readouterr().out
    a = {r["id"]: r["correct"] for r in records(runs / "a", 4)}
    b = {r["id"]: r["correct"] for r in records(runs / "b", 4)}
    only_b, only_a = sum(b[i] and not a[i] for i in a), sum(a[i] and not b[i] for i in a)
    assert f"difference {np.mean(list(b.values())) - np.mean(list(a.values())):+.3f}, 95% CI [" in " ".join(out.split())
    assert f"McNemar exact p = {mcnemar_reference(only_b, only_a):.3g}" in " ".join(out.split())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["report", "{empty}"], "not a suite directory"),
        (["report", "{runs}", "--baseline", "zz"], "--baseline 'zz' is not a run here"),
        (["report", "{runs}", "--resamples", "999"], "at least 10,000"),
        (["compare", "{runs}/a", "{empty}"], "not a run directory"),
        (["report", "{runs}", "--runs", "a", "zz*"], "--runs 'zz*' matches no run here"),
        (["report", "{runs}", "--runs", "c*", "--baseline", "a"], "--baseline 'a' is not a run here"),
    ],
)
def test_bad_input_is_one_error_line(runs, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    before = sorted(p.name for p in runs.iterdir())
    argv = [a.format(empty=tmp_path / "empty", runs=runs) for a in argv]
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert out.count("error:") == 1 and message in " ".join(out.split())
    assert sorted(p.name for p in runs.iterdir()) == before


def test_a_subset_report_covers_only_its_runs_and_leaves_the_whole_report(runs):
    assert main(["report", str(runs)]) == 0
    whole = (runs / "report" / "report.md").read_text()
    assert main(["report", str(runs), "--runs", "d", "[bc]"]) == 0
    subset = runs / "report-d+_bc_"
    text = (subset / "report.md").read_text()
    assert set(md_table(text, "run")) == {"b", "c", "d"}  # in the folder's order, baseline the first: b
    assert set(md_table(text, "run | step")) == {"c", "d"}
    data = json.loads((subset / "report.json").read_text())
    assert data["baseline"] == "b" and "b, c, d" in data["title"]
    assert (runs / "report" / "report.md").read_text() == whole  # the whole directory's report is untouched
    assert main(["report", str(runs)]) == 0  # and a later whole report does not take the subset for a run
    assert set(md_table((runs / "report" / "report.md").read_text(), "run")) == set(RUNS)


def test_tensorboard_scalars_equal_the_metrics(warm_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(quick_config(warm_model_dir, tmp_path / "run", threads=1, **{"log.tensorboard": True}))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for key in ("reward_mean", "val/accuracy", "grad_norm"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert logged == pytest.approx({r["step"]: r[key] for r in metrics if r.get(key) is not None}, rel=1e-6)
