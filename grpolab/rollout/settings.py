"""The rollout layer's settings: ``[rollout]`` (sampling, the engine and its sync check), ``[rollout.vllm]``
(the vLLM engine's own) and ``[eval]`` (evaluation's sampling). Pydantic models only: reading or checking a
config imports no engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Protocol, get_args

from pydantic import Field, model_validator

from grpolab.common.settings import Section

if TYPE_CHECKING:
    from typing import Self

    from grpolab.models.settings import ModelConfig
    from grpolab.objectives.algorithms import AlgorithmSpec


class VLLMConfig(Section):
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


class RolloutConfig(Section):
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


class EvalConfig(Section):
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


class RunSettings(Protocol):
    """What the rollout layer reads of a whole run's config (``grpolab.config.RunConfig`` is one, assembled a
    layer above): the sections that an engine's checks set against each other."""

    model: ModelConfig
    algorithm: AlgorithmSpec
    rollout: RolloutConfig
    eval: EvalConfig

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self: ...
