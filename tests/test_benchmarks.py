"""The speed benchmarks run, and what they compare agrees (their figures are printed, never asserted)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import TASK, TASK_SETTINGS, cli_pairs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest_plugins = ["suite_fixtures"]  # the fake trainer


def _settings(model_dir) -> dict:
    """The test model and task, 2 prompts x 8, micro-batches of 4."""
    rollout = {"rollout.prompts_per_step": 2, "rollout.group_size": 8, "rollout.max_new_tokens": 24}
    return {"model.path": model_dir, **TASK_SETTINGS, **rollout, "optim.micro_batch_size": 4}


def _small(model_dir) -> list[str]:
    """Dotted overrides (``--key value``): ``_settings``."""
    return cli_pairs(_settings(model_dir))


def _dotted(model_dir) -> list[str]:
    """``_settings`` as ``key=value`` arguments."""
    return [f"{key}={value}" for key, value in _settings(model_dir).items()]


def _roofline(tmp_path: Path, model_dir, *options: str, more: tuple[str, ...] = ()) -> dict:
    """generation_roofline's results, timed once, for ``options`` with an empty config file and ``_settings``
    (``more`` dotted settings after them)."""
    import generation_roofline

    config = tmp_path / "empty.toml"
    config.write_text("")
    return generation_roofline.main(["--config", str(config), "--repeats", "1", *options, *_dotted(model_dir), *more])


def test_training_phase_ways_agree_with_the_previous_path(warm_model_dir, capsys):
    import training_phase

    assert training_phase.main(["--repeats", "1", "--micro-batch-tokens", "100", *_small(warm_model_dir)]) == 0
    rows = {
        m[0]: m
        for m in re.findall(
            r"^(previous|rows|shared\+tokens|shared)\s+(\S+)\s+(\S+)x\s+(\S+)\s+(\S+)$", capsys.readouterr().out, re.M
        )
    }
    assert set(rows) == {"previous", "rows", "shared", "shared+tokens"}
    for name, _, _, logprob_diff, grad_diff in rows.values():
        assert float(logprob_diff) <= 1e-5 and float(grad_diff) <= 1e-5, name


def test_shared_prefill_benchmark_generates_the_same_completions(warm_model_dir, capsys):
    import shared_prefill

    assert shared_prefill.main(["--repeats", "1", *_small(warm_model_dir)]) == 0
    assert "same completions: True" in capsys.readouterr().out


@pytest.mark.slow  # TRL's GRPOTrainer imports in ~13 s; its loss pieces run in the default tier (test_rollout_correction_trl.py)
def test_vs_trl_runs_both_at_the_same_settings(warm_model_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl")
    import vs_trl

    overrides = _dotted(warm_model_dir)
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--steps", "1", "--json", str(tmp_path / "f.json"), *overrides])
    assert vs_trl.main() == 0
    out = capsys.readouterr().out
    assert "TRL s / grpolab s per step" in out and "2 prompts x 8, <= 24 new tokens" in out
    assert (tmp_path / "f.json").is_file()


@pytest.mark.slow  # ~6 s, a benchmark's own run; default tier: what it times, each engine's generation (test_rollout_*)
def test_generation_roofline_reports_every_engine_against_both_rooflines(warm_model_dir, tmp_path, capsys):
    engines = "generate,hf,hf-unpacked,hf-sdpa"
    results = _roofline(tmp_path, warm_model_dir, "--engines", engines, "--json", str(tmp_path / "g.json"))
    roofline = results["roofline"]
    assert roofline["rows"] == 16 and roofline["best"]["tokens_per_s"] >= roofline["linear"]["tokens_per_s"]
    assert set(results["engines"]) == {"generate", "hf", "hf-unpacked", "hf-sdpa"}
    for name, engine in results["engines"].items():
        assert engine["tokens"][0] > 0
        assert engine["share_of_roofline"]["best"] <= engine["share_of_roofline"]["linear"]
        # the floor: the matmuls of the forwards the engine ran (the prefill and one per decoding step)
        assert ("floor" in engine) == name.startswith("hf")
        if name.startswith("hf"):
            assert 2 <= engine["floor"]["forwards"][0] <= 2 + 24  # two prefills (prefix, prompts), <= 24 tokens
            assert 0 < engine["floor"]["seconds"] and engine["share_of_floor"] > 0
    assert "roofline (best): " in capsys.readouterr().out and (tmp_path / "g.json").is_file()


@pytest.mark.slow  # a benchmark's own run; default tier: test_refill.py's batch kept full while rows wait
def test_generation_roofline_shows_the_live_rows_of_a_refilled_batch(warm_model_dir, tmp_path, capsys):
    """--rounds 2: one call of 2 steps' prompts (32 rows) through a batch of 8: rows join as others end."""
    more = ("rollout.max_batch_size=8",)
    results = _roofline(tmp_path, warm_model_dir, "--engines", "hf", "--rounds", "2", more=more)
    live = results["engines"]["hf"]["live_rows"]
    assert results["roofline"]["rows"] == 8 and live[0] == 8 and max(live) == 8
    assert sum(live) == results["engines"]["hf"]["tokens"][0]  # every row a step computes is live
    assert "live rows per decoding step (last call)" in capsys.readouterr().out


def test_lora_vs_full_reports_both_ways_and_the_adapters_share(warm_model_dir, capsys):
    import lora_vs_full

    assert lora_vs_full.main(["--repeats", "1", "--rank", "2", *_small(warm_model_dir)]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(full|lora)\s+(\d.*)$", out, re.M))
    assert set(rows) == {"full", "lora"}
    full_reference_mb, lora_reference_mb = float(rows["full"].split()[-1]), float(rows["lora"].split()[-1])
    assert full_reference_mb > 0 and lora_reference_mb == 0, "LoRA's reference is the adapter switched off"
    share = float(re.search(r"trained parameters (\S+)x", out).group(1))
    assert 0 < share < 0.2


@pytest.mark.slow  # ~55 s (two vLLM engines); default tier: test_rollout_vllm.py's adapter sync, served exactly
def test_lora_vllm_sync_reports_both_modes_passing_the_sync_check(warm_model_dir, capsys):
    pytest.importorskip("vllm")
    import lora_vllm_sync

    assert lora_vllm_sync.main(["--repeats", "1", "--rank", "2", *_small(warm_model_dir)]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(merged|adapter)\s+(\d.*)$", out, re.M))
    assert set(rows) == {"merged", "adapter"}
    assert all(float(row.split()[-1]) < 1e-3 for row in rows.values()), "both modes sample the trainer's policy"
    assert re.search(r"adapter / merged: weight sync \S+x, generation tokens/s \S+x", out)


def assert_placement_of_the_tiny_suite(tmp_path: Path, model_dir, capsys) -> None:
    """suite_placement on the tiny suite (b not started from a, no threads setting) on devices 0 and 1: both
    placements timed, a on device 0 and b on 1 with the numbers of one at a time, threads = 1 written back."""
    import suite_placement
    from suite_runs import suite_file

    spec = suite_file(tmp_path, model_dir)
    spec.write_text(spec.read_text().replace("threads = 1\n", "").replace('init_from = "a"\n', ""))
    assert suite_placement.main([str(spec), "--out", str(tmp_path / "bench"), "--devices", "0,1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"one at a time \d+ s, on devices 0,1 \d+ s: [\d.]+x faster \(1 thread\(s\) per run\)", out)
    assert re.search(r"^a .* 0\s+True\s+True$", out, re.M) and re.search(r"^b .* 1\s+True\s+True$", out, re.M)
    assert "threads = 1" in (tmp_path / "bench" / spec.name).read_text()


@pytest.mark.slow  # default tier: the same with fake runs below (the scheduler's placements: test_suite_devices.py)
def test_suite_placement_times_both_placements_and_finds_the_same_numbers(warm_model_dir, tmp_path, capsys):
    assert_placement_of_the_tiny_suite(tmp_path, warm_model_dir, capsys)


def test_suite_placement_times_both_placements_and_finds_the_same_numbers_with_fake_runs(
    warm_model_dir, fake_hook, tmp_path, monkeypatch, capsys
):
    """The benchmark's own logic, its suites' runs fake (tests/fake_trainer.py); each `grpolab suite run` it
    starts is a forked copy of this process running the same command (started without importing anew)."""
    import suite_placement
    from suite_runs import forked_runner

    def forked_call(command, stdout, stderr):
        assert command[:4] == [sys.executable, "-m", "grpolab.commands.cli", "suite"], command
        runner = forked_runner(*command[4:], log=Path(stdout.name))
        runner.join()
        return runner.exitcode

    monkeypatch.setattr(suite_placement.subprocess, "call", forked_call)
    monkeypatch.setenv("PYTHONPATH", str(fake_hook))
    assert_placement_of_the_tiny_suite(tmp_path, warm_model_dir, capsys)


@pytest.mark.slow  # ~6 s, a benchmark's own run; default tier: reward-model training and RL on its scores
# (test_reward_model.py, test_reward_model_run.py)
def test_reward_model_learning_trains_a_reward_model_then_rl_on_its_scores(tmp_path, capsys):
    import json

    import reward_model_learning
    from conftest import QUICK_WARM_START

    assert (
        reward_model_learning.main(
            [
                "--out",
                str(tmp_path / "bench"),
                "--task",
                json.dumps(TASK),
                "--warm-start",
                QUICK_WARM_START.model_dump_json(),
                "--rm-prompts",
                "16",
                "--samples",
                "2",
                "--rm-steps",
                "2",
                "--steps",
                "1",
                "--prompts",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(
        r"reward model: \d+ pairs; held out: \d+% of the samples correct, within-question AUC \d\.\d{3}", out
    )
    for name in ("rm + KL", "rm"):
        assert re.search(
            rf"^{re.escape(name)}\s+\d\.\d{{3}}\s+\d\.\d{{3}}\s+[+-]\d\.\d{{3}} "
            r"\[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]\s+\S+\s+\d+$",
            out,
            re.M,
        ), out
    metrics = (tmp_path / "bench" / "run_rm_KL" / "metrics.jsonl").read_text()
    assert '"reward_model/rm/mean"' in metrics and '"kl_ref"' in metrics


def test_sync_margins_benchmark_runs_in_sync_and_stale(warm_model_dir, capsys):
    import sync_margins

    assert (
        sync_margins.main(
            [
                "--steps",
                "3",
                "--windows",
                "1",
                "--stale-from",
                "2",
                "--model.path",
                str(warm_model_dir),
                "--rollout.prompts_per_step",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "window 1        in sync" in out and "window 1   stale from 2" in out


def test_precision_step_benchmark_times_float32_and_bf16_side_by_side(warm_model_dir, capsys, tmp_path):
    import precision_step

    out_json = tmp_path / "precision.json"
    argv = ["--config", "demo", "--steps", "1", "--model.path", str(warm_model_dir), "--json", str(out_json)]
    argv += ["--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--rollout.max_new_tokens", "6"]
    assert precision_step.main(argv + ["--variants", "float32", "bf16 all"]) == 0  # "bf16 all": a swapped copy
    out = capsys.readouterr().out
    assert "RL step, float32 vs bf16: 2 prompts x 2, <= 6 new tokens, temperature 1" in out
    results = json.loads(out_json.read_text())["results"]
    assert list(results) == ["float32", "bf16 all"]
    assert all(results[v][phase] > 0 for v in results for phase in precision_step.PHASES)
    with pytest.raises(SystemExit):  # an existing report is never overwritten
        precision_step.main(argv)


@pytest.mark.slow  # two short runs; async against sync in the default tier: test_async_rollouts.py
def test_async_step_benchmark_runs_sync_and_async_side_by_side(warm_model_dir, tmp_path, capsys):
    import async_step

    args = ["--model", "tiny", "--steps", "2", "--json", str(tmp_path / "f.json"), *_small(warm_model_dir)]
    assert async_step.main(args) == 0
    assert "async / sync samples per second" in capsys.readouterr().out
    assert [r["mode"] for r in json.loads((tmp_path / "f.json").read_text())["results"]] == ["sync", "async"]


def test_demo_outcome_tables_each_gain_with_its_paired_ci_and_lists_refusals(warm_model_dir, tmp_path, capsys):
    import demo_outcome

    out = tmp_path / "runs"
    extra = f"--model {warm_model_dir} --steps 2 --eval.every 2 --threads 1 --rollout.prompts_per_step 2"
    extra += " --reward.truncation_penalty 0.5"  # refused by maxrl (its advantage needs rewards >= 0)
    assert demo_outcome.main(["--algos", "grpo", "maxrl", "--extra", extra, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    grpo = next(line for line in lines if line.startswith("grpo "))
    start, final, gain, low, high = (float(x.strip("[],")) for x in grpo.split()[4:9])
    assert low <= gain <= high and abs(final - start - gain) < 1.5e-3
    assert any(line.startswith("maxrl ") and line.endswith("refused") for line in lines)
    assert any(line.startswith("refused: maxrl (hf):") and "truncation_penalty" in line for line in lines)
    assert sorted(p.name for p in out.iterdir()) == ["grpo-hf-w0-s0"]  # a refused demo leaves nothing
    with pytest.raises(SystemExit):  # an existing folder is never written into
        demo_outcome.main(["--algos", "grpo", "--out", str(out)])


def test_cli_startup_times_every_command_beside_the_interpreter(capsys):
    import cli_startup

    assert cli_startup.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for label in ("python -c pass", "grpolab --help", "grpolab train --help", "grpolab config --config configs/"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "--optim.lrr 1 (refused)" in out and "grpolab algorithms" in out and "target: each grpolab command" in out


def test_training_roofline_counts_the_phase_and_puts_it_against_each_dtypes_roofline(warm_model_dir, capsys):
    import training_roofline

    argv = ["--config", "demo", "--threads", "1", "--repeats", "1", "--model.path", str(warm_model_dir)]
    argv += ["--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--rollout.max_new_tokens", "6"]
    results = training_roofline.main(argv)
    assert [r["dtype"] for r in results] == ["float32", "bfloat16"]
    assert all(r["flops"] > 0 and r["seconds"] > 0 and r["roofline"] > 0 for r in results)
    assert "Training phase against its dtype's matmul roofline" in capsys.readouterr().out
