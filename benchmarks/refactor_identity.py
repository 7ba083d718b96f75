"""A refactor changes no number: seeded runs of one source tree, hashed, to compare with another tree's.

    python benchmarks/refactor_identity.py run --tree OLD_CHECKOUT --out before.json
    python benchmarks/refactor_identity.py run --tree . --out after.json
    python benchmarks/refactor_identity.py compare before.json after.json

Each tree's package runs from its own folder (``PYTHONPATH``), with its own empty warm-start cache (so the
demo's warm starts are rebuilt by the tree's own code), on one thread. The runs: the demo (a warm-started
tiny model), a GSM8K-shaped run (r1_zero prompts on the real GSM8K files, a tiny random model with a long
context, a frozen reference), the calculator tool task (multi-turn, observations masked), LoRA on the
real SmolLM2-135M-Instruct (chat template), a Mixture-of-Experts policy with Rollout Routing Replay, GDPO's
decoupled advantages and GPG's rescaled ones, the vLLM engine (where installed) and two data-parallel ranks under torchrun. For each run the hashes of its
metrics (every record, timing fields left out), its evaluation records and every checkpoint file's
tensors (weights, adapters, optimizer state and RNGs) are recorded; ``compare`` lists what differs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "data" / "gsm8k"
WARM = ["--model.warm_start", "{steps = 60}"]  # a shorter warm start than the demo's: same code, less time
SHORT = ["--threads", "1", "--eval.every", "2", "--checkpoint.every", "2", "--eval.n_examples", "16"]

RUNS: dict[str, list[str]] = {
    "demo": ["demo", "--steps", "4", *WARM, *SHORT],
    "gsm8k": [
        "train",
        "--task",
        "gsm8k",
        "--task.train_path",
        str(GSM8K / "train.jsonl"),
        "--task.test_path",
        str(GSM8K / "test.jsonl"),
        "--task.n_train",
        "16",
        "--task.n_val",
        "4",
        "--model",
        "{tiny_long}",
        "--steps",
        "2",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "4",
        "--rollout.max_new_tokens",
        "16",
        "--optim.micro_batch_size",
        "1",
        "--model.gradient_checkpointing",
        "true",
        "--reference",
        "frozen",
        "--algorithm.beta",
        "0.04",
        "--threads",
        "1",
        "--eval.every",
        "1",
        "--checkpoint.every",
        "1",
    ],
    "tool": [
        "train",
        "--task",
        "calculator",
        "--steps",
        "2",
        "--model.warm_start",
        "{steps = 40}",
        "--rollout.prompts_per_step",
        "4",
        "--rollout.group_size",
        "4",
        *SHORT,
    ],
    "lora": [
        "train",
        "--config",
        "configs/smollm2_arithmetic.toml",
        "--steps",
        "2",
        "--model.lora.rank",
        "8",
        "--optim.lr",
        "2e-4",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "4",
        "--rollout.max_new_tokens",
        "16",
        "--task.n_val",
        "8",
        "--threads",
        "1",
        "--eval.every",
        "2",
        "--checkpoint.every",
        "1",
    ],
    "moe": [
        "demo",
        "--steps",
        "4",
        "--model.warm_start",
        '{arch = "qwen3_moe", num_experts = 8, experts_per_token = 2, moe_intermediate_size = 64, steps = 40}',
        "--algo",
        "gspo",
        "--algorithm.routing_replay",
        "true",
        *SHORT,
    ],
    "vllm": ["demo", "--steps", "3", *WARM, "--engine", "vllm", *SHORT],
    "gdpo": [
        "demo",
        "--steps",
        "3",
        *WARM,
        "--algo",
        "gdpo",
        "--reward.truncation_penalty",
        "0.5",
        *SHORT,
    ],  # terms apart
    "gpg": ["demo", "--steps", "3", *WARM, "--algo", "gpg", *SHORT],  # GPG's rescaling over the batch
    "ddp": ["torchrun", "demo", "--steps", "3", *WARM, *SHORT],
}
TIMING = ("time/", "timing/")
UNSEEDED = ("python", "numpy")  # a run seeds torch only; nothing it computes draws from these


def _tiny_long_model(folder: Path) -> Path:
    """A tiny random Llama whose context holds a GSM8K prompt (the tests' character-level tokenizer)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from conftest import _config, build_char_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(1234)
    config = _config("llama", len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, 2048)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _tensors_digest(obj, digest) -> None:
    """Feed every tensor (dtype, shape, bytes) and every plain value of a loaded state, in order."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            digest.update(str(key).encode())
            _tensors_digest(obj[key], digest)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors_digest(item, digest)
    else:
        digest.update(repr(obj).encode())


def _digest(obj) -> str:
    digest = hashlib.sha256()
    _tensors_digest(obj, digest)
    return digest.hexdigest()


def _file_digests(path: Path) -> dict[str, str]:
    """'' -> the digest of a weights file; ':KEY' -> one per top-level entry of a saved state."""
    import torch
    from safetensors.torch import load_file

    if path.suffix == ".safetensors":
        return {"": _digest(load_file(path))}
    state = torch.load(io.BytesIO(path.read_bytes()), weights_only=False)
    if isinstance(state, dict) and "rng_by_rank" in state:  # Python's and NumPy's generators are never seeded
        state["rng_by_rank"] = [{k: v for k, v in r.items() if k not in UNSEEDED} for r in state["rng_by_rank"]]
        state["rng"] = state["rng_by_rank"][0]
    return (
        {f":{key}": _digest(value) for key, value in state.items()} if isinstance(state, dict) else {"": _digest(state)}
    )


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING) and k != "tokens_per_s"}


def hash_run(run: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out["metrics"] = hashlib.sha256(json.dumps([_untimed(r) for r in lines], sort_keys=True).encode()).hexdigest()
    for path in sorted((run / "eval").rglob("*")):
        if path.is_file():
            out[f"eval/{path.relative_to(run / 'eval')}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    for path in sorted((run / "checkpoints").rglob("*")):
        if path.is_file() and path.suffix in (".safetensors", ".pt", ".bin") and "damaged" not in path.parts:
            out.update(
                {
                    f"checkpoints/{path.relative_to(run / 'checkpoints')}{part}": value
                    for part, value in _file_digests(path).items()
                }
            )
    return out


def run_tree(tree: Path, out: Path, only: list[str] | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="identity-"))
    env = {**os.environ, "PYTHONPATH": str(tree), "GRPOLAB_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1"}
    models = {"tiny_long": str(_tiny_long_model(work / "tiny_long"))}
    results: dict[str, dict] = {}
    for name, args in RUNS.items():
        if only and name not in only:
            continue
        if name == "vllm" and subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode:
            print(f"{name}: skipped (vLLM not installed)", flush=True)
            continue
        args = [models.get(a.strip("{}"), a) if a.startswith("{tiny") else a for a in args]
        prefix = [sys.executable, "-m", "grpolab"]
        if args[0] == "torchrun":
            prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "grpolab"]
            args = args[1:]
        run_dir = work / "runs" / name
        started = time.perf_counter()
        log = work / f"{name}.log"
        with log.open("w") as fh:
            rc = subprocess.run(
                [*prefix, *args, "--output-dir", str(run_dir)], cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT
            ).returncode
        seconds = time.perf_counter() - started
        if rc:
            print(f"{name}: exit {rc} after {seconds:.0f} s; log:\n{log.read_text()[-3000:]}", flush=True)
            results[name] = {"exit": str(rc)}
            continue
        results[name] = hash_run(run_dir)
        print(f"{name}: {len(results[name])} hashes in {seconds:.0f} s", flush=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))
    shutil.rmtree(work, ignore_errors=True)


def compare(a: Path, b: Path) -> int:
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    differ = 0
    for name in sorted(set(left) | set(right)):
        x, y = left.get(name, {}), right.get(name, {})
        bad = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        differ += bool(bad)
        print(f"{name}: {'identical' if not bad else 'DIFFERS: ' + ', '.join(bad[:8])} ({len(x)} / {len(y)} hashes)")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--tree", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--only", nargs="*")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "compare":
        return compare(args.a, args.b)
    run_tree(args.tree.resolve(), args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
