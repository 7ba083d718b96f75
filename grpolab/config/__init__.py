"""A run's configuration, assembled from the sections that live beside their code: ``run_config`` (the
assembled ``RunConfig``), ``rules`` (the rules between sections), ``run_sections`` (the run layer's own
sections) and ``files`` (reading a TOML file, overrides and a resume's config.json).

May import: ``grpolab.learning`` and every layer below it (their settings modules; docs/architecture.md).
"""

from grpolab.common.settings import ConfigError, Section
from grpolab.config import rules  # noqa: F401  (registers the rules between sections with RunConfig)
from grpolab.config.files import (
    ALIASES,
    RESUME_OVERRIDES,
    apply_override,
    config_fields,
    load_config,
    load_run_config,
    parse_value,
    read_config_file,
    read_config_json,
    unknown_field_line,
    validate_config,
)
from grpolab.config.run_config import RunConfig
from grpolab.config.run_sections import CheckpointConfig, LogConfig, WarnConfig
from grpolab.learning.settings import OptimConfig
from grpolab.models.settings import LoraSettings, ModelConfig
from grpolab.parallel.settings import DistConfig
from grpolab.rollout.settings import ENGINE_CHOICES, EvalConfig, RolloutConfig, VLLMConfig
from grpolab.tasks.shaping import RewardShapingConfig

__all__ = [
    "ALIASES",
    "ENGINE_CHOICES",
    "RESUME_OVERRIDES",
    "CheckpointConfig",
    "ConfigError",
    "DistConfig",
    "EvalConfig",
    "LogConfig",
    "LoraSettings",
    "ModelConfig",
    "OptimConfig",
    "RewardShapingConfig",
    "RolloutConfig",
    "RunConfig",
    "Section",
    "VLLMConfig",
    "WarnConfig",
    "apply_override",
    "config_fields",
    "load_config",
    "load_run_config",
    "parse_value",
    "read_config_file",
    "read_config_json",
    "unknown_field_line",
    "validate_config",
]
