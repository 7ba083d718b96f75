"""The run's warnings (grpolab.run.health) on synthetic metrics records: each detector fires once, at the step
it first shows, with its numbers, and stays quiet on a healthy run."""

from __future__ import annotations

from grpolab.run.health import (
    CLIP_LIMIT,
    KL_LIMIT,
    HealthMonitor,
    HealthSettings,
    run_warnings,
)


def step(n: int, **changes) -> dict:
    """A healthy training step's record (the keys rl_step writes that the detectors read)."""
    return {
        "step": n,
        "reward_mean": 0.5,
        "zero_advantage_group_frac": 0.25,
        "truncation_rate": 0.0,
        "completion_len_mean": 20.0,
        "ratio_mean": 1.0,
        "clip_frac": 0.0,
        "first_update/ratio_mean": 1.0,
        "first_update/clip_frac": 0.0,
        "entropy": 1.0,
        "kl_ref": 0.0,
        "total_actual_updates": n,
        **changes,
    }


def evaluation(n: int, **changes) -> dict:
    return {
        "step": n,
        "val/accuracy": 0.5,
        "val/format_rate": 1.0,
        "val/truncation_rate": 0.0,
        "val/completion_len_mean": 20.0,
        **changes,
    }


DEAD = {"zero_advantage_group_frac": 1.0, "reward_mean": 0.0, "total_actual_updates": 0}


def keys(warnings) -> list[str]:
    return [w.key for w in warnings]


def test_a_healthy_run_warns_of_nothing():
    records = [evaluation(0), *(step(n) for n in range(1, 21)), evaluation(20)]
    assert run_warnings(records, HealthSettings(), ended=True) == []
    # a multi-update schedule's ratio drifts and clips by design: no ratio warning there
    drifting = [step(n, ratio_mean=1.5, clip_frac=0.5, **{"first_update/ratio_mean": 1.5}) for n in (1, 2)]
    assert run_warnings(drifting, HealthSettings(single_update=False), ended=True) == []


def test_no_signal_fires_once_at_the_kth_step_in_a_row():
    monitor = HealthMonitor(HealthSettings(no_signal_steps=3))
    fired = {}
    # two dead steps, a live one (the streak restarts), then five dead ones
    for n, dead in enumerate([True, True, False, True, True, True, True, True], start=1):
        for w in monitor.record(step(n, **DEAD) if dead else step(n)):
            fired.setdefault(w.key, []).append(w)
    assert list(fired) == ["no_learning_signal"] and len(fired["no_learning_signal"]) == 1
    (w,) = fired["no_learning_signal"]
    assert w.step == 6 and w.evidence["steps_in_a_row"] == 3 and w.evidence["since_step"] == 4
    assert w.evidence["zero_advantage_group_frac"] == 1 and w.evidence["total_actual_updates"] == 0
    assert "group_size" in w.setting and "task.prompt" in w.setting
    assert monitor.finish() == [] and keys(monitor.warnings) == ["no_learning_signal"]


def test_no_signal_in_a_run_shorter_than_k_warns_at_its_end_only_when_no_step_had_one():
    monitor = HealthMonitor(HealthSettings(no_signal_steps=5))
    assert monitor.replay([step(1, **DEAD), step(2, **DEAD)]) == []  # not yet k steps
    (w,) = monitor.finish()
    assert w.key == "no_learning_signal" and w.step == 2 and w.evidence["steps_in_a_row"] == 2
    # one step with a signal: a short run that learned something is not warned
    assert run_warnings([step(1), step(2, **DEAD)], HealthSettings(no_signal_steps=5), ended=True) == []
    # a run replayed before its end (a report of a running run) does not warn of its end
    assert run_warnings([step(1, **DEAD)], HealthSettings(no_signal_steps=5), ended=False) == []


def test_format_zero_only_at_the_step_zero_evaluation():
    (w,) = run_warnings([evaluation(0, **{"val/format_rate": 0.0, "val/accuracy": 0.0})], HealthSettings(), True)
    assert w.key == "format_zero_at_start" and w.step == 0 and w.evidence["val/format_rate"] == 0
    assert "task.prompt" in w.setting and "chat_template" in w.setting
    assert run_warnings([evaluation(10, **{"val/format_rate": 0.0})], HealthSettings(), True) == []
    assert run_warnings([evaluation(0, **{"val/format_rate": 0.25})], HealthSettings(), True) == []


def test_truncation_above_ninety_percent_in_training_or_evaluation():
    settings = HealthSettings(max_new_tokens=48)
    (w,) = run_warnings([step(1), step(2, truncation_rate=0.95, completion_len_mean=48.0)], settings, True)
    assert w.key == "truncation" and w.step == 2
    assert w.evidence == {"train_truncation_rate": 0.95, "completion_len_mean": 48.0, "max_new_tokens": 48}
    assert "rollout.max_new_tokens" in w.setting and "rollout.stop_strings" in w.setting
    (w,) = run_warnings([evaluation(0, **{"val/truncation_rate": 1.0})], settings, True)
    assert w.key == "truncation" and w.step == 0 and w.evidence["eval_truncation_rate"] == 1
    assert run_warnings([step(1, truncation_rate=0.9)], settings, True) == []  # at the limit: quiet
    # once: a later truncated step adds nothing
    assert len(run_warnings([step(n, truncation_rate=1.0) for n in (1, 2, 3)], settings, True)) == 1


def test_ratio_off_one_or_clipping_in_a_one_update_schedule():
    (w,) = run_warnings([step(1), step(2, **{"first_update/ratio_mean": 1.25})], HealthSettings(), True)
    assert w.key == "ratio_drift" and w.step == 2 and w.evidence["ratio_mean"] == 1.25
    assert "sync" in w.setting
    clipped = step(3, **{"first_update/clip_frac": 2 * CLIP_LIMIT})
    (w,) = run_warnings([step(1), clipped], HealthSettings(), True)
    assert w.key == "ratio_drift" and w.step == 3 and w.evidence["clip_frac"] == 2 * CLIP_LIMIT
    # a step whose update was skipped has no ratio: nothing to judge
    skipped = {k: v for k, v in step(1).items() if "ratio" not in k and "clip" not in k}
    assert run_warnings([skipped], HealthSettings(), True) == []


def test_kl_runaway_above_its_limit():
    (w,) = run_warnings([step(1), step(2, kl_ref=2 * KL_LIMIT)], HealthSettings(), True)
    assert w.key == "kl_runaway" and w.step == 2 and w.evidence == {"kl_ref": 2 * KL_LIMIT, "limit": KL_LIMIT}
    assert "algorithm.beta" in w.setting
    assert run_warnings([step(1, kl_ref=KL_LIMIT)], HealthSettings(), True) == []
    without_reference = {k: v for k, v in step(1).items() if k != "kl_ref"}
    assert run_warnings([without_reference], HealthSettings(), True) == []


def test_entropy_collapse_and_blowup_against_the_first_step():
    (w,) = run_warnings([step(1, entropy=2.0), step(2, entropy=1.0), step(3, entropy=0.125)], HealthSettings(), True)
    assert w.key == "entropy_collapse" and w.step == 3 and w.evidence == {"entropy": 0.125, "entropy_start": 2.0}
    (w,) = run_warnings([step(1, entropy=1.0), step(2, entropy=4.5)], HealthSettings(), True)
    assert w.key == "entropy_blowup" and w.step == 2
    # 3x a tiny start is not a blow-up: it must also rise by a nat
    assert run_warnings([step(1, entropy=0.25), step(2, entropy=1.0)], HealthSettings(), True) == []
    assert run_warnings([step(1, entropy=1.0), step(2, entropy=0.25)], HealthSettings(), True) == []


def test_each_warning_fires_once_and_says_what_cause_and_setting():
    bad = {**DEAD, "truncation_rate": 1.0, "kl_ref": 1.0, "first_update/ratio_mean": 2.0}
    monitor = HealthMonitor(HealthSettings(no_signal_steps=2))
    first = monitor.record(evaluation(0, **{"val/format_rate": 0.0}))
    later = [monitor.record(step(n, **bad)) for n in (1, 2, 3)]
    assert keys(first) == ["format_zero_at_start"]
    assert keys(later[0]) == ["truncation", "ratio_drift", "kl_runaway"]
    assert keys(later[1]) == ["no_learning_signal"] and later[2] == []
    for w in monitor.warnings:
        line = w.line()
        assert line.startswith(f"[{w.key}] step {w.step}: ") and "Likely cause: " in line and "Look at: " in line
        assert set(w.record()) == {"key", "step", "evidence", "what", "cause", "setting"}


def test_settings_from_a_config_json():
    config = {"algorithm": {"epochs": 1, "steps_per_epoch": 32}, "warn": {"no_signal_steps": 7}}
    assert HealthSettings.of_config(config) == HealthSettings(single_update=False, no_signal_steps=7)
    assert HealthSettings.of_config({"rollout": {"max_new_tokens": 9}}) == HealthSettings(max_new_tokens=9)


def test_a_resume_keeps_what_an_earlier_session_said_up_to_its_checkpoint():
    said = [w.record() for w in run_warnings([step(1, **DEAD), step(2, **DEAD)], HealthSettings(), ended=True)]
    monitor = HealthMonitor(HealthSettings(no_signal_steps=5))
    monitor.replay([step(1, **DEAD), step(2, **DEAD)])
    monitor.restore([*said, {"key": "half a record"}], up_to=2)
    assert keys(monitor.warnings) == ["no_learning_signal"]
    assert monitor.record(step(3, **DEAD)) == [] and monitor.finish() == []  # not said again
    # a warning of a step after the checkpoint the resume continues from is dropped (that step is redone)
    fresh = HealthMonitor(HealthSettings(no_signal_steps=5))
    fresh.restore(said, up_to=1)
    assert fresh.warnings == []
