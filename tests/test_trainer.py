"""End to end on the tiny model: every preset runs real RL steps through the whole loop."""

from __future__ import annotations

import json
import math

import pytest
from conftest import params_of, quick_config, same
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.objectives.presets import PRESETS
from grpolab.rollout.evaluation import pass_at_k
from grpolab.run.rundir import RunDirError, read_metrics
from grpolab.run.trainer import Trainer, train


def preset_settings(name: str) -> dict:
    """What a preset needs beyond the quick run's settings: GDPO a second reward term to decouple (a truncation
    penalty), 2-GRPO its own group size (the quick run's explicit other one is refused)."""
    spec = PRESETS[name]
    extra = {"reward.truncation_penalty": 0.5} if spec.multi_objective_aggregation == "normalize_then_sum" else {}
    return {**extra, "rollout.group_size": spec.group_size} if spec.group_size is not None else extra


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_runs_real_rl_steps(name, warm_model_dir, tmp_path, request):
    # on-policy distillation learns from a teacher with the policy's tokenizer
    teacher = {"teacher.path": str(request.getfixturevalue("warm_teacher_dir"))} if PRESETS[name].needs_teacher else {}
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", algo=name, **preset_settings(name), **teacher))
    actual = 0
    for step in (1, 2):
        before = params_of(trainer.parts.model)
        record = trainer.train_step(step)
        after = params_of(trainer.parts.model)
        numbers = [v for v in record.values() if isinstance(v, float)]
        assert all(math.isfinite(v) for v in numbers), record
        if record["actual_updates"]:
            assert not same(before, after), "an actual update must change the parameters"
            if PRESETS[name].is_single_update:
                assert record["first_update/ratio_mean"] == 1.0 and record["first_update/clip_frac"] == 0.0
        else:
            assert same(before, after), "a skipped update must leave the parameters alone"
        actual += record["actual_updates"]
        assert record["attempted_updates"] == PRESETS[name].epochs * PRESETS[name].steps_per_epoch
    trainer.close()
    assert actual > 0, "the warm-started model should give some groups with mixed rewards"


def test_all_zero_rewards_skip_the_update(warm_model_dir, tmp_path):
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", **{"rollout.max_new_tokens": 2}))
    before = params_of(trainer.parts.model)
    record = trainer.train_step(1)  # two tokens cannot hold an answer: every reward is 0
    assert record["reward_mean"] == 0.0 and record["actual_updates"] == 0 and record["attempted_updates"] == 1
    assert same(before, params_of(trainer.parts.model))


def test_dynamic_sampling_keeps_the_batch_size(warm_model_dir, tmp_path):
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", algo="dapo"))
    batch = trainer.parts.collector.collect(1)
    assert len(batch.examples) == 4 and all(len(g) == 8 for g in batch.completions)
    rewards = batch.rewards()
    informative = (rewards != rewards[:, :1]).any(1)
    # informative groups come first; uninformative ones only top up after the resample rounds ran out
    assert informative.tolist() == sorted(informative.tolist(), reverse=True)
    assert batch.rounds == 1 or batch.rounds <= PRESETS["dapo"].max_resample_rounds + 1


def test_full_run_writes_metrics_checkpoints_summary_and_is_deterministic(warm_model_dir, tmp_path):
    summaries = [train(quick_config(warm_model_dir, tmp_path / f"run{i}", reference="frozen")) for i in range(2)]
    run = tmp_path / "run0"
    metrics = read_metrics(run / "metrics.jsonl")
    steps = [m for m in metrics if "reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for key in (
        "reward_mean",
        "accuracy",
        "format_rate",
        "advantage_std",
        "kl_ref",
        "completion_len_mean",
        "truncation_rate",
        "time/generate",
        "time/reward",
        "time/train",
        "time/sync",
        "time/step",
        "tokens_per_s",
        "total_attempted_updates",
        "total_actual_updates",
    ):
        assert key in steps[-1] or key in ("kl_ref", "grad_norm"), key
    assert [m["step"] for m in metrics if "val/accuracy" in m] == [0, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["val_accuracy"]) == {"start", "final"} and summary["steps"] == 2
    model = AutoModelForCausalLM.from_pretrained(summary["final_checkpoint"])
    assert model.num_parameters() > 0
    assert not list((run / "checkpoints").glob(".*")), "no temp dirs left behind"
    other = read_metrics(tmp_path / "run1" / "metrics.jsonl")

    def untimed(ms):
        return [{k: v for k, v in m.items() if not k.startswith("time/") and k != "tokens_per_s"} for m in ms]

    assert untimed(metrics) == untimed(other)
    assert summaries[0]["val_accuracy"] == summaries[1]["val_accuracy"]


def test_existing_run_dir_is_refused_and_left_alone(warm_model_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(RunDirError):
        Trainer(quick_config(warm_model_dir, out))
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    assert main(["train", "--model.path", str(warm_model_dir), "--output-dir", str(out)]) == 2


def test_cli_rejects_bad_input_with_one_line_each(tmp_path, capsys):
    assert main(["train", "--algo", "ppo"]) == 2
    assert "unknown algorithm 'ppo'" in capsys.readouterr().out
    assert main(["train", "--model.path", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "model directory not found" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()
    assert main(["train", "--optim.lr", "-1", "--algorithm.eps_low", "2"]) == 2
    out = capsys.readouterr().out
    assert "optim.lr" in out and "algorithm.eps_low" in out
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "config file not found" in capsys.readouterr().out


def test_toml_config_with_command_line_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\n[algorithm]\nname = "dapo"\neps_high = 0.3\n[optim]\nlr = 2e-4\n')
    cfg = load_config(path, {"optim.lr": 5e-4, "rollout.group_size": 4})
    assert (cfg.steps, cfg.algorithm.name, cfg.algorithm.eps_high, cfg.optim.lr, cfg.rollout.group_size) == (
        7,
        "dapo",
        0.3,
        5e-4,
        4,
    )
    assert cfg.algorithm.aggregation == "token"  # the rest of the preset is kept


def test_command_line_values_are_toml_literals_or_json_lists_and_objects():
    from grpolab.config import parse_value

    rewards = [{"function": "numeric", "weight": 0.0}, {"function": "model:rm", "options": {"clip": 3.0}}]
    assert (
        parse_value('[{function = "numeric", weight = 0.0}, {function = "model:rm", options = {clip = 3.0}}]')
        == rewards
    )
    assert parse_value(json.dumps(rewards)) == rewards  # JSON objects are not TOML inline tables
    assert (parse_value("3e-4"), parse_value("true"), parse_value("[1, 2]"), parse_value("grpo")) == (
        3e-4,
        True,
        [1, 2],
        "grpo",
    )
    assert parse_value("[not json") == "[not json" and parse_value("") == ""


def test_pass_at_k_matches_brute_force():
    from itertools import combinations

    for n, c, k in [(8, 0, 1), (8, 3, 1), (8, 3, 4), (5, 5, 2), (6, 2, 6)]:
        samples = [1] * c + [0] * (n - c)
        subsets = list(combinations(range(n), k))
        brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
