"""Does a learned reward teach? A tiny reward model trained to prefer correct sums, then RL runs whose
only reward is that model, with accuracy measured by the verifier (weight 0).

    python benchmarks/reward_model_learning.py --out DIR --threads 1 --verifier-run

1. The demo's warm-started tiny policy (2-digit sums, r1_zero) samples ``--samples`` completions for each
   of ``--rm-prompts`` train questions; the verifier labels them, and the worked solutions join as more
   correct texts. Every (correct, incorrect) pair of texts of one question is a preference pair.
2. A reward model starts from the policy's own weights (``AutoModelForSequenceClassification``, one label,
   a new score head) and is trained ``--rm-steps`` steps with the Bradley-Terry loss on those pairs; how
   often it ranks a correct completion of a held-out question above an incorrect one is printed.
3. RL (grpo): the same arithmetic rows as a dataset task whose rewards are ``numeric`` with weight 0 (it
   still measures accuracy) and ``model:DIR`` with weight 1, once with a KL penalty ``--beta`` to the start
   policy ("rm + KL") and once without ("rm": the policy is free to find what the reward model misjudges,
   and the final correlation of its score with correctness shows it). The step-0 and final greedy
   evaluations are paired item by item: the bootstrap CI of the accuracy gain is printed
   (``--verifier-run``: the verifier as the reward, for reference).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from grpolab.common.progress import Reporter
from grpolab.config import load_config
from grpolab.models.tinymodel import WarmStartSettings, warm_start_model
from grpolab.objectives.stats import paired_difference
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import train
from grpolab.tasks import ArithmeticTask
from grpolab.tasks.base import Example


def write_rows(path: Path, examples: list[Example]) -> Path:
    path.write_text("".join(json.dumps({"question": e.question, "answer": e.answer}) + "\n" for e in examples))
    return path


Sample = tuple[int, str, float]  # (question index, prompt + completion, correct)


@torch.no_grad()
def sample_completions(
    policy_dir: Path,
    task: ArithmeticTask,
    examples: list[Example],
    samples: int,
    max_new_tokens: int,
    seed: int,
    solutions: bool,
    reporter: Reporter,
) -> list[Sample]:
    """``samples`` completions of each example at temperature 1, graded by the verifier; with ``solutions``,
    each example's worked solution joins as one more correct text."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    torch.manual_seed(seed)
    out = []
    with reporter.phase(
        f"sample {samples} completions per question", total=len(examples), unit="questions", every=512
    ) as phase:
        for start in range(0, len(examples), 64):
            out += _sample_batch(
                model, tokenizer, task, examples[start : start + 64], start, samples, max_new_tokens, solutions
            )
            phase.advance(len(examples[start : start + 64]))
    return out


def _sample_batch(
    model,
    tokenizer,
    task: ArithmeticTask,
    batch: list[Example],
    start: int,
    samples: int,
    max_new_tokens: int,
    solutions: bool,
) -> list[Sample]:
    """One generate call for ``batch`` (question indices from ``start``), graded."""
    prompts = [task.prompt(e) for e in batch]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    generated = model.generate(
        **inputs,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=samples,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    out = [
        (
            start + i // samples,
            prompts[i // samples] + text,
            task.grade(text, batch[i // samples], truncated=False).answer_reward,
        )
        for i, text in enumerate(texts)
    ]
    if solutions:
        out += [(start + i, prompt + e.solution, 1.0) for i, (prompt, e) in enumerate(zip(prompts, batch))]
    return out


def preference_pairs(data: list[Sample]) -> list[tuple[str, str]]:
    """(correct text, incorrect text) for every such pair of completions of the same question."""
    by_question: dict[int, list[Sample]] = {}
    for sample in data:
        by_question.setdefault(sample[0], []).append(sample)
    return [
        (good, bad) for group in by_question.values() for _, good, g in group if g > 0 for _, bad, b in group if b == 0
    ]


def train_reward_model(
    policy_dir: Path,
    out: Path,
    pairs: list[tuple[str, str]],
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-4,
    seed: int = 0,
) -> Path:
    """A one-label classifier from the policy's weights, trained with the Bradley-Terry loss
    ``-log sigmoid(r(correct) - r(incorrect))`` on pairs of completions of the same question (only the ranking
    within a group reaches a group-relative advantage); saved with its tokenizer in ``out``."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    model.train()
    for step in range(steps):
        chosen = [pairs[i] for i in rng.choice(len(pairs), size=batch_size, replace=len(pairs) < batch_size)]
        inputs = tokenizer([g for g, _ in chosen] + [b for _, b in chosen], return_tensors="pt", padding=True)
        scores = model(**inputs).logits[:, 0]
        loss = -torch.nn.functional.logsigmoid(scores[:batch_size] - scores[batch_size:]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"reward model step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def within_question_auc(rm_dir: Path, data: list[Sample]) -> float:
    """How often the reward model ranks a correct completion above an incorrect one of the same question
    (ties count half)."""
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    score = {}
    for start in range(0, len(data), 64):
        texts = [t for _, t, _ in data[start : start + 64]]
        score.update(zip(texts, model(**tokenizer(texts, return_tensors="pt", padding=True)).logits[:, 0].tolist()))
    wins = [float(np.sign(score[good] - score[bad])) * 0.5 + 0.5 for good, bad in preference_pairs(data)]
    return float(np.mean(wins)) if wins else float("nan")


def rl_config(policy_dir: Path, train_file: Path, val_file: Path, out: Path, rewards: list[dict], args) -> dict:
    return {
        "model.path": str(policy_dir),
        "output_dir": str(out),
        "steps": args.steps,
        "seed": args.seed,
        "threads": args.threads,
        "task.name": "dataset",
        "task.train": str(train_file),
        "task.validation": str(val_file),
        "task.rewards": rewards,
        "rollout.prompts_per_step": args.prompts,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 48,
        "optim.lr": args.lr,
        "eval.every": args.steps,
        "checkpoint.every": args.steps,
    }


def accuracy_gain(run: Path, steps: int) -> tuple[float, float, tuple[float, float, float]]:
    """(start accuracy, final accuracy, paired gain (estimate, low, high)) from the run's eval records."""

    def correct(step: int) -> np.ndarray:
        lines = (run / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()
        return np.array([json.loads(line)["correct"] for line in lines], dtype=np.float64)

    start, final = correct(0), correct(steps)
    gain = paired_difference(final, start)
    return start.mean(), final.mean(), (gain.estimate, gain.low, gain.high)


def final_eval(run: Path) -> dict:
    """The run's last evaluation record of metrics.jsonl."""
    return [r for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r][-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the models and runs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40, help="RL steps")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per RL step (x 8 samples)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=1.0, help="the KL penalty to the start policy of the rm + KL run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default='{"n_val": 200}', help="JSON settings of the arithmetic task")
    parser.add_argument("--rm-prompts", type=int, default=2048, help="train questions sampled for the reward model")
    parser.add_argument("--samples", type=int, default=4, help="completions per question for the reward model")
    parser.add_argument("--rm-steps", type=int, default=1500)
    parser.add_argument("--rm-lr", type=float, default=3e-4)
    parser.add_argument("--normalize", default="none", choices=["none", "batch", "running"])
    parser.add_argument("--warm-start", default="{}", help="JSON changes to the demo's warm-start recipe")
    parser.add_argument("--verifier-run", action="store_true", help="also train with the verifier as the reward")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=False)
    task = ArithmeticTask(**json.loads(args.task))
    reporter = Reporter(Console())
    policy = warm_start_model(
        task, WarmStartSettings(**json.loads(args.warm_start)), cache_dir=args.out / "cache", reporter=reporter
    )

    started = time.perf_counter()
    train_examples = task.train_examples()
    data = sample_completions(
        policy, task, train_examples[: args.rm_prompts], args.samples, 48, args.seed, True, reporter
    )
    pairs = preference_pairs(data)
    held_out = sample_completions(
        policy,
        task,
        train_examples[args.rm_prompts : args.rm_prompts + 128],
        args.samples,
        48,
        args.seed + 1,
        False,
        reporter,
    )
    rm_dir = train_reward_model(policy, args.out / "reward_model", pairs, args.rm_steps, lr=args.rm_lr, seed=args.seed)
    share = np.mean([c for _, _, c in held_out])
    print(
        f"reward model: {len(pairs)} pairs; held out: {share:.0%} of the samples correct, within-question AUC "
        f"{within_question_auc(rm_dir, held_out):.3f}; {time.perf_counter() - started:.0f} s",
        flush=True,
    )

    train_file = write_rows(args.out / "train.jsonl", train_examples)
    val_file = write_rows(args.out / "val.jsonl", task.validation_examples())
    rm_rewards = [
        {"function": "numeric", "name": "correct", "weight": 0.0},
        {"function": f"model:{rm_dir}", "name": "rm", "weight": 1.0, "options": {"normalize": args.normalize}},
    ]
    runs = {"rm + KL": (rm_rewards, {"reference": "frozen", "algorithm.beta": args.beta}), "rm": (rm_rewards, {})}
    if args.verifier_run:
        runs["verifier"] = ([{"function": "numeric", "name": "correct", "weight": 1.0}], {})
    print(f"{'reward':<10} {'start':>6} {'final':>6} {'gain':>7} {'95% CI':>17} {'rm corr':>8} {'RL s':>6}", flush=True)
    for name, (rewards, changes) in runs.items():
        run = args.out / f"run_{name.replace(' + ', '_')}"
        started = time.perf_counter()
        train(load_config(None, {**rl_config(policy, train_file, val_file, run, rewards, args), **changes}))
        start, final, (gain, low, high) = accuracy_gain(run, args.steps)
        corr = final_eval(run).get("val/reward_model/rm/corr_correct", float("nan"))
        print(
            f"{name:<10} {start:6.3f} {final:6.3f} {gain:+7.3f} [{low:+.3f}, {high:+.3f}] {corr:8.3f} "
            f"{time.perf_counter() - started:6.0f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
