"""One RL step over a run's parts: rollout -> reward -> group advantage -> update -> sync, and its record."""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import mean
from typing import Any

from grpolab.common.progress import format_seconds
from grpolab.rollout.collect import RolloutBatch
from grpolab.rollout.failures import FAILED, check_failure_rate, failure_metrics
from grpolab.rollout.multiturn import tool_metrics
from grpolab.rollout.pipeline import staleness_metrics
from grpolab.run.parts import RunParts
from grpolab.tasks.base import Grade
from grpolab.tasks.shaping import SHAPING_TERMS


def rl_step(
    parts: RunParts,
    step: int,
    status: Callable[[str], None] = lambda _: None,
    on_rollout: Callable[[RolloutBatch], None] | None = None,
) -> dict[str, Any]:
    """One rollout batch through the loop; returns its metrics record (``metrics.jsonl``'s step line).
    ``status`` hears the phase it enters (generate, update, sync); ``on_rollout`` gets the step's rollout
    batch once the update is done (``completion_rows``)."""
    t0 = time.perf_counter()
    status("generate")
    rollout = parts.rollouts.batch(step)  # 1. rollout + 2. reward (generated now, or ahead when async)
    grades = [g for group in rollout.grades for g in group]
    failed = [(g.failure, g.error) for g in grades if not g.ok]
    check_failure_rate(failed, len(grades), parts.cfg.rollout.max_failure_rate, f"step {step}")  # before the update
    t1 = time.perf_counter()
    status("update")
    metrics = parts.learner.learn(rollout)  # 3. group advantages + 4. policy update
    t2 = time.perf_counter()
    if on_rollout is not None:
        on_rollout(rollout)
    status("sync")
    parts.rollouts.publish(parts.sync_source(), step)  # 5. sync the new weights to the engine
    t3 = time.perf_counter()
    flat = rollout.flat()
    valid = [g for g in grades if g.ok]  # a failed sample's rewards are unknown
    tokens = sum(len(c.completion_ids) for c in flat)
    record = {
        "step": step,
        **metrics,
        "accuracy": mean(g.answer_reward for g in valid) if valid else float("nan"),
        "format_rate": mean(g.format_reward for g in valid) if valid else float("nan"),
        "response_tokens": tokens,
        "completion_len_mean": tokens / len(flat),
        "truncation_rate": mean(c.truncated for c in flat),
        "rollout_rounds": rollout.rounds,
        "total_attempted_updates": parts.state.updates["attempted"],
        "total_actual_updates": parts.state.updates["actual"],
        "time/generate": rollout.seconds["generate"],
        "time/reward": rollout.seconds["reward"],
        "time/train": t2 - t1,
        "time/sync": t3 - t2,
        "time/step": t3 - t0,
        "tokens_per_s": tokens / rollout.seconds["generate"],
        **reward_components(grades),
        **failure_metrics(grades),
    }
    if parts.rollouts.max_staleness:  # async: how stale the batch was, and how long the learner waited for it
        record.update(staleness_metrics(rollout, step, parts.rollouts.max_staleness))
        record["time/wait_rollout"] = rollout.seconds["wait"]
    if parts.reward_models is not None:
        record.update(parts.reward_models.metrics(grades))
    if parts.toolset is not None:
        record.update(tool_metrics(flat, [g.answer_reward > 0 for g in grades]))
    return record


def completion_rows(parts: RunParts, rollout: RolloutBatch, limit: int) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows): a table of the step's sampled completions for the trackers, one row per completion of
    its first prompt groups (whole groups, at most ``limit`` rows but at least one group): the group, prompt,
    completion, RL reward and advantage, answer and format rewards, each reward term, length, truncation, the
    policy version that sampled it, and its failure kind (empty when it did not fail: then its rewards are
    unknown, and its advantage 0)."""
    _, advantages, _ = parts.learner.advantages(rollout)  # [B, G]: what the update used (recomputed, exact)
    group_size = max(len(group) for group in rollout.completions)
    groups = max(1, limit // group_size)
    terms = list(
        dict.fromkeys(name for group in rollout.grades[:groups] for grade in group for name, _ in grade.components)
    )
    columns = ["group", "prompt", "completion", "reward", "advantage", "answer_reward", "format_reward"]
    columns += [f"reward/{name}" for name in terms] + ["length", "truncated", "policy_version", "failed"]
    rows = []
    for i, (example, completions, grades) in enumerate(
        zip(rollout.examples[:groups], rollout.completions[:groups], rollout.grades[:groups])
    ):
        prompt = parts.task.prompt(example)
        for j, (completion, grade) in enumerate(zip(completions, grades)):
            values = dict(grade.components)
            rows.append(
                [i, prompt, completion.text, grade.reward, float(advantages[i, j]), grade.answer_reward]
                + [grade.format_reward, *(values.get(name) for name in terms)]
                + [len(completion.completion_ids), completion.truncated, completion.policy_version]
                + [grade.failure or ""]
            )
    return columns, rows


def reward_components(grades: list[Grade]) -> dict[str, float]:
    """``reward/<name>``: the mean unweighted value of each named reward term (a task's reward functions,
    length shaping) over the samples that did not fail, and ``reward/<name>_failed``: how many samples that term
    failed on."""
    values: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    for grade in grades:
        for name, value in grade.components if grade.ok else ():
            values.setdefault(name, []).append(value)
        for name in grade.failed:
            failed[name] = failed.get(name, 0) + 1
    out = {f"reward/{name}": mean(v) for name, v in values.items()}
    for name in {*failed, *(n for n in values if n not in SHAPING_TERMS)}:
        out[f"reward/{name}_failed"] = failed.get(name, 0)
    return out


def vital_signs(record: dict[str, Any], steps: int, seconds_left: float) -> str:
    """One log line of a step's vital signs (KL only when a reference exists, the KL to a distillation teacher
    only with one, grad norm only when an optimizer step ran, tool calls only with tools, routing only for an
    MoE policy)."""

    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    parts = [
        f"step {record['step']}/{steps}",
        f"reward {num('reward_mean', '.3f')}",
        f"acc {num('accuracy', '.3f')}",
        f"adv_std {num('advantage_std', '.3f')}",
    ]
    if "kl_ref" in record:
        parts.append(f"kl {num('kl_ref', '.4f')}")
    if "teacher_kl" in record:  # on-policy distillation: the sampled reverse KL to the teacher
        parts.append(f"teacher_kl {num('teacher_kl', '.4f')}")
    clip = record.get("clip_low_frac", 0.0) + record.get("clip_high_frac", 0.0)
    parts += [
        f"clip {clip:.3f}",
        f"ratio {num('ratio_mean', '.3f')}",
        f"len {num('completion_len_mean', '.1f')}",
        f"trunc {num('truncation_rate', '.2f')}",
        f"gnorm {num('grad_norm', '.3f')}",
        f"{record['time/step']:.1f} s/step",
        f"~{format_seconds(seconds_left)} left",
    ]
    if "router/load_max_violation" in record:  # an MoE policy
        mismatch = f" mismatch {record['router/mismatch']:.3f}" if "router/mismatch" in record else ""
        parts.insert(
            -3,
            f"router violation {record['router/load_max_violation']:.2f} "
            f"confidence {record['router/confidence']:.2f}{mismatch}",
        )
    if "tool/call_rate" in record:
        parts.insert(-3, f"tool calls {record['tool/call_rate']:.2f} (errors {record['tool/errors']})")
    if record.get(FAILED):
        kinds = ", ".join(f"{k.rsplit('/', 1)[1]} {v}" for k, v in record.items() if k.startswith(f"{FAILED}/") and v)
        parts.insert(-2, f"failed {record[FAILED]} ({kinds})")
    return "  ".join(parts)
