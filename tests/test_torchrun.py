"""The trainer under ``torchrun --nproc_per_node 2`` on CPU (gloo): the same numbers as one process on the
same global batch, one writer, errors that end every rank, and checkpoints one process continues.

Each rank generates its own prompt groups; with ``rollout.max_batch_size`` equal to a rank's rows, its
generation batches are exactly those of the one-process run (engines seed a batch by its global
position), so the two runs see the same samples and must compute the same update.

Each case starts interpreters for two ranks (20-100 s on 2 cores): the default tier keeps one DDP run, one
FSDP run that continues a two-process checkpoint (LoRA, DAPO's resampling, a KL penalty) and one failing rank;
the other cases are ``slow``. The update's exactness over ranks for each loss aggregation is proven in
seconds by test_distributed.py (the ranks as threads)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpolab.commands.cli import main
from grpolab.run.rundir import read_metrics
from grpolab.run.state import STATE_FILE
from grpolab.tasks.stream import PromptStream

TESTS = Path(__file__).resolve().parent
TASK = {"n_train": 60, "n_val": 16, "digits": 1}
PROMPTS, GROUP = 4, 8
# numbers that depend on wall time or on each rank's padding width, not on the maths
# sync/margin is a ratio of two float32 noise floors (~1e-7 each): it is not reproducible across process counts
NOT_COMPARED = ("time/", "tokens_per_s", "tokens/masked_padding", "sync/margin")


def blank_ids() -> list[str]:
    """The training prompts that score 0: all of step 2's (a step with no signal, skipped on every rank)
    and rank 1's of step 3 (a step where rank 1 has nothing to backpropagate)."""
    from custom_task import ArithmeticWithBlanks

    stream = PromptStream(ArithmeticWithBlanks(**TASK).train_examples(), seed=0)
    steps = [stream.take(PROMPTS) for _ in range(3)]
    return [e.id for e in steps[1] + steps[2][PROMPTS // 2 :]]


def run_args(
    model_dir: Path, out: Path, algo: str, steps: int = 3, task_args: list[str] | None = None, **task
) -> list[str]:
    """A small run's arguments; its task is ``task_args``, else the arithmetic with blanks (``task`` changes)."""
    args = [
        "train",
        "--model",
        str(model_dir),
        "--output-dir",
        str(out),
        "--algo",
        algo,
        "--steps",
        str(steps),
        "--rollout.prompts_per_step",
        str(PROMPTS),
        "--rollout.group_size",
        str(GROUP),
        "--rollout.max_new_tokens",
        "40",
        "--rollout.max_batch_size",
        str(PROMPTS * GROUP // 2),
        "--optim.micro_batch_size",
        "6",
        "--optim.lr",
        "1e-4",
        "--eval.every",
        "2",
        "--checkpoint.every",
        "1",
        "--threads",
        "1",
    ]
    if task_args is not None:
        return args + task_args
    args += ["--task.name", "custom_task:ArithmeticWithBlanks", "--task.blank", json.dumps(blank_ids())]
    for key, value in {**TASK, **task}.items():
        args += [f"--task.{key}", json.dumps(value)]
    return args


def torchrun_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``grpolab ARGS`` under a standalone torchrun of 2 processes: its command line and its environment (one
    thread a process; this folder's modules importable, for the tests' tasks)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return [*command, "-m", "grpolab", *args], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def torchrun(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    command, env = torchrun_command(args)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def steps_of(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's weights: the model's, or a LoRA run's adapter."""
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    return load_file(
        folder / "model.safetensors"
        if (folder / "model.safetensors").is_file()
        else folder / "adapter_model.safetensors"
    )


def assert_same_run(got: Path, want: Path, steps: int = 3) -> None:
    a, b = steps_of(got), steps_of(want)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:  # the loss and the gradient to 1e-6; diagnostics such as ratio_max to 1e-5
            tolerance = 1e-6 if key in ("loss", "grad_norm") else 1e-5
            assert x[key] == pytest.approx(y[key], rel=tolerance, abs=tolerance), (x["step"], key)
    wa, wb = weights(got, steps), weights(want, steps)
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wb)
    print(f"{got.name} vs {want.name}: largest parameter difference {diff:.2e}")
    assert diff <= 1e-6


# sequence, token, constant aggregation (the default tier runs grpo over DDP; the others' exactness over ranks:
# test_distributed.py's threaded ranks; FSDP: the LoRA/DAPO run below)
@pytest.mark.parametrize(
    "algo, strategy",
    [
        ("grpo", "ddp"),
        *[
            pytest.param(algo, strategy, marks=pytest.mark.slow)
            for algo in ("grpo", "cispo", "dr_grpo")
            for strategy in ("ddp", "fsdp")
            if (algo, strategy) != ("grpo", "ddp")
        ],
    ],
)
def test_two_processes_compute_the_one_process_run(algo, strategy, warm_model_dir, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    # FSDP computes each row on its own (the shared-prompt forward takes a varying number of weight
    # gathers): so does the one-process run, for the same float32 sums
    same_forward = ["--optim.shared_prompts", "false"] if strategy == "fsdp" else []
    done = torchrun(run_args(warm_model_dir, two, algo) + ["--dist.strategy", strategy] + same_forward)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, algo) + same_forward) == 0
    records = [r for r in read_metrics(one / "metrics.jsonl") if "loss" in r]
    assert [r["actual_updates"] > 0 for r in records] == [True, False, True]  # step 2 has no signal
    assert_same_run(two, one)
    # rank 0 alone wrote and printed; the manifest says how the run was spread
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["ranks"] == {"world": 2, "strategy": strategy}
    assert done.stdout.count("checkpoint step 3") == 1
    assert len((two / "eval" / "step_000002.jsonl").read_text().splitlines()) == TASK["n_val"]


@pytest.mark.slow  # default tier: the KL penalty over FSDP in the LoRA/DAPO run below (its reference: the adapter off)
def test_a_kl_penalty_to_a_sharded_reference(warm_model_dir, tmp_path):
    """FSDP2 shards the frozen reference too; with beta > 0 every row is backpropagated (no pruning)."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = ["--reference", "frozen", "--algorithm.beta", "0.01", "--optim.shared_prompts", "false"]
    done = torchrun(run_args(warm_model_dir, two, "grpo") + args + ["--dist.strategy", "fsdp"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "grpo") + args) == 0
    assert max(r.get("kl_ref", 0) for r in read_metrics(one / "metrics.jsonl")) > 0
    assert_same_run(two, one)


@pytest.mark.slow  # default tier: test_lora_dynamic_sampling_and_a_kl_penalty_over_two_sharded_processes_...
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_adapters_over_two_processes_compute_the_one_process_run(strategy, warm_model_dir, tmp_path):
    """The adapter's gradients are summed like full weights (FSDP2 shards the adapter with its decoder layer,
    beside the frozen base); the reference is the adapter switched off."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = ["--model.lora.rank", "4", "--reference", "frozen", "--algorithm.beta", "0.01"]
    args += ["--optim.shared_prompts", "false"] if strategy == "fsdp" else []
    done = torchrun(run_args(warm_model_dir, two, "grpo") + args + ["--dist.strategy", strategy])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "grpo") + args) == 0
    assert max(r.get("kl_ref", 0) for r in read_metrics(one / "metrics.jsonl")) > 0
    assert_same_run(two, one)
    assert all("lora_" in k for k in weights(two, 3))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_moe_policy_over_two_processes_computes_the_one_process_run(strategy, warm_moe_dir, tmp_path):
    """A Qwen3-MoE (FSDP2 shards each decoder layer with its experts) with Rollout Routing Replay and the
    load-balancing loss: the same updates, router metrics (summed over the ranks) and routing mismatch. The loss is
    each forward's (as transformers computes it), so both runs split the rows into the same forwards: 8 rows."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = [
        "--algorithm.epochs",
        "2",
        "--algorithm.routing_replay",
        "true",
        "--model.router_aux_loss_coef",
        "0.01",
        "--optim.micro_batch_size",
        "8",
    ]
    args += ["--optim.shared_prompts", "false"] if strategy == "fsdp" else []
    done = torchrun(run_args(warm_moe_dir, two, "grpo") + args + ["--dist.strategy", strategy])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_moe_dir, one, "grpo") + args) == 0
    records = [r for r in read_metrics(one / "metrics.jsonl") if "loss" in r]
    assert all("router/mismatch" in r and "router/layer1/load" in r for r in records)
    assert_same_run(two, one)


def test_lora_dynamic_sampling_and_a_kl_penalty_over_two_sharded_processes_continue_the_one_process_run(
    warm_model_dir, tmp_path
):
    """The default tier's FSDP run, several claims at once: LoRA adapters sharded with their decoder layers and
    summed like full weights, the reference the adapter switched off (beta > 0), DAPO's resampling decided alike
    on every rank (step 2 has no signal), and the two-process checkpoint of step 2 continued by one process to
    where an uninterrupted one-process run ends."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = [
        "--model.lora.rank",
        "4",
        "--reference",
        "frozen",
        "--algorithm.beta",
        "0.01",
        "--optim.shared_prompts",
        "false",
    ]
    done = torchrun(run_args(warm_model_dir, two, "dapo", steps=2) + args + ["--dist.strategy", "fsdp"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(["train", "--resume", str(two), "--steps", "3"]) == 0
    assert main(run_args(warm_model_dir, one, "dapo") + args) == 0
    records = read_metrics(one / "metrics.jsonl")
    assert max(r.get("rollout_rounds", 1) for r in records) > 1 and max(r.get("kl_ref", 0) for r in records) > 0
    assert_same_run(two, one)
    assert all("lora_" in k for k in weights(two, 3))


@pytest.mark.slow  # default tier: DAPO over FSDP in test_lora_dynamic_sampling_and_a_kl_penalty_over_...
def test_dynamic_sampling_keeps_the_same_groups_on_every_rank(warm_model_dir, tmp_path):
    """DAPO drops step 2's groups (no signal) and resamples: every rank takes the same decisions."""
    two, one = tmp_path / "two", tmp_path / "one"
    done = torchrun(run_args(warm_model_dir, two, "dapo"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "dapo")) == 0
    assert max(r.get("rollout_rounds", 1) for r in read_metrics(one / "metrics.jsonl")) > 1
    assert_same_run(two, one)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_reward_model_over_two_processes_computes_the_one_process_run(
    strategy, warm_model_dir, reward_model_dir, tmp_path
):
    """Each rank scores its share of the completions with its own whole copy of the reward model (FSDP shards
    the policy only); the running normalizer sees the whole round on every rank, so the updates and the
    reward-model metrics are the one-process run's."""
    from test_dataset_run import write_problems

    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    rewards = [
        {"function": "numeric", "name": "correct", "weight": 0.0},
        {"function": f"model:{reward_model_dir}", "name": "rm", "options": {"normalize": "running", "batch_size": 8}},
    ]
    task = [
        "--task.name",
        "dataset",
        "--task.train",
        str(write_problems(tmp_path / "train.jsonl", pairs[:60])),
        "--task.validation",
        str(write_problems(tmp_path / "val.jsonl", pairs[60:76])),
        "--task.question_field",
        "problem",
        "--task.answer_field",
        "result",
        "--task.rewards",
        json.dumps(rewards),
    ]
    args = task + (["--optim.shared_prompts", "false"] if strategy == "fsdp" else [])
    two, one = tmp_path / "two", tmp_path / "one"
    done = torchrun(run_args(warm_model_dir, two, "grpo", task_args=args) + ["--dist.strategy", strategy])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "grpo", task_args=args)) == 0
    records = read_metrics(one / "metrics.jsonl")
    assert all("reward_model/rm/mean" in r for r in records if "loss" in r)
    assert_same_run(two, one)


@pytest.mark.slow  # default tier: an FSDP checkpoint continued by one process in test_lora_dynamic_sampling_...
@pytest.mark.parametrize("strategy, resumed_by", [("ddp", 1), ("fsdp", 1), ("fsdp", 2)])
def test_a_two_process_checkpoint_continues_exactly(strategy, resumed_by, warm_model_dir, tmp_path):
    """Whole Hugging Face weights, every rank's RNGs, and (FSDP) the optimizer state gathered by name:
    resumed in one process or under torchrun, the run ends where an uninterrupted one-process run does."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = ["--dist.strategy", strategy, "--optim.shared_prompts", "false"]
    done = torchrun(run_args(warm_model_dir, two, "cispo", steps=2) + args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = torch.load(two / "checkpoints" / "step_000002" / STATE_FILE, weights_only=False)
    assert len(state["rng_by_rank"]) == 2 and len(state["optimizer"]["state"]) == len(weights(two, 2))
    resume = ["train", "--resume", str(two), "--steps", "3"]
    if resumed_by == 1:
        assert main(resume) == 0
    else:
        done = torchrun(resume)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "cispo") + args) == 0
    assert_same_run(two, one)


@pytest.mark.parametrize("crash", ["raise", pytest.param("kill", marks=pytest.mark.slow)])
def test_a_rank_that_fails_mid_step_ends_every_rank(crash, warm_model_dir, tmp_path):
    out = tmp_path / "run"
    victim = PromptStream(__import__("custom_task").ArithmeticWithBlanks(**TASK).train_examples(), seed=0)
    victim.take(PROMPTS)
    crash_on = victim.take(PROMPTS)[-1].id  # a prompt of rank 1 in step 2
    started = time.monotonic()
    done = torchrun(run_args(warm_model_dir, out, "grpo", crash_on=crash_on, crash=crash, blank=[]), timeout=180)
    seconds = time.monotonic() - started
    assert done.returncode != 0 and seconds < 120
    output = done.stdout + done.stderr
    assert "rank 1" in output or "local_rank: 1" in output
    if crash == "raise":
        assert f"the grader crashed on {crash_on}" in output
    # the last good checkpoint is intact, nothing after it
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]
    assert (out / "checkpoints" / "step_000001" / STATE_FILE).is_file()
    assert main(["train", "--resume", str(out)]) == 0  # in one process: no crash


@pytest.mark.slow  # ~100 s a case (two vLLM engines); default tier: one process's sync check in test_trainer_vllm.py
@pytest.mark.parametrize(
    ("strategy", "lora_sync"), [("ddp", None), ("fsdp", None), ("fsdp", "adapter"), ("fsdp", "merged")]
)
def test_one_vllm_engine_per_rank_each_synced_and_checked(strategy, lora_sync, warm_model_dir, tmp_path):
    """Each rank starts its own vLLM engine and syncs it from its weights (under FSDP the whole weights,
    gathered; with LoRA the merged weights or the adapter, gathered) after every update; the sync check (on
    by default with vLLM) runs over the global batch, so a stale engine on either rank would stop the run.
    The samples are one process's (vLLM seeds each prompt by its global index)."""
    pytest.importorskip("vllm")
    two, one = tmp_path / "two", tmp_path / "one"
    args = ["--engine", "vllm"]
    if lora_sync:
        args += ["--model.lora.rank", "4", "--model.lora.alpha", "64", "--rollout.vllm.lora_sync", lora_sync]
    done = torchrun(run_args(warm_model_dir, two, "grpo") + args + ["--dist.strategy", strategy], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "grpo") + args) == 0
    got, want = [[r for r in read_metrics(d / "metrics.jsonl") if "loss" in r] for d in (two, one)]
    for x, y in zip(got, want, strict=True):
        for key in ("reward_mean", "accuracy", "completion_len_mean", "actual_updates"):
            assert x[key] == y[key], key
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6) and x["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert ("grad_norm" in x) == ("grad_norm" in y) and x.get("grad_norm", 0) == pytest.approx(
            y.get("grad_norm", 0), rel=1e-5
        )
        assert x["sync/logprob_diff_max"] < 1e-4  # engines and trainers agree after every sync


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step_with_a_checkpoint_that_continues_exactly(
    warm_model_dir, tmp_path
):
    """As a suite stops a torchrun run: SIGTERM to the agent, which passes it on to the ranks; they agree
    at a step's end to stop, rank 0 writes that step's checkpoint, and a resume ends where an
    uninterrupted one-process run does."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = run_args(warm_model_dir, two, "grpo", steps=4) + ["--checkpoint.every", "10"]
    command, env = torchrun_command(args)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if (two / "metrics.jsonl").exists() and '"reward_mean"' in (two / "metrics.jsonl").read_text():
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=180)[0]
    (checkpoint,) = [p.name for p in (two / "checkpoints").iterdir()]
    stopped = int(checkpoint.removeprefix("step_"))
    assert 1 <= stopped < 4 and f"stopped after step {stopped} with a checkpoint" in out, out[-3000:]
    assert max(r["step"] for r in read_metrics(two / "metrics.jsonl")) == stopped
    done = torchrun(["train", "--resume", str(two)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(run_args(warm_model_dir, one, "grpo", steps=4) + ["--checkpoint.every", "10"]) == 0
    assert_same_run(two, one, steps=4)
