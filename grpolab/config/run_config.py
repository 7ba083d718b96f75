"""A run's config: its sections, each declared beside the code that reads it, assembled as the TOML file's
tables (``[model]``, ``[rollout]``, ...), with the top-level settings and the rules between sections
(``grpolab.config.rules``). Reading one from a file and the command line: ``grpolab.config.files``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpolab.common.settings import Section
from grpolab.config.run_sections import CheckpointConfig, LogConfig, WarnConfig
from grpolab.learning.settings import OptimConfig
from grpolab.models.settings import ModelConfig, TeacherConfig
from grpolab.objectives.algorithms import AlgorithmSpec, translate_old_spelling
from grpolab.objectives.presets import PRESETS, get_algorithm
from grpolab.parallel.settings import DistConfig
from grpolab.rollout.settings import EvalConfig, RolloutConfig
from grpolab.tasks.configs import ArithmeticTaskConfig, TaskConfig
from grpolab.tasks.shaping import SHAPING_TERMS, RewardShapingConfig

_RULES: list[Callable[[RunConfig], None]] = []


def rule(check: Callable[[RunConfig], None]) -> Callable[[RunConfig], None]:
    """Register ``check`` as a rule between sections, checked after those registered before it
    (``grpolab.config.rules``, which the package imports with this module)."""
    _RULES.append(check)
    return check


class RunConfig(Section):
    """A run's settings, section by section as in the TOML files (``grpolab train --help`` lists every field);
    ``load_config`` reads a file with overrides, ``validate_config`` a nested dict."""

    seed: int = Field(
        0,
        ge=0,
        lt=2**32,
        description="every RNG of the run derives from it (sampling seeds mix it "
        "with the step, and a seed must fit the libraries' 64-bit and NumPy's 32-bit seeds): "
        "0 <= seed < 2**32",
    )
    steps: int = Field(100, ge=1, description="RL steps of the run (a resume may raise it)")
    output_dir: str | None = Field(
        None, description="the run directory, new or empty; None = runs/<YYYYmmdd-HHMMSS>-<algorithm>"
    )
    reference: Literal["none", "frozen"] = Field("none", description="frozen copy of the start policy for KL")
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for torch; None = the cores other processes "
        "leave free (at most torch's default), measured at start; a setting above the free "
        "cores warns (oversubscription slows small models by orders of magnitude)",
    )
    log_every: int | None = Field(
        None,
        ge=1,
        description="a line of vital signs every k steps (reward, accuracy, "
        "advantage std, KL, clip fraction, ratio, length, truncation, grad norm, s/step); "
        "None = every step when the output is not a terminal, none on a terminal",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy: which model, where, in what dtype")
    task: TaskConfig = Field(
        default_factory=ArithmeticTaskConfig,
        description="what the model learns: task.name picks the kind, the other keys are that kind's settings",
    )
    reward: RewardShapingConfig = Field(
        default_factory=RewardShapingConfig, description="length shaping added to every task's RL reward"
    )
    algorithm: AlgorithmSpec = Field(
        default_factory=lambda: PRESETS["grpo"],
        description="algorithm.name picks a preset (grpolab algorithms lists them); any other key overrides it",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="sampling: the engine, batch shape, and its sync check"
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the optimizer and the update's batching")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="greedy evaluation on the validation split")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints for exact resume")
    warn: WarnConfig = Field(
        default_factory=WarnConfig, description="warnings that save a wasted run (grpolab.run.health)"
    )
    log: LogConfig = Field(default_factory=LogConfig, description="where metrics go besides RUN_DIR/metrics.jsonl")
    dist: DistConfig = Field(default_factory=DistConfig, description="data parallelism under torchrun")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="on-policy distillation's teacher")

    @field_validator("task", mode="before")
    @classmethod
    def _default_task(cls, value: Any) -> Any:
        return {"name": "arithmetic", **value} if isinstance(value, dict) else value

    @field_validator("algorithm", mode="before")
    @classmethod
    def _expand_preset(cls, value: Any) -> Any:
        """``{name: dapo, eps_high: 0.3}`` -> the dapo preset with eps_high overridden."""
        if not isinstance(value, dict):
            return value
        fields = translate_old_spelling(dict(value))  # a config.json of an older commit: engine_correction
        name = fields.pop("name", "grpo")
        return {**get_algorithm(name).model_dump(), **fields, "name": name}

    @model_validator(mode="after")
    def _check_rules(self) -> RunConfig:
        """The rules between sections (``grpolab.config.rules``), in order: the first one broken is the error."""
        for check in _RULES:
            check(self)
        return self

    @staticmethod
    def rules() -> tuple[Callable[[RunConfig], None], ...]:
        """The rules between sections, in the order they are checked."""
        return tuple(_RULES)

    def reward_weights(self) -> dict[str, float] | None:
        """The RL reward's terms (grade component names) and weights: the task's, then the enabled length shaping's
        (weight 1: the penalty is in the value); None where the task's are unknown (a task class of your own)."""
        weights = self.task.reward_weights()
        if weights is None:
            return None
        shaping = (self.reward.truncation_penalty, self.reward.overlong_buffer)
        return {**weights, **{name: 1.0 for name, on in zip(SHAPING_TERMS, shaping) if on}}

    def needs_reference(self) -> bool:
        return self.reference == "frozen" or self.algorithm.beta > 0
