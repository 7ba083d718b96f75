"""The rules between a run config's sections, each a named function of the assembled config that raises
``ValueError`` with one line (pydantic reports it as the config's error), registered with ``@rule`` in the
order they are checked (``RunConfig.rules()`` lists them): the first one broken is the error. A rule within one section lives with that section (``grpolab.rollout.settings``,
...); a rule on what an engine can run lives with the engines (``grpolab.rollout.engines.check_settings``)."""

from __future__ import annotations

from pydantic import ValidationError

from grpolab.common.fields import unknown_field, walk
from grpolab.common.validation import describe_validation_error
from grpolab.config.run_config import RunConfig, rule
from grpolab.models.settings import WarmStartSettings, check_teacher_setting
from grpolab.tasks.configs import TINY_MODEL_TASKS


@rule
def algorithm_sets_the_group_size(cfg: RunConfig) -> None:
    """An algorithm defined with its group size (2-GRPO) sets rollout.group_size; an explicit other one is refused."""
    want = cfg.algorithm.group_size
    if want is None or cfg.rollout.group_size == want:
        return
    if "group_size" in cfg.rollout.model_fields_set:
        raise ValueError(
            f"algorithm {cfg.algorithm.name} is defined with group size {want} (algorithm.group_size) but "
            f"rollout.group_size is {cfg.rollout.group_size}; drop rollout.group_size, or choose the group size "
            "with an algorithm that leaves it to the rollout (e.g. --algo grpo)"
        )
    cfg.rollout.group_size = want


@rule
def batch_splits_into_steps(cfg: RunConfig) -> None:
    spec = cfg.algorithm
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if n % spec.steps_per_epoch:
        raise ValueError(
            f"rollout batch of {n} completions cannot be split into {spec.steps_per_epoch} "
            f"optimizer steps (algorithm {spec.name})"
        )


@rule
def normalizer_has_its_reward_range(cfg: RunConfig) -> None:
    """MaxRL's (r - mean) / mean: well defined for rewards >= 0, its sign flips with a negative group mean;
    BNPO's p is the success rate of rewards in {0, 1} (its paper's setting: the Beta models that probability)."""
    spec = cfg.algorithm
    if spec.normalizer not in ("mean", "beta_density"):
        return
    shaping = [
        f"reward.{name} {value:g}"
        for name, value in (
            ("truncation_penalty", cfg.reward.truncation_penalty),
            ("overlong_buffer", cfg.reward.overlong_buffer),
        )
        if value
    ]
    if spec.normalizer == "mean":
        negative = [f"{term}, a penalty," for term in shaping] + cfg.task.negative_rewards()
        if negative:
            raise ValueError(
                f"algorithm {spec.name} (normalizer 'mean') needs RL rewards >= 0 (its advantage "
                f"(r - mean) / mean changes sign when a group's mean is negative): {negative[0]} can give "
                "negative values; for such rewards use another normalizer (e.g. --algo grpo or dr_grpo)"
            )
        return
    nonbinary = shaping + cfg.task.nonbinary_rewards()
    if nonbinary:
        raise ValueError(
            f"algorithm {spec.name} (normalizer '{spec.normalizer}') needs RL rewards in {{0, 1}} (BNPO's group "
            f"mean is a success rate, fitted by a Beta): {nonbinary[0]} can give other values; for such rewards "
            "use another normalizer (e.g. --algo grpo or dr_grpo)"
        )


@rule
def group_baseline_has_a_group(cfg: RunConfig) -> None:
    spec = cfg.algorithm
    if spec.baseline == "mean" and cfg.rollout.group_size < 2 and not spec.needs_teacher:  # its own rule
        raise ValueError(
            f"rollout.group_size 1 with the group-mean baseline of {spec.name}: every "
            "advantage would be 0 and nothing would train; use group_size >= 2"
        )


@rule
def decoupled_terms_are_known(cfg: RunConfig) -> None:
    """GDPO normalizes each term of the RL reward apart: it needs their names and weights, and two of them."""
    spec, weights = cfg.algorithm, cfg.reward_weights()
    if spec.multi_objective_aggregation != "normalize_then_sum":
        return
    why = f"algorithm {spec.name} (multi_objective_aggregation 'normalize_then_sum') normalizes each reward term apart"
    if weights is None:
        raise ValueError(
            f"{why}, and the terms and weights of task {cfg.task.name!r} (a task class of your own) are unknown; "
            "use task.name 'dataset' with task.rewards, or another algorithm (e.g. --algo grpo)"
        )
    clipped = cfg.task.clipped_reward_models()
    if clipped:
        raise ValueError(
            f"{why} from its raw value, so reward model {clipped[0]!r}'s options.clip would not apply; "
            "drop the clip (the group normalization bounds the term) or use another algorithm (e.g. --algo grpo)"
        )
    weighted = [name for name, weight in weights.items() if weight != 0]
    if len(weighted) < 2:
        raise ValueError(
            f"{why}, and the RL reward has a single weighted term ({', '.join(weighted) or 'none'}): nothing to "
            "decouple; add a weighted term (task.rewards, reward.truncation_penalty, reward.overlong_buffer) "
            "or use --algo grpo"
        )


@rule
def teacher_fits_the_algorithm(cfg: RunConfig) -> None:
    """On-policy distillation's teacher: set exactly when the algorithm reads one (``grpolab.models.settings``)."""
    check_teacher_setting(cfg.algorithm, cfg.teacher, cfg.rollout.group_size)


@rule
def warm_start_is_for_the_demo(cfg: RunConfig) -> None:
    if cfg.model.warm_start:
        if cfg.model.path is not None:
            raise ValueError("model.warm_start changes the demo's tiny model: it applies only without model.path")
        try:  # unknown keys and bad values, named now
            WarmStartSettings(**cfg.model.warm_start)
        except ValidationError as err:
            names = [f"model.warm_start.{f.name}" for f in walk(WarmStartSettings)]
            lines = describe_validation_error(
                err, "", unknown=lambda loc, value: unknown_field(("model", "warm_start", *loc), value, names)
            )
            raise ValueError(
                "; ".join(
                    line if line.startswith("model.warm_start.") else f"model.warm_start.{line}" for line in lines
                ).replace("model.warm_start.: ", "model.warm_start: ")
            ) from None


@rule
def like_model_settings(cfg: RunConfig) -> None:
    like = (cfg.model.path or "").startswith("like:")
    if cfg.model.like_overrides and not like:
        raise ValueError("model.like_overrides applies only to a like:NAME model")
    if like and cfg.task.prompt_format() == "chat":
        raise ValueError(
            "a like:NAME model's tokenizer has no chat template; use task.prompt.format 'r1_zero' or 'template'"
        )


@rule
def revision_has_a_hub_id(cfg: RunConfig) -> None:
    """(A local folder's revision is refused when the model is checked: which a path is depends on the disk.)"""
    path = cfg.model.path
    if cfg.model.revision is not None and (path is None or path.startswith(("like:", "gguf:"))):
        raise ValueError(
            f"model.revision applies to a Hugging Face hub id (--model org/name), not to {path or 'the demo model'}"
        )


@rule
def task_has_a_model(cfg: RunConfig) -> None:
    if cfg.model.path is None and cfg.task.name not in TINY_MODEL_TASKS:
        raise ValueError(
            f"model.path (--model DIR or a hub id org/name) is required for task {cfg.task.name!r} (the demo's tiny "
            f"model is warm-started for {' and '.join(TINY_MODEL_TASKS)} only)"
        )


@rule
def pass_k_within_pass_n(cfg: RunConfig) -> None:
    if any(k > cfg.eval.pass_n for k in cfg.eval.pass_k):
        raise ValueError(f"eval.pass_k {cfg.eval.pass_k} needs eval.pass_n >= the largest k")


@rule
def lora_dropout_keeps_the_sync_check(cfg: RunConfig) -> None:
    lora = cfg.model.lora
    if lora is not None and lora.dropout > 0 and cfg.rollout.sync_check:
        raise ValueError(
            f"model.lora.dropout {lora.dropout:g}: the update's forward would differ from the "
            "policy that sampled and the per-step sync check would stop the run; use dropout 0 "
            "or rollout.sync_check false"
        )


@rule
def adapter_sync_has_an_adapter(cfg: RunConfig) -> None:
    lora = cfg.model.lora
    if cfg.rollout.vllm.lora_sync == "adapter":
        if lora is None:
            raise ValueError("rollout.vllm.lora_sync 'adapter' needs [model.lora]")
        if lora.modules_to_save:
            raise ValueError(
                f"rollout.vllm.lora_sync 'adapter': vLLM's LoRA cannot serve model.lora."
                f"modules_to_save {lora.modules_to_save}; use lora_sync 'merged'"
            )
