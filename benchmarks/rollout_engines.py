"""Rollout throughput of the transformers engine vs the vLLM engine, and the cost of a weight sync.

    .venv-vllm/bin/python benchmarks/rollout_engines.py
    .venv-vllm/bin/python benchmarks/rollout_engines.py --prompts 16 --n 8 --max-new-tokens 64
    .venv/bin/python benchmarks/rollout_engines.py --vllm-python .venv-vllm/bin/python   # vLLM in a child

Same run, same tiny warm-started model (the demo's, ``warm_start_model(ArithmeticTask())``), same
prompts and sampling params (temperature 1, no top-k/top-p). Prints completion tokens/s of each
engine and their ratio; then a whole GRPO-like step on the vLLM engine (rollout, one AdamW step
on the batch's log-probs, ``sync_weights``) with the sync's share, and the engine/trainer log-prob
max |diff| right after the sync. Needs vLLM in this interpreter, or ``--vllm-python`` (then the
engine is ``VLLMSubprocessEngine``). Rough figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.batching import collate
from grpolab.logprobs import token_logprobs
from grpolab.rollout import Completion, HFEngine, SamplingParams
from grpolab.rollout.vllm import VLLMEngine, VLLMSubprocessEngine, logprob_diff
from grpolab.tasks import ArithmeticTask
from grpolab.tinymodel import warm_start_model


def flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for g in groups for c in g]


def time_generate(engine, prompts: list[list[int]], n: int, params: SamplingParams, repeats: int) -> tuple[float, int]:
    """(median seconds, completion tokens) of ``repeats`` timed calls after one warm-up call."""
    engine.generate(prompts[:2], 2, params)
    seconds, tokens = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        out = engine.generate(prompts, n, params)
        seconds.append(time.perf_counter() - started)
        tokens = sum(len(c.completion_ids) for c in flat(out))
    return statistics.median(seconds), tokens


def train_step(model, optimizer, completions: list[Completion], pad_id: int) -> float:
    """One AdamW step raising the log-likelihood of the completions (a stand-in for a GRPO update)."""
    started = time.perf_counter()
    batch = collate(completions, pad_id)
    model.train()
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
    (-(lp * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the HF engine / trainer")
    parser.add_argument("--vllm-python", help="run vLLM in a child process under this interpreter")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    task = ArithmeticTask()
    model_dir = warm_start_model(task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = task.train_examples()[: args.prompts]
    prompts = [tokenizer.encode(task.prompt(e), add_special_tokens=False) for e in examples]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    print(f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters); "
          f"{len(prompts)} prompts x {args.n} completions, <= {args.max_new_tokens} new tokens; "
          f"torch threads {torch.get_num_threads()}")

    hf_s, hf_tokens = time_generate(HFEngine(model, tokenizer, max_batch_size=len(prompts) * args.n),
                                    prompts, args.n, params, args.repeats)
    started = time.perf_counter()
    if args.vllm_python:
        engine = VLLMSubprocessEngine(model_dir, tokenizer, python=args.vllm_python, dtype="float32", seed=0)
    else:
        engine = VLLMEngine(model_dir, tokenizer, dtype="float32", seed=0, enforce_eager=True)
    start_s = time.perf_counter() - started
    try:
        vllm_s, vllm_tokens = time_generate(engine, prompts, args.n, params, args.repeats)
        print(f"{'engine':<8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
        print(f"{'hf':<8} {hf_tokens:>7} {hf_s:>8.2f} {hf_tokens / hf_s:>9.0f}")
        print(f"{'vllm':<8} {vllm_tokens:>7} {vllm_s:>8.2f} {vllm_tokens / vllm_s:>9.0f}   "
              f"(engine start {start_s:.1f} s)")
        print(f"vllm / hf throughput: {(vllm_tokens / vllm_s) / (hf_tokens / hf_s):.2f}x")

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            completions = flat(engine.generate(prompts, args.n, params))
            t1 = time.perf_counter()
            train_s = train_step(model, optimizer, completions, tokenizer.pad_token_id)
            t2 = time.perf_counter()
            engine.sync_weights(model)
            steps.append((t1 - t0, train_s, time.perf_counter() - t2))
        rollout_s, train_s, sync_s = (statistics.median(x) for x in zip(*steps))
        total = rollout_s + train_s + sync_s
        print(f"step (median of {args.repeats}): rollout {rollout_s:.2f} s + train {train_s:.2f} s + "
              f"sync {sync_s:.3f} s = {total:.2f} s; sync is {100 * sync_s / total:.1f} % of the step")

        completions = flat(engine.generate(prompts, args.n, params))
        batch = collate(completions, tokenizer.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
        check = logprob_diff(batch.engine_logprobs, lp, batch.response_mask)
        print(f"after sync: engine vs trainer log-prob |diff| max {check.max_abs_diff:.2e}, "
              f"mean {check.mean_abs_diff:.2e} over {check.num_tokens} tokens")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
