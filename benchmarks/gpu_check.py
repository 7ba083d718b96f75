"""One command for a single-GPU machine without network: does the GPU path run, and with which numbers?

Writes one JSON file (``--out``) with, section by section (a failing section records its error and
the others still run):
  gpu_tests        the GPU tests of the suite (``pytest -m gpu``): the update path on CUDA never mixes
                   devices, bf16 RL steps with the sync check
  rl_steps         a few bf16 RL steps of a small model on CUDA, hf engine, sync check on: reward,
                   engine/trainer log-prob difference, the in-sync noise floor, seconds and peak memory
  weights_changed  the fraction of weights one AdamW step at lr 1e-5 changes under each precision
                   setting (of the stored weights, and of the bf16 weights an engine receives)
  probe_olmo2_1b   ``grpolab probe`` at the OLMo-2-1B reference shapes (like:olmo2-1b, 256 completions
                   of the longest training prompt + 512 tokens, micro-batch 1, chunk 32): peak memory
                   per phase and seconds
The report also records the environment (Python, machine, torch and its CUDA, the driver, the GPU,
package versions), each section's seconds, and for the RL steps the sync check's margin (the largest
step's mean engine/trainer difference over the noise floor, against the multiple that stops a run).
Sized to finish well within 8 minutes on one H200 (an estimate: it has not run on a GPU yet); a guard
(``--budget-seconds``, default 450) skips the sections that would start past it, and at the budget plus
60 s writes the report and exits with 3 whatever is still running. ``--quick`` shrinks everything for
a CPU rehearsal (about 5 minutes on 2 cores). The report and a log of everything printed go into the
folder ``--out-dir`` names (``gpu_check.json``, ``gpu_check.log``).

The target has torch and transformers but no pydantic, math-verify or torch-optimi: prepare their
wheels here with ``python benchmarks/gpu_check.py --download-wheels .gpu_wheels`` (pure Python or
manylinux, a few MB; it also warm-starts the two demo models the sections use into
``.gpu_wheels/cache``, 9 MB, so that the GPU machine's CPU does not train them) and carry that folder;
``--wheels .gpu_wheels`` installs them into a private folder there (no network, no changes to the
interpreter's site-packages) and points ``GRPOLAB_CACHE`` at the prepared warm starts.

    python benchmarks/gpu_check.py --wheels .gpu_wheels --out-dir OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the target lacks, at the versions installed here (pydantic-core must match pydantic exactly)
CARRIED = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
    "torch-optimi",
    "cloudpickle",  # reward functions given from Python (grpolab.train(rewards=[f]))
)


def download_wheels(folder: Path, python: str = "3.12") -> None:
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in CARRIED]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--python-version",
            python,
            "--platform",
            "manylinux_2_17_x86_64",
            "--platform",
            "manylinux2014_x86_64",
            "-d",
            str(folder),
            *pins,
        ],
        check=True,
    )


def warm_start_tasks() -> list:
    """The tasks whose warm-started demo models the sections train: rl_steps's, then weights_changed's."""
    from grpolab.tasks import ArithmeticTask, build_task

    return [build_task(small_config("cpu", ROOT, quick=False).task), ArithmeticTask(n_train=200, n_val=20)]


def prepare_warm_starts(folder: Path, settings=None) -> list[Path]:
    """Warm-start the demo models the sections use into ``folder/cache`` (the ``GRPOLAB_CACHE`` a check
    run with ``--wheels folder`` uses), so that the GPU machine's CPU never trains them. ``settings``:
    the warm-start recipe (default: the demo's, as the sections use). Shows each warm start's progress."""
    from rich.console import Console

    from grpolab.common.progress import Reporter
    from grpolab.models.tinymodel import warm_start_model

    reporter = Reporter(Console())
    return [
        warm_start_model(task, settings, cache_dir=folder / "cache" / "tiny", reporter=reporter)
        for task in warm_start_tasks()
    ]


def use_wheels(folder: Path) -> None:
    """Install the carried wheels into ``folder/site`` (offline) and put it on the path; use the warm
    starts prepared in ``folder/cache`` unless ``GRPOLAB_CACHE`` names another cache."""
    if (folder / "cache").is_dir():
        os.environ.setdefault("GRPOLAB_CACHE", str(folder / "cache"))
    site = folder / "site"
    if not site.is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--no-deps",
                "--target",
                str(site),
                *map(str, sorted(folder.glob("*.whl"))),
            ],
            check=True,
        )
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))


class Tee:
    """Everything printed also goes into the log file."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def write_report(report: dict) -> None:
    Path(report["out"]).write_text(json.dumps(report, indent=2, default=str))


def section(report: dict, name: str, fn, *args, deadline: float = float("inf")) -> None:
    """Run one section; its figures or its error go into the report, which is rewritten every time. A
    section that would start past ``deadline`` (a ``time.monotonic()``) is skipped and says so."""
    if time.monotonic() > deadline:
        report[name] = {"ok": False, "error": "skipped: past the time budget", "seconds": 0.0}
        print(f"[gpu_check] {name}: skipped, past the time budget", flush=True)
        write_report(report)
        return
    started = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        report[name] = {"ok": True, **fn(*args)}
    except Exception as err:  # noqa: BLE001 - one broken section must not hide the others
        report[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    report[name]["seconds"] = round(time.perf_counter() - started, 2)
    print(
        f"[gpu_check] {name}: {'ok' if report[name]['ok'] else report[name]['error']} ({report[name]['seconds']} s)",
        flush=True,
    )
    write_report(report)


def start_guard(report: dict, seconds: float) -> None:
    """At ``seconds`` from now: record the overrun in the report, write it and exit with 3."""

    def expire() -> None:
        report["guard"] = f"stopped at the {seconds:.0f} s guard; sections still running were cut off"
        write_report(report)
        print(f"[gpu_check] {report['guard']}", flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def environment() -> dict:
    """What the check ran on: interpreter, machine, torch and CUDA, driver and GPU, package versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if shutil.which("nvidia-smi")
        else None
    )
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "uname": " ".join(platform.uname()),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "nvidia_smi": smi.stdout.strip() if smi is not None and smi.returncode == 0 else None,
        "packages": {
            name: installed(name)
            for name in ("transformers", "tokenizers", "safetensors", "accelerate", "peft", "numpy", "scipy", *CARRIED)
        },
    }


def sync_margin(steps: list[dict], multiple: float | None, min_floor: float = 0.0) -> dict:
    """The sync check's headroom: the largest step mean |engine - trainer| over the floor the check uses
    (the first checked step's, raised to ``min_floor``, the least the run's check allows), and the multiple
    past which a run stops; ``headroom`` = multiple / that ratio."""
    measured = steps[0].get("sync/noise_floor_mean")
    means = [s["sync/logprob_diff_mean"] for s in steps if s.get("sync/logprob_diff_mean") is not None]
    if not measured or not means:
        return {"largest_mean_over_floor": None, "floor": None, "limit_multiple": multiple, "headroom": None}
    floor = max(measured, min_floor)
    ratio = max(means) / floor
    return {
        "largest_mean_over_floor": ratio,
        "floor": floor,
        "limit_multiple": multiple,
        "headroom": None if multiple is None else multiple / ratio,
    }


def gpu_tests() -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
    if run.returncode != 0:
        raise RuntimeError("pytest failed:\n" + "\n".join(tail))
    return {"summary": tail[-1] if tail else ""}


def small_config(device: str, out: Path, quick: bool, **overrides):
    """The demo's tiny model and task, bf16 (fp32 master weights), the sync check on."""
    from grpolab.config import load_config

    base = {
        "output_dir": str(out),
        "model.device": device,
        "model.dtype": "bfloat16",
        "task.n_train": 200,
        "task.n_val": 32,
        "rollout.prompts_per_step": 16,
        "rollout.group_size": 8,
        "eval.every": 1000,
        "checkpoint.every": 1000,
        "rollout.sync_check": True,
        "optim.lr": 1e-5,
    }
    if quick:
        base.update({"rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 16})
    return load_config(None, {**base, **overrides})


# the E3 suite's tiny Qwen3-MoE (suites/moe_e3.toml); quick: smaller, briefly warm-started
MOE_WARM_START = {"arch": "qwen3_moe", "num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 128}
QUICK_MOE_WARM_START = {
    **MOE_WARM_START,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 1,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "steps": 10,
    "batch_size": 8,
}


def moe_routing(device: str, quick: bool) -> dict:
    """The tiny Qwen3-MoE in bf16 under GRPO, Rollout Routing Replay off and on: how often the training forward
    routes a token otherwise than the hf engine's bf16 generation did (``router/mismatch``), and the engine/
    trainer log-prob differences, step by step. On CPU in float32 the mismatch was 0; bf16 kernels may differ."""
    from rich.console import Console

    from grpolab.run.trainer import Trainer

    keys = (
        "router/mismatch",
        "sync/logprob_diff_mean",
        "sync/logprob_diff_max",
        "router/load_max_violation",
        "router/confidence",
        "reward_mean",
        "actual_updates",
        "time/step",
    )
    out = {}
    for replay in (False, True):
        with tempfile.TemporaryDirectory() as scratch:
            cfg = small_config(
                device,
                Path(scratch) / "run",
                quick,
                **{
                    "model.warm_start": QUICK_MOE_WARM_START if quick else MOE_WARM_START,
                    "algorithm.routing_replay": replay,
                    "rollout.sync_noise_multiple": None,
                    "rollout.sync_max_diff": 100.0,
                    "rollout.sync_mean_diff": 100.0,
                },
            )
            trainer = Trainer(cfg, Console(quiet=True))
            try:
                records = [trainer.train_step(step) for step in range(1, (2 if quick else 5) + 1)]
                out["replay" if replay else "live"] = [{k: r.get(k) for k in keys} for r in records]
            finally:
                trainer.close()
    return out


def rl_steps(device: str, quick: bool) -> dict:
    from rich.console import Console

    from grpolab.commands.probe import peak_memory_mb
    from grpolab.run.trainer import Trainer

    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(small_config(device, Path(scratch) / "run", quick), Console(quiet=True))
        try:
            peaks = {"load": peak_memory_mb(trainer.parts.device, reset=True)}
            steps = []
            for step in range(1, (2 if quick else 5) + 1):
                record = trainer.train_step(step)
                steps.append(
                    {
                        k: record.get(k)
                        for k in (
                            "reward_mean",
                            "accuracy",
                            "sync/logprob_diff_mean",
                            "sync/logprob_diff_max",
                            "sync/noise_floor_mean",
                            "first_update/ratio_mean",
                            "grad_norm",
                            "actual_updates",
                            "time/generate",
                            "time/train",
                            "time/step",
                            "tokens_per_s",
                        )
                    }
                )
            peaks["steps"] = peak_memory_mb(trainer.parts.device)
            precision, multiple = trainer.parts.precision, trainer.cfg.rollout.sync_noise_multiple
            min_floor = trainer.parts.sync_monitor.min_floor
        finally:
            trainer.close()
    return {
        "precision": precision.name,
        "weights": str(precision.storage),
        "compute": str(precision.compute),
        "noise_floor_mean": steps[0]["sync/noise_floor_mean"],
        "sync_margin": sync_margin(steps, multiple, min_floor),
        "steps": steps,
        "peak_memory_mb": peaks,
    }


def async_rollouts(device: str, quick: bool) -> dict:
    """Async rollouts on the device (the engine process on the same GPU through CUDA IPC): k = 0 against sync
    (the records must be equal, timings aside), and k = 1's seconds per step against sync's."""
    from rich.console import Console

    from grpolab.run.rundir import read_metrics
    from grpolab.run.trainer import train

    steps = 2 if quick else 4
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, extra in (
            ("sync", {}),
            ("async_k0", {"rollout.mode": "async", "rollout.max_staleness": 0}),
            ("async_k1", {"rollout.mode": "async", "rollout.max_staleness": 1}),
        ):
            cfg = small_config(device, Path(scratch) / name, quick, steps=steps, **extra)
            train(cfg, Console(quiet=True))
            runs[name] = [r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if "reward_mean" in r]

    def untimed(records):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in records]

    def per_step(records):
        return sum(r["time/step"] for r in records[1:]) / max(1, len(records) - 1)

    return {
        "k0_equals_sync": untimed(runs["sync"]) == untimed(runs["async_k0"]),
        "seconds_per_step": {name: per_step(records) for name, records in runs.items()},
        "k1_staleness_max": [r.get("staleness/max") for r in runs["async_k1"]],
        "ok": untimed(runs["sync"]) == untimed(runs["async_k0"]),
    }


def weights_changed(device: str, quick: bool, steps: int = 10) -> dict:
    """Fraction of weights changed after 1 and ``steps`` AdamW steps at lr 1e-5, per precision setting:
    of the stored weights, and of their bf16 casts (what an engine receives)."""
    import torch
    from transformers import AutoConfig

    from grpolab.models.loading import load_policy
    from grpolab.models.logprobs import token_logprobs
    from grpolab.models.precision import resolve_precision
    from grpolab.models.sources import FolderRequest, resolve_model_dir

    task = warm_start_tasks()[1]
    # quick: the demo's tiny model (torch-optimi's CPU path is slow on a 150k-vocabulary embedding)
    model_dir = (
        resolve_model_dir(None, FolderRequest(task))
        if quick
        else resolve_model_dir("like:qwen3-0.6b", FolderRequest(task, {"num_hidden_layers": 4}))
    )
    rows, length = (2, 16) if quick else (8, 128)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0)).to(device)
    advantages = torch.linspace(-1, 1, rows, device=device)[:, None]
    out = {}
    for setting in ("fp32_master", "bf16_compensated", "bf16"):
        precision = resolve_precision(setting, torch.bfloat16, warn=False)
        model, _ = load_policy(model_dir, precision.storage, torch.device(device))
        optimizer = precision.optimizer(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
        before = [p.detach().clone() for p in model.parameters()]
        n = sum(p.numel() for p in before)
        out[setting] = {"parameters": n}
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast(torch.device(device)):
                logprobs = token_logprobs(model, ids, torch.ones_like(ids), chunk_size=32).logprobs
            (-(advantages * logprobs).mean()).backward()
            optimizer.step()
            if step in (1, steps):
                pairs = list(zip(model.parameters(), before))
                out[setting][f"after_{step}"] = {
                    "stored_changed": sum(int((p.detach() != b).sum()) for p, b in pairs) / n,
                    "bf16_sent_changed": sum(int((p.detach().bfloat16() != b.bfloat16()).sum()) for p, b in pairs) / n,
                }
        del model, optimizer, before
    return out


def probe_olmo2_1b(device: str, quick: bool) -> dict:
    from grpolab.commands.probe import run_probe
    from grpolab.config import load_config

    overrides = {"model": "like:olmo2-1b", "model.device": device, "model.dtype": "bfloat16"}
    if quick:
        # float32: CPU bf16 matmuls at a 100k vocabulary take many minutes without bf16 hardware
        overrides.update(
            {
                "model.like_overrides": {"num_hidden_layers": 1},
                "rollout.prompts_per_step": 2,
                "model.dtype": "bfloat16" if device == "cuda" else "float32",
                "rollout.group_size": 2,
                "rollout.max_new_tokens": 16,
                "task.n_train": 50,
                "task.n_val": 10,
            }
        )
    cfg = load_config(ROOT / "configs" / "gsm8k_olmo2_1b.toml", overrides)
    cfg = cfg.model_copy(
        update={
            "task": cfg.task.model_copy(
                update={"train_path": str(ROOT / cfg.task.train_path), "test_path": str(ROOT / cfg.task.test_path)}
            )
        }
    )
    with tempfile.TemporaryDirectory() as scratch:
        report = run_probe(cfg, Path(scratch) / "probe.json")
    keep = ("batch", "precision", "peak_memory_mb", "phase_peak_memory_mb", "phase_seconds", "updates", "generation")
    return {k: report[k] for k in keep}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("gpu_check"),
        help="folder for gpu_check.json and gpu_check.log (made if missing; files must not exist)",
    )
    parser.add_argument("--wheels", type=Path, help="folder of carried wheels (see --download-wheels)")
    parser.add_argument("--download-wheels", type=Path, metavar="DIR", help="prepare the wheels, then exit")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a rehearsal on CPU")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=450.0,
        help="no section starts after this; the whole check stops 60 s later",
    )
    args = parser.parse_args(argv)
    if args.download_wheels:
        download_wheels(args.download_wheels)
        sys.path.insert(0, str(ROOT))
        for path in prepare_warm_starts(args.download_wheels.resolve()):
            print(f"[gpu_check] warm start ready: {path}", flush=True)
        return 0
    out, log = args.out_dir / "gpu_check.json", args.out_dir / "gpu_check.log"
    if out.exists() or log.exists():
        print(f"error: {out} or {log} exists; name another --out-dir")
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sys.stdout = Tee(sys.stdout, log.open("w"))
    report = {"out": str(out), "budget_seconds": args.budget_seconds, "quick": args.quick}
    start_guard(report, args.budget_seconds + 60)
    if args.wheels:
        use_wheels(args.wheels.resolve())
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(min(4, os.cpu_count() or 1))  # the CPU-side work (warm start, init) is small

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu --quick for a rehearsal)")
        return 2
    report["environment"] = environment()
    report["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    deadline = started + args.budget_seconds
    section(report, "gpu_tests", gpu_tests, deadline=deadline)
    for name, fn in (
        ("rl_steps", rl_steps),
        ("weights_changed", weights_changed),
        ("probe_olmo2_1b", probe_olmo2_1b),
        ("moe_routing", moe_routing),
        ("async_rollouts", async_rollouts),
    ):
        section(report, name, fn, args.device, args.quick, deadline=deadline)
    report["total_seconds"] = round(time.monotonic() - started, 1)
    write_report(report)
    failed = [k for k, v in report.items() if isinstance(v, dict) and not v.get("ok", True)]
    print(f"[gpu_check] wrote {out} in {report['total_seconds']} s; failed sections: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
