"""Run configuration: a TOML file plus command-line overrides, validated up front.

Every field has a dotted name (``optim.lr``, ``algorithm.eps_high``, ``rollout.group_size``); a TOML
file sets any of them in its table, and ``--optim.lr 3e-4`` on the command line overrides it.
Validation reports one line per bad field.
"""

from __future__ import annotations

import functools
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from grpolab.common.fields import FieldDoc, RegistryChoices, unknown_field, walk
from grpolab.common.tracker_names import TRACKER_NAMES, choices_text, tracker_names
from grpolab.common.validation import describe_validation_error
from grpolab.models.settings import PrecisionName, TeacherConfig, WarmStartSettings, check_teacher_setting
from grpolab.objectives.algorithms import AlgorithmSpec, translate_old_spelling
from grpolab.objectives.presets import PRESETS, get_algorithm
from grpolab.tasks.configs import TASK_KINDS, TINY_MODEL_TASKS, ArithmeticTaskConfig, TaskConfig
from grpolab.tasks.shaping import SHAPING_TERMS


class ConfigError(ValueError):
    """A configuration that cannot run; the message has one line per problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraSettings(_Section):
    """``[model.lora]``: train LoRA adapters (peft) instead of the full weights; the frozen reference is then
    the policy with its adapter off, and checkpoints hold the adapter (``grpolab export`` merges it)."""

    rank: int = Field(8, gt=0, description="r: the adapter's rank")
    alpha: float | None = Field(None, gt=0, description="the adapter's scale is alpha / rank; None = rank (scale 1)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input in the update's forward")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description='leaf names of the linear layers to adapt, e.g. ["q_proj", "v_proj"]; '
        "all-linear = every linear layer of the decoder (never the output layer)",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description='modules trained in full beside the adapter (and saved with it), e.g. ["lm_head"]',
    )


class ModelConfig(_Section):
    path: str | None = Field(
        None,
        description="a local Hugging Face model folder (an existing path wins), a hub id org/name (the Hugging "
        "Face cache first, else downloaded; HF_HUB_OFFLINE=1: the cache only), like:NAME, gguf:FILE; "
        "None = the demo's tiny model",
    )
    revision: str | None = Field(
        None,
        description="with a hub id: its branch, tag or commit (default main); the run records the commit",
    )

    @field_validator("revision", mode="before")
    @classmethod
    def _revision_as_text(cls, value: Any) -> Any:
        """``--model.revision 20240101`` (a tag, or a commit of digits only) reads as a TOML integer."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto = bfloat16 on cuda, float32 on cpu")
    gradient_checkpointing: bool = Field(False, description="recompute decoder layers in the backward pass")
    logprob_chunk_size: int = Field(64, ge=1, description="sequence positions per output-layer chunk")
    like_overrides: dict[str, int] = Field(
        default_factory=dict,
        description="size fields of a like:NAME model, e.g. {num_hidden_layers = 2}; width and vocabulary stay real",
    )
    lora: LoraSettings | None = Field(
        None, description="LoRA adapters instead of full weights; setting any of its fields turns them on"
    )
    warm_start: dict[str, Any] = Field(
        default_factory=dict,
        description="with no model.path: changes to the "
        'demo\'s tiny model and its warm start, e.g. {arch = "qwen3_moe", '
        "num_experts = 8, experts_per_token = 2} (grpolab.models.tinymodel."
        "WarmStartSettings)",
    )
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="a Mixture-of-Experts policy: this times the "
        "load-balancing loss of each training forward's completion tokens is "
        "added to the objective (0 = the objective as published)",
    )


class VLLMConfig(_Section):
    """The vLLM engine's settings (used when rollout.engine is ``engine``)."""

    engine: ClassVar[str] = "vllm"  # the rollout.engine choice these settings belong to

    python: str | None = Field(
        None,
        description="run vLLM under this interpreter, in its own process "
        "(e.g. a venv that pins vLLM's torch); None = in this process",
    )
    sleep_level: Literal[0, 1, 2] = Field(
        1,
        description="sleep between rollouts where the platform supports "
        "it (GPU): 1 offloads the weights to CPU memory and frees the KV "
        "cache, 2 drops the weights (the engine restores the policy's before "
        "every generation); 0 never",
    )
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="GPU share for vLLM; the rest trains")
    kv_cache_gib: float | None = Field(
        None, gt=0, description="explicit KV-cache size; None = vLLM's default on GPU, 0.25 GiB on CPU"
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="with [model.lora]: merged = vLLM serves the base plus the scaled adapter product, "
        "all weights synced each step; adapter = vLLM's own LoRA serves the base, only the adapter is synced",
    )


ENGINE_CHOICES = Literal["hf", "vllm"]  # grpolab.rollout.engines: what each can do and refuses; the first the default


class RolloutConfig(_Section):
    engine: ENGINE_CHOICES = Field(
        get_args(ENGINE_CHOICES)[0],
        description="hf: grpolab's decoding loop on the training model; "
        "vllm: colocated vLLM, weights synced every step (the engines, "
        "what each can do and the settings each refuses: grpolab.rollout."
        "engines)",
    )
    prompts_per_step: int = Field(32, ge=1, description="prompts sampled per RL step")
    group_size: int = Field(8, ge=1, description="G: completions per prompt, the group its advantages compare")
    max_new_tokens: int = Field(48, ge=1, description="longest completion; one that reaches it is truncated")
    max_prompt_tokens: int | None = Field(None, ge=1, description="longer prompts are an error, never truncated")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts (and of pass@k)")
    top_p: float = Field(
        1.0, gt=0, le=1, description="training samples the untruncated policy: 1 only (eval.top_p for pass@k)"
    )
    top_k: int = Field(
        0, ge=0, description="training samples the untruncated policy: 0 (disabled) only (eval.top_k for pass@k)"
    )
    stop_strings: list[str] = Field(
        default_factory=list, description="a completion ends after the first of these (besides the end-of-text token)"
    )
    max_batch_size: int = Field(256, ge=1, description="sequences generated at once (hf engine)")
    pack_weights: bool = Field(
        True,
        description="hf engine on a CPU, float32: multiply by weights laid out "
        "once per generation call (oneDNN), not re-packed at every decoding step",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="the vLLM engine's settings (with rollout.engine vllm)"
    )
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generate, learn, sync in turn; async: an engine process of its own generates the "
        "next batches while the learner trains (hf engine, one process; grpolab.rollout.pipeline)",
    )
    max_staleness: int = Field(
        1, ge=0, le=8, description="async: step t's batch is sampled by the policy after step t-1-k; 0 = sync's run"
    )
    engine_threads: int | None = Field(
        None, ge=1, description="async: the engine process's CPU threads, of threads (None: half, at least 1)"
    )
    sync_check: bool = Field(
        True,
        description="compare engine and trainer log-probs of the sampled tokens "
        "every step (one-update schedules read the update's own forward: no extra pass)",
    )
    sync_max_diff: float | None = Field(
        None,
        gt=0,
        description="stop when max |engine - trainer log-prob| exceeds this; None = 1e-3 in float32, off in bfloat16",
    )
    sync_mean_diff: float | None = Field(
        None, gt=0, description="stop when the mean |diff| exceeds this; None = 1e-4 in float32, 0.1 in bfloat16"
    )
    sync_noise_multiple: float | None = Field(
        3.0,
        gt=1,
        description="the first sync_calibration_steps checked "
        "rollouts (engine and trainer in sync) record the noise floor, their "
        "largest mean |diff|; stop when a step exceeds this multiple of the "
        "floor so far. None = absolute limits only",
    )
    sync_calibration_steps: int = Field(
        3,
        ge=1,
        description="checked rollouts whose largest mean |diff| is the "
        "noise floor (one step alone can sit far below the next one's noise)",
    )
    sync_warn_margin: float = Field(
        0.5,
        gt=0,
        le=1,
        description="one log line when a step's sync margin (its "
        "|diff| over the stop limit, logged as sync/margin) passes this; 1 = never",
    )
    max_failure_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="stop the run (resumably, one line naming the kind and the first error) when more than this "
        "fraction of a step's samples (or an evaluation's items) failed (a rollout, environment, endpoint call or "
        "reward function; a failed sample never trains). 0.5 sits well above the 5-15% of failed episodes open-instruct reports as normal "
        "and stops a run whose failures are systematic (a broken reward function fails every sample); 1 = never",
    )

    @model_validator(mode="after")
    def _untruncated_sampling(self) -> RolloutConfig:
        if self.top_p < 1 or self.top_k > 0:
            raise ValueError(
                "rollout.top_p / top_k: training samples with top_p = 1 and top_k = 0 only: a "
                "truncated sample is not from the policy whose log-probs the objective, the old "
                "policy and the sync check score, and no importance weight reaches the tokens it "
                "never samples; eval.top_p / eval.top_k set them for pass@k"
            )
        return self

    @model_validator(mode="after")
    def _vllm_python_means_vllm(self) -> RolloutConfig:
        if self.vllm.python is not None and self.engine != self.vllm.engine:
            if "engine" in self.model_fields_set:
                raise ValueError(f"rollout.vllm.python (--vllm-python) needs rollout.engine '{self.vllm.engine}'")
            self.engine = self.vllm.engine
        return self

    def sync_limits(self, dtype: str) -> tuple[float | None, float | None]:
        """(max, mean) |diff| limits for the trainer's dtype; explicit settings win."""
        max_default, mean_default = (1e-3, 1e-4) if dtype == "float32" else (None, 0.1)
        return (
            self.sync_max_diff if self.sync_max_diff is not None else max_default,
            self.sync_mean_diff if self.sync_mean_diff is not None else mean_default,
        )


class RewardShapingConfig(_Section):
    """Length shaping added to every task's RL reward in training (logged apart from the answer reward)."""

    truncation_penalty: float = Field(
        0.0, ge=0, description="subtracted from the reward of a completion that hit rollout.max_new_tokens (0 = off)"
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: the last this-many tokens "
        "before rollout.max_new_tokens cost up to overlong_factor, linearly (0 = off)",
    )
    overlong_factor: float = Field(1.0, gt=0, description="the soft overlong punishment at max_new_tokens")


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0, description="AdamW's learning rate (constant)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm per optimizer step")
    micro_batch_size: int = Field(32, ge=1, description="sequences per micro-batch (unless micro_batch_tokens)")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="token budget per micro-batch instead of a count: sequences (or shared-prompt "
        "units) sorted by length, each micro-batch padded to its longest holds at most this many positions; "
        "the gradient is unchanged (denominators are those of the whole optimizer step)",
    )
    shared_prompts: bool = Field(
        True,
        description="compute each prompt once for the completions that share it "
        "in the training forward (same log-probs and gradients); off or unsupported by "
        "the model's attention: every sequence on its own",
    )
    precision: PrecisionName = Field(
        "fp32_master",
        description="with bf16 compute (model.dtype): fp32_master = fp32 weights and AdamW "
        "under bf16 autocast; bf16_compensated = bf16 weights, AdamW with Kahan summation (torch-optimi); "
        "bf16 = plain AdamW on bf16 weights (small updates round away; warns)",
    )
    full_metrics: bool = Field(
        True,
        description="a no-grad forward of the sequences that need no gradient "
        "(pruned zero-advantage rows, skipped steps) so entropy, KL and ratio metrics "
        "cover every response token; False saves that forward",
    )


class EvalConfig(_Section):
    every: int = Field(20, ge=1, description="evaluate every N steps (and at step 0 and the last step)")
    n_examples: int | None = Field(None, ge=1, description="None = the whole validation split")
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list, description="e.g. [1, 8]: sampled pass@k")
    pass_n: int = Field(8, ge=1, description="samples per problem for pass@k")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="pass@k sampling's nucleus mass (1 = untruncated; "
        "the rollout's temperature); training always samples untruncated",
    )
    top_k: int = Field(0, ge=0, description="pass@k sampling's k most likely tokens (0 = disabled)")


class CheckpointConfig(_Section):
    every: int = Field(50, ge=1, description="a verified checkpoint every N steps (and at the last step)")
    keep_last: int | None = Field(
        None,
        ge=1,
        description="keep only the newest N checkpoints (the oldest are "
        "removed once a newer one verifies); None keeps all",
    )


def _declared_tracker(name: str) -> str:
    if name not in TRACKER_NAMES:  # as pydantic words a Literal's refusal
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": choices_text()})
    return name


TrackerName = Annotated[str, AfterValidator(_declared_tracker), RegistryChoices(tracker_names)]
"""A ``log.trackers`` choice: a name ``grpolab.common.tracker_names`` declares (read when validated)."""


def _trackers_description() -> str:
    listed = ", ".join(f'"{t.name}" ({t.logs_to})' for t in TRACKER_NAMES.values())
    installs = " or ".join(dict.fromkeys(t.install for t in TRACKER_NAMES.values()))
    return (
        f"also log every metrics.jsonl record there: {listed}; a list, or names separated by commas; needs {installs}"
    )


class LogConfig(_Section):
    """``[log]``: the trackers a run also logs to, beside its metrics.jsonl (docs/running.md: Trackers)."""

    trackers: list[TrackerName] = Field(default_factory=list, description=_trackers_description())
    project: str = Field("grpolab", min_length=1, description="the W&B and Trackio project")
    run_name: str | None = Field(
        None, min_length=1, description="the run's name in W&B and Trackio; None = the run directory's name"
    )
    completions_every: int | None = Field(
        10,
        ge=1,
        description="every N steps (and the last) the trackers get a table of the step's sampled completions "
        "(prompt, completion, reward and its terms, advantage); None = never",
    )
    completions_max: int = Field(
        64, ge=1, description="rows of a completions table at most: the step's first prompt groups, whole"
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        """``NAME = true``, an earlier version's spelling of ``trackers = ["NAME"]`` for the trackers declared
        with an ``old_switch`` (run directories of earlier versions hold it in their config.json, and a resume
        reads that)."""
        if not isinstance(data, dict):
            return data
        for name in [t.name for t in TRACKER_NAMES.values() if t.old_switch and t.name in data]:
            data = dict(data)
            old = data.pop(name)
            if not isinstance(old, bool):
                raise ValueError(f'{name} (the old spelling of trackers = ["{name}"]) must be true or false')
            trackers = data.get("trackers", [])
            if isinstance(trackers, str):
                trackers = _names(trackers)
            if old and isinstance(trackers, list) and name not in trackers:
                data["trackers"] = [*trackers, name]
        return data

    @field_validator("trackers", mode="before")
    @classmethod
    def _tracker_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # --log.trackers NAME,NAME
            value = _names(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = list(dict.fromkeys(value))  # each once, in order
        return value


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


class WarnConfig(_Section):
    """When the run warns that it cannot learn (the other warnings' thresholds: ``grpolab.run.health``)."""

    no_signal_steps: int = Field(
        5,
        ge=1,
        description="warn after this many steps in a row in which every group's rewards were equal (no "
        "learning signal: advantages 0, updates skipped); a shorter run warns at its end when no step had one",
    )


class DistConfig(_Section):
    """Data parallelism under ``torchrun --nproc_per_node N`` (ignored in one process)."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every rank holds the whole model, gradients all-reduced by DistributedDataParallel; "
        "fsdp: weights, gradients and optimizer state sharded over the ranks by FSDP2 (fully_shard), for models "
        "that do not fit on one device (with the hf engine: no tools)",
    )
    timeout_minutes: int = Field(
        30,
        ge=1,
        description="how long a collective waits for a rank before the run "
        "fails (torchrun ends the others at once when a rank exits)",
    )


class RunConfig(_Section):
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
        """The rules between sections, in this order (the first one broken is the error)."""
        for rule in (
            self._algorithm_sets_the_group_size,
            self._batch_splits_into_steps,
            self._normalizer_has_its_reward_range,
            self._group_baseline_has_a_group,
            self._decoupled_terms_are_known,
            lambda: check_teacher_setting(self.algorithm, self.teacher, self.rollout.group_size),
            self._warm_start_is_for_the_demo,
            self._like_model_settings,
            self._revision_has_a_hub_id,
            self._task_has_a_model,
            self._pass_k_within_pass_n,
            self._lora_dropout_keeps_the_sync_check,
            self._adapter_sync_has_an_adapter,
        ):
            rule()
        return self

    def _algorithm_sets_the_group_size(self) -> None:
        """An algorithm defined with its group size (2-GRPO) sets rollout.group_size; an explicit other one is refused."""
        want = self.algorithm.group_size
        if want is None or self.rollout.group_size == want:
            return
        if "group_size" in self.rollout.model_fields_set:
            raise ValueError(
                f"algorithm {self.algorithm.name} is defined with group size {want} (algorithm.group_size) but "
                f"rollout.group_size is {self.rollout.group_size}; drop rollout.group_size, or choose the group size "
                "with an algorithm that leaves it to the rollout (e.g. --algo grpo)"
            )
        self.rollout.group_size = want

    def _decoupled_terms_are_known(self) -> None:
        """GDPO normalizes each term of the RL reward apart: it needs their names and weights, and two of them."""
        spec, weights = self.algorithm, self.reward_weights()
        if spec.multi_objective_aggregation != "normalize_then_sum":
            return
        why = f"algorithm {spec.name} (multi_objective_aggregation 'normalize_then_sum') normalizes each reward term apart"
        if weights is None:
            raise ValueError(
                f"{why}, and the terms and weights of task {self.task.name!r} (a task class of your own) are unknown; "
                "use task.name 'dataset' with task.rewards, or another algorithm (e.g. --algo grpo)"
            )
        clipped = self.task.clipped_reward_models()
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

    def reward_weights(self) -> dict[str, float] | None:
        """The RL reward's terms (grade component names) and weights: the task's, then the enabled length shaping's
        (weight 1: the penalty is in the value); None where the task's are unknown (a task class of your own)."""
        weights = self.task.reward_weights()
        if weights is None:
            return None
        shaping = (self.reward.truncation_penalty, self.reward.overlong_buffer)
        return {**weights, **{name: 1.0 for name, on in zip(SHAPING_TERMS, shaping) if on}}

    def _batch_splits_into_steps(self) -> None:
        spec = self.algorithm
        n = self.rollout.prompts_per_step * self.rollout.group_size
        if n % spec.steps_per_epoch:
            raise ValueError(
                f"rollout batch of {n} completions cannot be split into {spec.steps_per_epoch} "
                f"optimizer steps (algorithm {spec.name})"
            )

    def _normalizer_has_its_reward_range(self) -> None:
        """MaxRL's (r - mean) / mean: well defined for rewards >= 0, its sign flips with a negative group mean;
        BNPO's p is the success rate of rewards in {0, 1} (its paper's setting: the Beta models that probability)."""
        spec = self.algorithm
        if spec.normalizer not in ("mean", "beta_density"):
            return
        shaping = [
            f"reward.{name} {value:g}"
            for name, value in (
                ("truncation_penalty", self.reward.truncation_penalty),
                ("overlong_buffer", self.reward.overlong_buffer),
            )
            if value
        ]
        if spec.normalizer == "mean":
            negative = [f"{term}, a penalty," for term in shaping] + self.task.negative_rewards()
            if negative:
                raise ValueError(
                    f"algorithm {spec.name} (normalizer 'mean') needs RL rewards >= 0 (its advantage "
                    f"(r - mean) / mean changes sign when a group's mean is negative): {negative[0]} can give "
                    "negative values; for such rewards use another normalizer (e.g. --algo grpo or dr_grpo)"
                )
            return
        nonbinary = shaping + self.task.nonbinary_rewards()
        if nonbinary:
            raise ValueError(
                f"algorithm {spec.name} (normalizer '{spec.normalizer}') needs RL rewards in {{0, 1}} (BNPO's group "
                f"mean is a success rate, fitted by a Beta): {nonbinary[0]} can give other values; for such rewards "
                "use another normalizer (e.g. --algo grpo or dr_grpo)"
            )

    def _group_baseline_has_a_group(self) -> None:
        spec = self.algorithm
        if spec.baseline == "mean" and self.rollout.group_size < 2 and not spec.needs_teacher:  # its own rule
            raise ValueError(
                f"rollout.group_size 1 with the group-mean baseline of {spec.name}: every "
                "advantage would be 0 and nothing would train; use group_size >= 2"
            )

    def _warm_start_is_for_the_demo(self) -> None:
        if self.model.warm_start:
            if self.model.path is not None:
                raise ValueError("model.warm_start changes the demo's tiny model: it applies only without model.path")
            try:  # unknown keys and bad values, named now
                WarmStartSettings(**self.model.warm_start)
            except ValidationError as err:
                names = [f"model.warm_start.{f.name}" for f in walk(WarmStartSettings)]
                lines = describe_validation_error(
                    err, "", unknown=lambda loc, value: unknown_field_line(("model", "warm_start", *loc), value, names)
                )
                raise ValueError(
                    "; ".join(
                        line if line.startswith("model.warm_start.") else f"model.warm_start.{line}" for line in lines
                    ).replace("model.warm_start.: ", "model.warm_start: ")
                ) from None

    def _like_model_settings(self) -> None:
        like = (self.model.path or "").startswith("like:")
        if self.model.like_overrides and not like:
            raise ValueError("model.like_overrides applies only to a like:NAME model")
        if like and self.task.prompt_format() == "chat":
            raise ValueError(
                "a like:NAME model's tokenizer has no chat template; use task.prompt.format 'r1_zero' or 'template'"
            )

    def _revision_has_a_hub_id(self) -> None:
        """(A local folder's revision is refused when the model is checked: which a path is depends on the disk.)"""
        path = self.model.path
        if self.model.revision is not None and (path is None or path.startswith(("like:", "gguf:"))):
            raise ValueError(
                f"model.revision applies to a Hugging Face hub id (--model org/name), not to {path or 'the demo model'}"
            )

    def _task_has_a_model(self) -> None:
        if self.model.path is None and self.task.name not in TINY_MODEL_TASKS:
            raise ValueError(
                f"model.path (--model DIR or a hub id org/name) is required for task {self.task.name!r} (the demo's tiny "
                f"model is warm-started for {' and '.join(TINY_MODEL_TASKS)} only)"
            )

    def _pass_k_within_pass_n(self) -> None:
        if any(k > self.eval.pass_n for k in self.eval.pass_k):
            raise ValueError(f"eval.pass_k {self.eval.pass_k} needs eval.pass_n >= the largest k")

    def _lora_dropout_keeps_the_sync_check(self) -> None:
        lora = self.model.lora
        if lora is not None and lora.dropout > 0 and self.rollout.sync_check:
            raise ValueError(
                f"model.lora.dropout {lora.dropout:g}: the update's forward would differ from the "
                "policy that sampled and the per-step sync check would stop the run; use dropout 0 "
                "or rollout.sync_check false"
            )

    def _adapter_sync_has_an_adapter(self) -> None:
        lora = self.model.lora
        if self.rollout.vllm.lora_sync == "adapter":
            if lora is None:
                raise ValueError("rollout.vllm.lora_sync 'adapter' needs [model.lora]")
            if lora.modules_to_save:
                raise ValueError(
                    f"rollout.vllm.lora_sync 'adapter': vLLM's LoRA cannot serve model.lora."
                    f"modules_to_save {lora.modules_to_save}; use lora_sync 'merged'"
                )

    def needs_reference(self) -> bool:
        return self.reference == "frozen" or self.algorithm.beta > 0


ALIASES = {
    "algo": "algorithm.name",
    "model": "model.path",
    "task": "task.name",
    "engine": "rollout.engine",
    "vllm_python": "rollout.vllm.python",
}
"""Short names on the command line (``--algo dapo``) for deeper fields; the top-level fields (``--steps``,
``--threads``, ``--output-dir``) are short already."""


@functools.cache
def config_fields() -> tuple[FieldDoc, ...]:
    """Every field of a run config by its dotted name (sections, task kinds' fields, ``task.rewards[].weight``),
    with a default config's values as defaults: what ``--help``, ``grpolab config`` and docs/config.md list."""
    return tuple(walk(RunConfig, RunConfig()))


def unknown_field_line(loc: tuple[str | int, ...], value: Any, names: list[str] | None = None) -> str:
    """One line for a key the config does not have, with the closest dotted name (or short name) it may have
    meant: 'optim.lrr: unknown field; did you mean optim.lr?' (``grpolab.common.fields.unknown_field``); a TRL name
    gets its grpolab name ('learning_rate: unknown field; did you mean optim.lr? ...', ``grpolab.common.peer_names``)."""
    from grpolab.common.peer_names import PEER_NAMES

    if names is not None:
        return unknown_field(loc, value, names)
    return unknown_field(loc, value, [f.name for f in config_fields()], ALIASES, PEER_NAMES)


def parse_value(text: str) -> Any:
    """A command-line value as a TOML literal (numbers, booleans, lists, inline tables, quoted strings), else
    a JSON list or object (``[{"function": "numeric"}]``), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if text.lstrip().startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data[a][b] = value`` for dotted name ``a.b``."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    node[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read ``path`` (TOML, or a run's config.json), apply dotted ``overrides``, validate. Raises ConfigError with one line per problem."""
    data = read_config_file(Path(path)) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        apply_override(data, ALIASES.get(dotted, dotted), value)
    return validate_config(data)


def read_config_file(path: Path) -> dict[str, Any]:
    """The nested settings of a TOML file (or a run's config.json), not validated yet; ConfigError when it is
    missing or unreadable."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None


def validate_config(data: dict[str, Any]) -> RunConfig:
    """A run config from its nested dict; raises ConfigError with one line per problem."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        lines = describe_validation_error(err, tags=TASK_KINDS, unknown=unknown_field_line)
        raise ConfigError("\n".join(lines)) from None


RESUME_OVERRIDES = ("steps", "log_every", "threads", "model.revision")
"""What a resume may change: ``steps`` (to extend a run, never to shorten it), the fields that change no
result (how often it logs, its CPU threads) and ``model.revision``, only to pin the commit the run started
from (``grpolab.run.resume`` checks it); config.json and the manifest's resume entry record the change."""


def load_run_config(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The config of the run in ``run_dir`` (its config.json), for a resume: only the ``RESUME_OVERRIDES``
    may change, so that the resumed run computes exactly what it started to."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"nothing to resume: {path} not found")
    changed = sorted(set(overrides or {}) - set(RESUME_OVERRIDES))
    if changed:
        raise ConfigError(
            f"a resumed run keeps its config; only {', '.join(RESUME_OVERRIDES)} may change "
            f"(got {', '.join('--' + c for c in changed)})"
        )
    data = read_config_json(path)
    for dotted, value in (overrides or {}).items():
        apply_override(data, dotted, value)
    data["output_dir"] = str(run_dir)
    return validate_config(data)


def read_config_json(path: Path) -> dict[str, Any]:
    """A config saved as JSON (a run's config.json, a suite's configs/NAME.json); ConfigError when it is
    not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a config (a JSON object), but a {type(data).__name__}")
    return data
