"""Peak memory of one log-prob + backward step: chunked output layer vs full logits, side by side.

    python benchmarks/logprob_memory.py                    # 150k vocabulary, 4 x 512 tokens
    python benchmarks/logprob_memory.py --vocab 151936 --seqs 8 --length 1024 --chunk 32

Each variant runs in its own fresh process (so a high-water mark cannot leak between them) on a
tiny randomly initialised Llama with a large vocabulary. On CPU the figure is the growth of peak
resident memory over the process's memory right before the step; on CUDA it is
torch.cuda.max_memory_allocated over the memory allocated before the step.
Prints the peaks and their ratio (full / chunked).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.models.logprobs import token_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.length,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(device)
    ids = torch.randint(0, args.vocab, (args.seqs, args.length), device=device)
    mask = torch.ones_like(ids)

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_mb()

    if args.variant == "full":  # the naive path: all [N, L, V] logits at once, fp32 log-softmax
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logprobs = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    else:
        logprobs = token_logprobs(model, ids, mask, chunk_size=args.chunk).logprobs[:, 1:]
    logprobs.mean().backward()

    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"variant": args.variant, "device": device.type, "peak_mb": round(peak, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--variant", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return
    results = {}
    for variant in ("full", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant], check=True, capture_output=True, text=True
        ).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    full, chunked = results["full"]["peak_mb"], results["chunked"]["peak_mb"]
    print(f"vocab {args.vocab}, {args.seqs} x {args.length} tokens, chunk {args.chunk}, {results['full']['device']}")
    print(
        f"peak memory of log-probs + backward: full logits {full:.0f} MB, chunked {chunked:.0f} MB, "
        f"ratio {full / chunked:.1f}x"
    )


if __name__ == "__main__":
    main()
