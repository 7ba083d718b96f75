"""A decision suite's rounds (``[decide]``): which runs may start, and the decision after each round.

Round r's runs start once round r - 1 is decided. A round is decided when every run of it that is not dropped
has completed: each comparison's paired differences are read from the runs' final evaluations, item by item on
the items both evaluated (``grpolab.studies.report.runs``), the sequences are updated and the verdicts given
(``grpolab.studies.decision``); the runs of arms that go on no further are dropped, never started. Everything a
decision reads is on disk and everything it decides goes into the manifest in one write, so a suite killed at
any point resumes to the same decisions; ``check`` recomputes the recorded ones before a resume moves anything.
"""

from __future__ import annotations

from pathlib import Path

from grpolab.studies.decision import (
    Question,
    Verdict,
    answered,
    as_record,
    compare,
    going_on,
    judge,
    spread_warnings,
    verdicts_of,
)
from grpolab.studies.manifest import RunRecord, SuiteManifest
from grpolab.studies.report.runs import Outcomes, Run, outcomes, pair
from grpolab.studies.suite.verify import SuiteChanged


class Rounds:
    """The rounds of the decision suite ``manifest`` describes."""

    def __init__(self, manifest: SuiteManifest):
        self.manifest = manifest
        self.question = Question.of(tuple(dict.fromkeys(r.arm for r in manifest.runs)), manifest.decide)
        self.outcomes: dict[str, Outcomes] = {}  # a completed run's final evaluation, read once
        self.at = {(r.arm, r.round): r for r in manifest.runs}
        self.count = 1 + max(r.round for r in manifest.runs)

    def may_start(self, record: RunRecord) -> bool:
        """Round r once round r - 1 is decided; an arm the user runs on anyway (``run_dropped``) at once."""
        return record.round <= len(self.manifest.decisions) or record.arm in self.manifest.decide.get("run_anyway", [])

    def run_dropped(self, arms: list[str]) -> list[str]:
        """Queue the dropped runs of ``arms`` again, recorded as the user's override (their verdicts stay)."""
        unknown = [a for a in arms if a not in self.question.arms]
        if unknown:
            raise ValueError(
                f"--run-dropped {', '.join(unknown)}: not an arm of this suite ({', '.join(self.question.arms)})"
            )
        runs = [r for r in self.manifest.runs if r.arm in arms and r.state == "dropped"]
        for run in runs:
            run.state, run.reason = "queued", "dropped by a decision, run anyway (--run-dropped)"
        self.manifest.decide["run_anyway"] = sorted({*self.manifest.decide.get("run_anyway", []), *arms})
        return [f"--run-dropped: {len(runs)} dropped run(s) of {', '.join(arms)} queued again"]

    def _final(self, record: RunRecord) -> Outcomes:
        if record.name not in self.outcomes:
            self.outcomes[record.name] = outcomes(Run(record.name, Path(record.run_dir), record.state))
        return self.outcomes[record.name]

    def paired_difference(self, a: RunRecord, b: RunRecord) -> float:
        """Run ``a``'s final accuracy minus run ``b``'s, over the items both evaluated (and neither failed)."""
        paired = pair(self._final(a), self._final(b))
        if not paired.shared:
            raise ValueError(f"runs {a.name} and {b.name} share no evaluated item")
        return float((paired.a - paired.b).mean())

    def _differences(self, read: set[str]) -> dict[tuple[str, str], list[float]]:
        """Each comparison's paired differences, round by round, over the runs ``read``."""
        out: dict[tuple[str, str], list[float]] = {}
        for arm, other in self.question.comparisons():
            for r in range(self.count):
                a, b = self.at[(arm, r)], self.at[(other, r)]
                if a.name in read and b.name in read:
                    out.setdefault((arm, other), []).append(self.paired_difference(a, b))
        return out

    def _decision(self, r: int, before: dict[str, Verdict], runs: list[str] | None = None) -> dict:
        """Round ``r``'s decision: it reads the runs the earlier rounds read and ``runs`` (default: round r's
        completed ones; a run of an arm run anyway that completes later is read by no recorded decision)."""
        if runs is None:
            runs = [self.at[(arm, r)].name for arm in self.question.arms if self.at[(arm, r)].state == "completed"]
        read = {name for record in self.manifest.decisions if record["round"] < r for name in record["runs"]}
        comparisons = compare(self.question, self._differences(read | set(runs)))
        verdicts = judge(self.question, comparisons, r, before)
        return {**as_record(r, comparisons, verdicts, runs), "warnings": spread_warnings(self.question, comparisons)}

    @property
    def answered(self) -> bool:
        return bool(self.manifest.decisions) and answered(self._verdicts())

    def _verdicts(self) -> dict[str, Verdict]:
        return verdicts_of(self.manifest.decisions[-1]) if self.manifest.decisions else {}

    def decide(self) -> list[str]:
        """Decide every round whose runs have all ended (completed or dropped), in order; drop the runs the
        decisions need no more. The lines to say; the caller saves the manifest."""
        lines = []
        while len(self.manifest.decisions) < self.count and not self.answered:
            r = len(self.manifest.decisions)
            runs = [self.at[(arm, r)] for arm in self.question.arms]
            if any(run.state not in ("completed", "dropped") for run in runs):
                break
            record = self._decision(r, self._verdicts())
            self.manifest.decisions.append(record)
            lines += self._drop(r, verdicts_of(record)) + [f"decision: {w}" for w in record["warnings"]]
        return lines

    def _drop(self, r: int, verdicts: dict[str, Verdict]) -> list[str]:
        """Drop the queued runs of the arms that go on no further; a line per arm decided at round ``r`` and one
        for what was dropped."""
        lines = [f"round {r}: {v.arm} is {v.status} ({v.evidence})" for v in verdicts.values() if v.round == r]
        done = answered(verdicts)
        on = set(going_on(self.question, verdicts))
        dropped = []
        for arm, verdict in verdicts.items():
            if arm in on or arm in self.manifest.decide.get("run_anyway", []):
                continue
            why = (
                f"the question is answered after round {r}"
                if done
                else f"{arm} is {verdict.status} at round {verdict.round} ({verdict.evidence})"
            )
            for run in (run for (a, k), run in self.at.items() if a == arm and k > r and run.state == "queued"):
                run.state, run.reason = "dropped", f"not needed: {why}"
                dropped.append(run.name)
        if done:
            lines.append(f"round {r}: the question is answered; {len(dropped)} queued run(s) dropped")
        elif dropped:
            lines.append(f"round {r}: {len(dropped)} queued run(s) dropped: {', '.join(dropped)}")
        return lines

    def check(self) -> None:
        """Recompute every recorded decision from the runs on disk; one line per round that differs."""
        problems, before = [], {}
        for record in self.manifest.decisions:
            again = self._decision(record["round"], before, record["runs"])
            if again != record:
                problems.append(
                    f"round {record['round']}: the recorded decision is not what its runs give now "
                    "(a run's evaluation records changed); nothing was started"
                )
            before = verdicts_of(record)
        if problems:
            raise SuiteChanged("\n".join(problems))
