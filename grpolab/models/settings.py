"""The model layer's settings that a run config holds: ``[model]`` (with ``[model.lora]``), the training
precision's name (``optim.precision``),
the demo's tiny model and its warm start (``model.warm_start``) and on-policy distillation's teacher
(``[teacher]``), with the rules between them and the algorithm.

Pydantic models and literal types only, apart from the code that builds and loads models (``precision``,
``tinymodel``, ``teacher``): reading, checking or printing a config (``grpolab config``, ``--help``, a refused
field) imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpolab.common.settings import Section
from grpolab.objectives.algorithms import AlgorithmSpec

PrecisionName = Literal["fp32_master", "bf16_compensated", "bf16"]
"""``optim.precision``: where the weights and AdamW's state live with a bf16 compute dtype
(``grpolab.models.precision``)."""

# the MoE model types a warm start can build, and the name of their expert-count field
MOE_ARCHS = {"qwen3_moe": "num_experts", "olmoe": "num_experts", "mixtral": "num_local_experts"}
MOE_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size")


class WarmStartSettings(BaseModel):
    """Tokenizer, model size and supervised warm-start recipe (all part of the cache key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    vocab_size: int = 512
    max_token_length: int | None = None
    arch: str = "llama"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    # untied input/output embeddings and 200 steps: 19% greedy accuracy to start (34-40% with seeds 1, 2),
    # and GRPO then reaches 95-97% in 100 demo steps (benchmarks/demo_outcome.py; tied + 250 steps
    # plateaued at 65-78% in an earlier measurement)
    tie_word_embeddings: bool = False
    # a Mixture-of-Experts MLP in every layer (arch "qwen3_moe", "olmoe" or "mixtral"): num_experts experts of
    # moe_intermediate_size (None: intermediate_size), experts_per_token routed per token; 0 = dense
    num_experts: int = Field(default=0, ge=0)
    experts_per_token: int = Field(default=2, ge=1)
    moe_intermediate_size: int | None = Field(default=None, ge=1)
    steps: int = Field(default=200, ge=0)
    batch_size: int = Field(default=64, ge=1)
    lr: float = 3e-3
    warmup_steps: int = Field(default=10, ge=0)
    final_lr_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    weight_decay: float = 0.0
    max_examples: int | None = Field(default=None, description="use only the first N solved examples")

    @model_validator(mode="after")
    def _experts_fit(self) -> WarmStartSettings:
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
        if bool(self.num_experts) != (self.arch in MOE_ARCHS):
            raise ValueError(
                f"num_experts > 0 goes with a Mixture-of-Experts arch ({', '.join(MOE_ARCHS)}), "
                f"got arch {self.arch!r} and num_experts {self.num_experts}"
            )
        return self

    def shape(self) -> dict[str, Any]:
        """The config fields of the model's size (``build_model``'s keyword arguments)."""
        out = {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.num_experts:
            out["experts"] = {
                MOE_ARCHS[self.arch]: self.num_experts,
                "num_experts_per_tok": self.experts_per_token,
                **(
                    {"moe_intermediate_size": self.moe_intermediate_size or self.intermediate_size}
                    if self.arch == "qwen3_moe"
                    else {}
                ),
            }
        return out


class TeacherConfig(BaseModel):
    """``[teacher]``: the frozen model on-policy distillation learns from."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None,
        description="on-policy distillation's frozen teacher (algorithm opd): a local Hugging Face model folder, a "
        "hub id org/name or gguf:FILE, with the policy's tokenizer; None = no teacher",
    )
    revision: str | None = Field(None, description="with a hub id: its branch, tag or commit (default main)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the teacher's weights; auto = the policy's compute dtype"
    )


def check_teacher_setting(spec: AlgorithmSpec, teacher: TeacherConfig, group_size: int) -> None:
    """One line for a distillation objective without a teacher, a teacher no objective reads, and a group of one
    where the task advantage (its group baseline) still counts."""
    if spec.needs_teacher and teacher.path is None:
        raise ValueError(
            f"algorithm {spec.name} (teacher_kl_coef {spec.teacher_kl_coef:g}) needs a teacher: set teacher.path "
            "(--teacher.path DIR, a hub id org/name or gguf:FILE with the policy's tokenizer)"
        )
    if teacher.path is not None and not spec.needs_teacher:
        raise ValueError(
            f"teacher.path {teacher.path}: algorithm {spec.name} does not read a teacher (teacher_kl_coef 0); "
            "use --algo opd or set algorithm.teacher_kl_coef, or drop teacher.path"
        )
    if spec.needs_teacher and spec.reward_coef and spec.baseline == "mean" and group_size < 2:
        raise ValueError(
            f"rollout.group_size 1 with reward_coef {spec.reward_coef:g} and the group-mean baseline: every task "
            "advantage would be 0; use group_size >= 2, or reward_coef 0 (pure distillation)"
        )


class LoraSettings(Section):
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


class ModelConfig(Section):
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
