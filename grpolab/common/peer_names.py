"""Other frameworks' setting names and the grpolab settings that correspond, for the line an unknown field gets.

``TRL_GRPO``: TRL 1.16's ``GRPOConfig`` (``trl/trainer/grpo_config.py``) and the ``TrainingArguments`` fields it
inherits (``transformers/training_args.py``, through ``trl/trainer/base_config.py``), and the flags its ``trl grpo``
command adds (``ModelConfig`` in ``trl/trainer/model_config.py``; ``GRPOScriptArguments`` and ``ScriptArguments`` in
``trl/scripts/grpo.py`` and ``trl/scripts/utils.py``). Each TRL name maps to
``(grpolab field, note)``: the field is a dotted config name, or None where nothing corresponds; the note, when
not empty, says how the meaning differs (or, without a field, what comes closest). A key ``name=value`` words
one value of a field (``loss_type=dapo``): it is looked up before the plain name. ``OLDER_TRL_NAMES`` are names
users bring from other TRL or transformers versions, which TRL 1.16 (beside transformers 5.19) does not have.

``grpolab.common.fields.unknown_field`` turns an entry into 'learning_rate: unknown field; did you mean optim.lr?
(TRL's learning_rate; ...)'; docs/from-trl.md is the long form of this table.
"""

from __future__ import annotations

from grpolab.common.tracker_names import tracker_names

NO_SCHEDULE = "the learning rate is constant here (optim.lr): no scheduler, no warmup"
CONSTANT_LR = "constant here: no scheduler, no warmup"
TOKEN_REDUCTION = "--algorithm.aggregation token"

TRL_GRPO: dict[str, tuple[str | None, str]] = {
    # the model and the reference
    "model_init_kwargs": ("model.dtype", "and model.revision: the loading settings grpolab takes"),
    "trust_remote_code": (None, "models load without custom code"),
    "router_aux_loss_coef": ("model.router_aux_loss_coef", "0 (off) by default; TRL's None takes the model's value"),
    "disable_dropout": (
        None,
        "the policy's dropout is always off here, so the update computes the policy that sampled",
    ),
    "cast_lm_head_to_fp32": (None, "the output layer runs in model.dtype; the log-softmax after it in float32"),
    "sync_ref_model": (None, "the reference is the frozen start policy (reference = 'frozen', or algorithm.beta > 0)"),
    "ref_model_mixup_alpha": (None, "the reference is the frozen start policy"),
    "ref_model_sync_steps": (None, "the reference is the frozen start policy"),
    # data
    "remove_unused_columns": (None, "a reward function gets the data row as info['fields']"),
    "shuffle_dataset": (None, "the prompts are always drawn in a fresh shuffle of each pass, seeded by seed"),
    "max_prompt_length": (
        "rollout.max_prompt_tokens",
        "not a GRPOConfig field in TRL 1.16; a longer prompt is refused here, never truncated",
    ),
    "pad_to_multiple_of": (None, "a micro-batch is padded to its longest sequence"),
    # the batch and the schedule
    "num_generations": ("rollout.group_size", ""),
    "num_generations_eval": ("eval.pass_n", "sampled pass@k (eval.pass_k); the evaluation itself is greedy"),
    "per_device_train_batch_size": (
        "optim.micro_batch_size",
        "sequences per forward here; the batch of a step is rollout.prompts_per_step x rollout.group_size",
    ),
    "gradient_accumulation_steps": (
        None,
        "an optimizer step accumulates over the whole rollout batch (rollout.prompts_per_step x "
        "rollout.group_size) in micro-batches of optim.micro_batch_size",
    ),
    "generation_batch_size": ("rollout.prompts_per_step", "counted in prompts here, in completions in TRL"),
    "steps_per_generation": ("algorithm.steps_per_epoch", "optimizer steps the rollout batch is split into"),
    "num_iterations": ("algorithm.epochs", "passes over each rollout batch"),
    "max_steps": (
        "steps",
        "RL steps (rollout batches) here, optimizer steps in TRL: a step makes algorithm.epochs x "
        "algorithm.steps_per_epoch updates",
    ),
    "num_train_epochs": ("steps", "a run is counted in RL steps; the prompts are reshuffled at each pass"),
    # generation
    "max_completion_length": ("rollout.max_new_tokens", ""),
    "temperature": ("rollout.temperature", ""),
    "top_p": ("rollout.top_p", "training samples the untruncated policy (1 only); eval.top_p for pass@k"),
    "top_k": ("rollout.top_k", "training samples the untruncated policy (0 only); eval.top_k for pass@k"),
    "min_p": (None, "training samples the untruncated policy"),
    "repetition_penalty": (None, "training samples the untruncated policy"),
    "generation_kwargs": (None, "the rollouts sample the untruncated policy; rollout.stop_strings ends completions"),
    "chat_template_kwargs": ("task.prompt.chat_template_kwargs", ""),
    "cache_implementation": (None, "rollout.engine 'hf' is grpolab's own decoding loop with its own cache"),
    "use_transformers_continuous_batching": (None, "rollout.engine 'hf' (grpolab's decoding loop) or 'vllm'"),
    "transformers_continuous_batching_config": (None, "rollout.engine 'hf' (grpolab's decoding loop) or 'vllm'"),
    "use_transformers_paged": (None, "rollout.engine 'hf' (grpolab's decoding loop) or 'vllm'"),
    "max_tool_calling_iterations": ("task.tools.max_turns", "generation turns, the last answer's included"),
    # vLLM
    "use_vllm": ("rollout.engine", "--engine vllm: colocated vLLM, weights synced every step"),
    "vllm_mode": ("rollout.engine", "colocated only (rollout.vllm.python runs it in a process of its own); no server"),
    "vllm_gpu_memory_utilization": ("rollout.vllm.gpu_memory_utilization", ""),
    "vllm_enable_sleep_mode": ("rollout.vllm.sleep_level", "level 1 by default where the platform has it (GPU)"),
    "vllm_max_model_length": (None, "vLLM's context is set from the prompts and rollout.max_new_tokens"),
    "vllm_tensor_parallel_size": (None, "vLLM runs without tensor parallelism"),
    "vllm_model_impl": (None, "not set: vLLM's own default"),
    "vllm_structured_outputs_regex": (None, "the rollouts sample the untruncated policy"),
    "vllm_server_base_url": (None, "no vLLM server mode: vLLM is colocated (rollout.engine 'vllm')"),
    "vllm_server_host": (None, "no vLLM server mode: vLLM is colocated (rollout.engine 'vllm')"),
    "vllm_server_port": (None, "no vLLM server mode: vLLM is colocated (rollout.engine 'vllm')"),
    "vllm_server_timeout": (None, "no vLLM server mode: vLLM is colocated (rollout.engine 'vllm')"),
    "vllm_group_port": (None, "no vLLM server mode: vLLM is colocated (rollout.engine 'vllm')"),
    "vllm_importance_sampling_correction": (
        "algorithm.rollout_correction",
        "'none' turns it off; 'auto' (default) corrects a bf16 or stale engine, TRL's default is sequence_mask",
    ),
    "vllm_importance_sampling_mode": ("algorithm.rollout_correction", "the same mode names"),
    "vllm_importance_sampling_clip_max": ("algorithm.rollout_correction_upper", "2 here, 3 in TRL"),
    "vllm_importance_sampling_cap": ("algorithm.rollout_correction_upper", "2 here, 3 in TRL"),
    "vllm_importance_sampling_clip_min": ("algorithm.rollout_correction_lower", ""),
    # the objective
    "loss_type": ("algorithm.name", "grpolab's presets: grpolab algorithms, docs/from-trl.md"),
    "loss_type=grpo": ("algorithm.name", "'grpo' is --algo grpo, the same per-sequence mean; TRL's default is dapo"),
    "loss_type=dapo": (
        "algorithm.name",
        f"'dapo' is the token-mean reduction only, --algo grpo {TOKEN_REDUCTION} here; "
        "--algo dapo adds eps_high 0.28 and dynamic sampling",
    ),
    "loss_type=dr_grpo": (
        "algorithm.name",
        "'dr_grpo' is the constant-denominator reduction only, --algorithm.aggregation constant here; "
        "--algo dr_grpo also drops the std (TRL's scale_rewards none)",
    ),
    "loss_type=bnpo": (
        "algorithm.name",
        f"'bnpo' is a token mean per micro-batch: {TOKEN_REDUCTION} is its split-invariant form; "
        "--algo bnpo is the BNPO paper's advantage",
    ),
    "loss_type=cispo": (
        "algorithm.name",
        "'cispo' is --algo cispo, its ratio capped at 1 + eps_high (TRL: epsilon_high)",
    ),
    "loss_type=sapo": ("algorithm.name", "'sapo' is --algo sapo"),
    "loss_type=luspo": ("algorithm.name", "'luspo' is --algo luspo"),
    "loss_type=vespo": ("algorithm.name", "'vespo' is --algo vespo"),
    "importance_sampling_level": ("algorithm.weight", "'sequence' (GSPO) is --algorithm.weight gspo, or --algo gspo"),
    "importance_sampling_level=sequence": (
        "algorithm.weight",
        "'sequence' is --algorithm.weight gspo; --algo gspo also sets GSPO's clip range 3e-4/4e-4 and 4 minibatches",
    ),
    "importance_sampling_level=token": ("algorithm.weight", "'token' is 'clip', the default: one ratio per token"),
    "scale_rewards": ("algorithm.normalizer", "'group' is 'std' (the default), 'batch' 'batch_std', 'none' 'none'"),
    "scale_rewards=group": ("algorithm.normalizer", "'group' is 'std', the default"),
    "scale_rewards=true": ("algorithm.normalizer", "true ('group') is 'std', the default"),
    "scale_rewards=batch": ("algorithm.normalizer", "'batch' is 'batch_std' (the lite_ppo preset)"),
    "scale_rewards=none": ("algorithm.normalizer", "'none' is 'none' (as in the dr_grpo preset)"),
    "scale_rewards=false": ("algorithm.normalizer", "false ('none') is 'none' (as in the dr_grpo preset)"),
    "multi_objective_aggregation": ("algorithm.multi_objective_aggregation", ""),
    "reward_weights": ("task.rewards[].weight", "each reward's weight in its [[task.rewards]] table"),
    "mask_truncated_completions": (
        None,
        "a truncated completion is not dropped here; reward.truncation_penalty and reward.overlong_buffer "
        "penalize it instead",
    ),
    "beta": ("algorithm.beta", "here the KL term is a token mean over the step whatever the loss's reduction"),
    "epsilon": (
        "algorithm.eps_low",
        "it is also the upper side unless epsilon_high is set: set algorithm.eps_high too",
    ),
    "epsilon_high": ("algorithm.eps_high", ""),
    "delta": ("algorithm.clip_delta", ""),
    "sapo_temperature_neg": ("algorithm.sapo_temperature_neg", ""),
    "sapo_temperature_pos": ("algorithm.sapo_temperature_pos", ""),
    "vespo_k_pos": ("algorithm.vespo_k_pos", ""),
    "vespo_lambda_pos": ("algorithm.vespo_lambda_pos", ""),
    "vespo_k_neg": ("algorithm.vespo_k_neg", ""),
    "vespo_lambda_neg": ("algorithm.vespo_lambda_neg", ""),
    "top_entropy_quantile": ("algorithm.top_entropy_quantile", ""),
    "entropy_coef": ("algorithm.entropy_coef", ""),
    "use_adaptive_entropy": ("algorithm.use_adaptive_entropy", ""),
    "entropy_coef_min": ("algorithm.entropy_coef_min", ""),
    "entropy_coef_max": ("algorithm.entropy_coef_max", ""),
    "entropy_coef_delta": ("algorithm.entropy_coef_delta", ""),
    "entropy_target": ("algorithm.entropy_target", ""),
    "off_policy_mask_threshold": ("algorithm.off_policy_mask_delta", ""),
    "use_bias_correction_kl": ("algorithm.use_bias_correction_kl", "off by default here, on in TRL"),
    # the optimizer (TrainingArguments)
    "learning_rate": ("optim.lr", CONSTANT_LR),
    "lr_scheduler_type": (None, NO_SCHEDULE),
    "lr_scheduler_kwargs": (None, NO_SCHEDULE),
    "warmup_steps": (None, NO_SCHEDULE),
    "warmup_ratio": (None, NO_SCHEDULE),
    "weight_decay": ("optim.weight_decay", ""),
    "adam_beta1": ("optim.betas", "a pair, e.g. --optim.betas '[0.9, 0.999]'; (0.9, 0.95) by default here"),
    "adam_beta2": ("optim.betas", "a pair, e.g. --optim.betas '[0.9, 0.999]'; (0.9, 0.95) by default here"),
    "adam_epsilon": (None, "AdamW's eps is 1e-8, as transformers' default"),
    "max_grad_norm": ("optim.max_grad_norm", ""),
    # precision, memory, devices
    "bf16": ("model.dtype", "'bfloat16' (the default on CUDA); optim.precision 'fp32_master' keeps float32 weights"),
    "fp16": ("model.dtype", "no float16 here: 'bfloat16' or 'float32'"),
    "tf32": (None, "no TF32 switch"),
    "gradient_checkpointing": ("model.gradient_checkpointing", "off by default here, on in TRL"),
    "use_cpu": ("model.device", "'cpu'"),
    "fsdp": ("dist.strategy", "'fsdp', under torchrun"),
    "deepspeed": ("dist.strategy", "no DeepSpeed: 'ddp' or 'fsdp', under torchrun"),
    "torch_compile": (None, "no torch.compile switch"),
    # logging, evaluation, checkpoints
    "logging_steps": ("log_every", "the console's line of vital signs; metrics.jsonl gets every step"),
    "report_to": ("log.trackers", ", ".join(tracker_names())),
    "run_name": ("log.run_name", ""),
    "project": ("log.project", ""),
    "trackio_space_id": (None, "the TRACKIO_SPACE_ID environment variable (log.trackers trackio)"),
    "log_completions": ("log.completions_every", "the trackers get a table of sampled completions every N steps"),
    "num_completions_to_print": ("log.completions_max", "rows of a completions table"),
    "eval_strategy": ("eval.every", "evaluation is on by default: at step 0, every eval.every steps and the last"),
    "eval_steps": ("eval.every", ""),
    "eval_on_start": ("eval.every", "step 0 is always evaluated"),
    "save_strategy": ("checkpoint.every", ""),
    "save_steps": ("checkpoint.every", ""),
    "save_total_limit": ("checkpoint.keep_last", ""),
    "resume_from_checkpoint": (None, "grpolab train --resume RUN_DIR continues a run from its newest checkpoint"),
    "data_seed": ("seed", "one seed for the whole run; a task's own data seed is task.seed or task.split_seed"),
    # the trl grpo command's model and data flags
    "model_name_or_path": ("model.path", "--model: a hub id, a folder or gguf:FILE"),
    "model_revision": ("model.revision", ""),
    "dtype": ("model.dtype", "'auto', 'float32' or 'bfloat16'"),
    "attn_implementation": (None, "SDPA, unless the model needs another kernel to compute as designed"),
    "use_peft": ("model.lora", "setting any of its fields turns LoRA on, e.g. --model.lora.rank 16"),
    "lora_r": ("model.lora.rank", ""),
    "lora_alpha": ("model.lora.alpha", ""),
    "lora_dropout": ("model.lora.dropout", ""),
    "lora_target_modules": ("model.lora.target_modules", ""),
    "lora_modules_to_save": ("model.lora.modules_to_save", ""),
    "load_in_4bit": (None, "no quantized training"),
    "load_in_8bit": (None, "no quantized training"),
    "dataset_name": ("task.train", "with --task dataset: hub:NAME[:CONFIG]:SPLIT, or a .jsonl / .parquet file"),
    "dataset_config": ("task.train", "hub:NAME:CONFIG:SPLIT"),
    "dataset_train_split": ("task.train", "hub:NAME[:CONFIG]:SPLIT"),
    "dataset_test_split": ("task.validation", "hub:NAME[:CONFIG]:SPLIT"),
    "reward_funcs": (
        "task.rewards",
        "[{function = 'my_lib.rewards:custom_reward'}] (a colon before the function), or a verifier: numeric, "
        "math, exact, regex",
    ),
    "reward_model_name_or_path": ("task.rewards", "[{function = 'model:DIR'}]"),
}

OLDER_TRL_NAMES = frozenset({"max_prompt_length", "warmup_ratio"})

PEER_NAMES: dict[str, dict[str, tuple[str | None, str]]] = {"TRL": TRL_GRPO}
"""Each framework's names, by the framework's name as the line says it ("TRL's learning_rate")."""
