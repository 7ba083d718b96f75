"""Warnings that save a wasted run: detectors over a run's metrics records, each warning raised once.

A ``HealthMonitor`` reads the records a run writes to ``metrics.jsonl`` (a training step's record has
``reward_mean``, an evaluation's ``val/accuracy``) in order, and returns each ``RunWarning`` when it
first fires. Pure (no torch, no files): the trainer feeds it live, a report replays a run's records.

The detectors, their keys and thresholds (``docs/running.md``, "Warnings"):

- ``no_learning_signal``: ``no_signal_steps`` steps in a row where every group's rewards were equal
  (``zero_advantage_group_frac`` 1: advantages 0, updates skipped); also at the end of a run shorter
  than that in which no step had a signal.
- ``format_zero_at_start``: the step-0 evaluation's format rate is 0.
- ``truncation``: more than ``TRUNCATION_LIMIT`` of a step's completions (or an evaluation's) hit
  ``rollout.max_new_tokens``.
- ``ratio_drift``: with one optimizer step per rollout batch the update's ratio is exactly 1 and
  nothing is clipped; a ratio mean off 1 by more than ``RATIO_TOLERANCE``, or a clip fraction above
  ``CLIP_LIMIT``, is the signature of a policy that is not the one that sampled.
- ``kl_runaway``: the mean per-token KL to the reference (0 at the start: the reference is the start
  policy) above ``KL_LIMIT``.
- ``entropy_collapse`` / ``entropy_blowup``: the policy's mean token entropy below
  ``ENTROPY_COLLAPSE`` times the first step's, or above ``ENTROPY_BLOWUP`` times it (and at least
  ``ENTROPY_BLOWUP_NATS`` nats higher).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

TRUNCATION_LIMIT = 0.9
RATIO_TOLERANCE = 1e-3
CLIP_LIMIT = 1e-3
KL_LIMIT = 0.5
ENTROPY_COLLAPSE = 0.1
ENTROPY_BLOWUP = 3.0
ENTROPY_BLOWUP_NATS = 1.0
NO_SIGNAL_STEPS = 5


@dataclass(frozen=True)
class RunWarning:
    """One warning: a stable ``key``, the ``step`` it first fired at, its ``evidence`` (metric -> number),
    what it means (``what``), its likely ``cause`` and the ``setting`` to look at."""

    key: str
    step: int
    evidence: dict[str, float]
    what: str
    cause: str
    setting: str

    def line(self) -> str:
        """The log line (after 'warning: ')."""
        numbers = ", ".join(f"{k} {_number(v)}" for k, v in self.evidence.items())
        return f"[{self.key}] step {self.step}: {self.what} ({numbers}). Likely cause: {self.cause}. Look at: {self.setting}"

    def record(self) -> dict[str, Any]:
        """As summary.json's ``warnings`` list holds it."""
        return asdict(self)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class HealthSettings:
    """What the detectors need of a run's settings: ``single_update`` (one optimizer step per rollout
    batch, the schedule's ``is_single_update``), ``no_signal_steps`` (``warn.no_signal_steps``) and
    ``max_new_tokens`` (for the truncation warning's evidence)."""

    single_update: bool = True
    no_signal_steps: int = NO_SIGNAL_STEPS
    max_new_tokens: int | None = None

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> HealthSettings:
        """From a run's ``config.json`` (a dict; missing fields take their defaults)."""
        algorithm = config.get("algorithm", {})
        return cls(
            single_update=algorithm.get("epochs", 1) * algorithm.get("steps_per_epoch", 1) == 1,
            no_signal_steps=config.get("warn", {}).get("no_signal_steps", NO_SIGNAL_STEPS),
            max_new_tokens=config.get("rollout", {}).get("max_new_tokens"),
        )


@dataclass
class HealthMonitor:
    """Feed it a run's records in order (``record``), then ``finish``; each returns the warnings that fired
    just then, and ``warnings`` holds every one so far (each key once)."""

    settings: HealthSettings = field(default_factory=HealthSettings)
    warnings: list[RunWarning] = field(default_factory=list)
    _streak: list[int] = field(default_factory=list)  # the steps of the current run of steps without signal
    _steps: int = 0
    _signal_seen: bool = False
    _entropy_start: float | None = None
    _last_step: int = 0
    _last_record: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fired(self) -> set[str]:
        return {w.key for w in self.warnings}

    def record(self, record: Mapping[str, Any]) -> list[RunWarning]:
        """One line of metrics.jsonl: a training step's record or an evaluation's (others are ignored)."""
        if "reward_mean" in record:
            found = self._train(record)
        elif "val/accuracy" in record:
            found = self._evaluation(record)
        else:
            return []
        return self._keep(found)

    def replay(self, records: Iterable[Mapping[str, Any]]) -> list[RunWarning]:
        """Every record in order; the warnings that fired."""
        return [w for r in records for w in self.record(r)]

    def restore(self, said: Iterable[Mapping[str, Any]], up_to: int) -> None:
        """Warnings an earlier session already said (summary.json's list; those after step ``up_to``, the
        last step a resume keeps, are dropped): kept, and not said again (one a run's end raised cannot be
        replayed from its records)."""
        for record in said:
            try:
                warning = RunWarning(**{k: record[k] for k in RunWarning.__dataclass_fields__})
            except (KeyError, TypeError):  # a summary.json of another version: its warnings are replayed or lost
                continue
            if warning.step <= up_to and warning.key not in self.fired:
                self.warnings.append(warning)

    def finish(self) -> list[RunWarning]:
        """The run ended: a run shorter than ``no_signal_steps`` in which no step had a signal warns now."""
        if self._steps and not self._signal_seen and len(self._streak) == self._steps:
            return self._keep([self._no_signal(self._last_step, self._last_record)])
        return []

    def _keep(self, found: list[RunWarning | None]) -> list[RunWarning]:
        new = []
        for warning in found:
            if warning is not None and warning.key not in self.fired:
                self.warnings.append(warning)
                new.append(warning)
        return new

    # ---- the detectors ------------------------------------------------------------------------
    def _train(self, r: Mapping[str, Any]) -> list[RunWarning | None]:
        step = r["step"]
        self._steps += 1
        self._last_step, self._last_record = step, r
        # no update either: a signal beside the task's (a distillation teacher's, a KL term) still trains
        no_signal = r.get("zero_advantage_group_frac") == 1 and not r.get("actual_updates")
        self._signal_seen |= not no_signal
        self._streak = [*self._streak, step] if no_signal else []
        found: list[RunWarning | None] = []
        if len(self._streak) >= self.settings.no_signal_steps:
            found.append(self._no_signal(step, r))
        found.append(self._truncation(step, r.get("truncation_rate"), r.get("completion_len_mean"), "train"))
        if self.settings.single_update:
            found.append(self._ratio(step, r))
        found.append(self._kl(step, r))
        found.append(self._entropy(step, r))
        return found

    def _evaluation(self, r: Mapping[str, Any]) -> list[RunWarning | None]:
        step = r["step"]
        found: list[RunWarning | None] = []
        if step == 0 and r.get("val/format_rate") == 0:
            found.append(
                RunWarning(
                    "format_zero_at_start",
                    step,
                    _evidence(r, "val/format_rate", "val/accuracy", "val/truncation_rate"),
                    "no completion of the start model is in the task's answer format",
                    "the prompt or chat template does not match the model (a base model given a chat template, "
                    "an instruct model given a raw prompt, an answer format it does not produce), or every "
                    "completion is cut off",
                    "task.prompt (format, answer, system), task.prompt.chat_template_kwargs, the model",
                )
            )
        found.append(self._truncation(step, r.get("val/truncation_rate"), r.get("val/completion_len_mean"), "eval"))
        return found

    def _no_signal(self, step: int, r: Mapping[str, Any]) -> RunWarning:
        since = self._streak[0] if self._streak else step
        return RunWarning(
            "no_learning_signal",
            step,
            {
                "steps_in_a_row": len(self._streak),
                "since_step": since,
                **_evidence(r, "zero_advantage_group_frac", "reward_mean", "total_actual_updates"),
            },
            f"every group's samples got the same reward for {len(self._streak)} steps in a row: advantages are 0 "
            "and the updates were skipped, so the policy did not change",
            "the task is out of reach (every answer wrong, or never in the answer format) or too easy (every "
            "answer right)",
            "the step-0 evaluation's format rate, task.prompt, an easier task or a warm start, "
            "rollout.group_size (more samples per prompt)",
        )

    def _truncation(self, step: int, rate: float | None, length: float | None, where: str) -> RunWarning | None:
        if rate is None or rate <= TRUNCATION_LIMIT:
            return None
        evidence = {f"{where}_truncation_rate": rate}
        if length is not None:
            evidence["completion_len_mean"] = length
        if self.settings.max_new_tokens is not None:
            evidence["max_new_tokens"] = self.settings.max_new_tokens
        return RunWarning(
            "truncation",
            step,
            evidence,
            f"more than {TRUNCATION_LIMIT:.0%} of the completions hit the token limit (a truncated completion gets "
            "no format reward)",
            "max_new_tokens too small for the task, or a model that never stops (no EOS or stop string produced)",
            "rollout.max_new_tokens, rollout.stop_strings",
        )

    def _ratio(self, step: int, r: Mapping[str, Any]) -> RunWarning | None:
        ratio = r.get("first_update/ratio_mean", r.get("ratio_mean"))
        clip = r.get("first_update/clip_frac", r.get("clip_frac"))
        off = ratio is not None and abs(ratio - 1) > RATIO_TOLERANCE
        clipped = clip is not None and clip > CLIP_LIMIT
        if not (off or clipped):
            return None
        evidence = {"ratio_mean": ratio} if ratio is not None else {}
        if clip is not None:
            evidence["clip_frac"] = clip
        return RunWarning(
            "ratio_drift",
            step,
            evidence,
            "one optimizer step per rollout batch, yet the update's ratio is not 1 (or tokens were clipped): "
            "the policy that trained is not the one that sampled",
            "a missed or partial weight sync to the engine, or a training forward that differs from sampling "
            "(dropout, precision, temperature)",
            "the sync/ metrics and rollout.sync_check, model.lora.dropout, model.dtype, rollout.temperature",
        )

    def _kl(self, step: int, r: Mapping[str, Any]) -> RunWarning | None:
        kl = r.get("kl_ref")
        if kl is None or kl <= KL_LIMIT:
            return None
        return RunWarning(
            "kl_runaway",
            step,
            {"kl_ref": kl, "limit": KL_LIMIT},
            "the policy ran far from its reference (the start policy, KL 0 at the start)",
            "a learning rate too high for the model, or a KL penalty too weak to hold it",
            "optim.lr, algorithm.beta, optim.max_grad_norm",
        )

    def _entropy(self, step: int, r: Mapping[str, Any]) -> RunWarning | None:
        entropy = r.get("entropy")
        if entropy is None:
            return None
        if self._entropy_start is None:
            self._entropy_start = entropy
            return None
        start = self._entropy_start
        evidence = {"entropy": entropy, "entropy_start": start}
        if entropy < ENTROPY_COLLAPSE * start:
            return RunWarning(
                "entropy_collapse",
                step,
                evidence,
                f"the policy's token entropy fell below {ENTROPY_COLLAPSE:g} of its start: it samples nearly one "
                "answer per prompt, so groups stop differing and learning stalls",
                "a learning rate too high, or a clip range that lets probable tokens grow unchecked",
                "optim.lr, algorithm.eps_high (clip-higher), rollout.temperature",
            )
        if entropy > ENTROPY_BLOWUP * start and entropy > start + ENTROPY_BLOWUP_NATS:
            return RunWarning(
                "entropy_blowup",
                step,
                evidence,
                f"the policy's token entropy rose above {ENTROPY_BLOWUP:g} times its start: it is becoming noise",
                "a learning rate too high, or updates that push improbable tokens up (a clip range too wide)",
                "optim.lr, optim.max_grad_norm, algorithm.eps_high",
            )
        return None


def _evidence(r: Mapping[str, Any], *keys: str) -> dict[str, float]:
    return {k: r[k] for k in keys if r.get(k) is not None}


def run_warnings(records: Iterable[Mapping[str, Any]], settings: HealthSettings, ended: bool) -> list[RunWarning]:
    """Every warning of a run's records (``ended``: the run ended, so ``finish`` runs too)."""
    monitor = HealthMonitor(settings)
    monitor.replay(records)
    if ended:
        monitor.finish()
    return monitor.warnings
