"""A real ``grpolab train`` run on reasoning-gym's generators (the tiny warm-started model): its terms in the metrics
and evaluation records, its fingerprint in the manifest, a resume with a changed setting refused, bad settings
refused before anything is written."""

from __future__ import annotations

import json

from test_resume_safety import error_lines, tree

from grpolab.commands.cli import main

CONFIG = """
steps = 2
seed = 0
output_dir = "{out}"

[model]
path = "{model}"

[task]
name = "reasoning_gym"
n_train = 32
n_val = 8
prompt = "r1_zero"
score_weight = 0.5

[[task.generators]]
name = "chain_sum"
weight = 2.0
settings = {{min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1}}

[[task.generators]]
name = "basic_arithmetic"
settings = {{min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, operators = ["+"], allow_negation = false}}

[rollout]
prompts_per_step = 4
group_size = 4
max_new_tokens = 24

[optim]
micro_batch_size = 16
lr = 1e-3

[eval]
every = 2

[checkpoint]
every = 1
"""


def test_a_run_records_the_generators_and_a_resume_with_another_setting_is_refused(tmp_path, warm_model_dir, capsys):
    out, config = tmp_path / "run", tmp_path / "run.toml"
    config.write_text(CONFIG.format(out=out, model=warm_model_dir))
    assert main(["train", "--config", str(config), "--steps", "1"]) == 0

    manifest = json.loads((out / "manifest.json").read_text())
    data = manifest["data"]
    assert data["task"] == "reasoning_gym" and data["reasoning_gym_version"] == "0.1.25"
    assert [g["name"] for g in data["generators"]] == ["chain_sum", "basic_arithmetic"]
    assert data["generators"][0]["settings"]["max_digits"] == 1 and data["generators"][0]["weight"] == 2.0
    assert (data["train_rows"], data["validation_rows"], data["seed"], data["val_seed"]) == (32, 8, 0, 1_000_000)
    assert all(len(data[k]) == 64 for k in ("settings_sha256", "train_sha256", "validation_sha256"))
    step = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line)
    assert step["accuracy"] == step["reward/correct"] and 0 <= step["reward/score"] <= 1
    assert abs(step["reward_mean"] - (step["reward/correct"] + 0.5 * step["reward/score"])) < 1e-6
    items = [json.loads(line) for line in (out / "eval" / "step_000000.jsonl").read_text().splitlines()]
    assert len(items) == 8 and set(items[0]["rewards"]) == {"correct", "score"}

    saved = json.loads((out / "config.json").read_text())
    saved["task"]["generators"][0]["settings"]["max_digits"] = 2
    (out / "config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    before = tree(out)
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 2
    (line,) = error_lines(capsys)
    assert "differs from the config the run started with" in line and "task.generators" in line
    assert tree(out) == before


def test_an_unknown_generator_is_one_line_and_nothing_is_written(tmp_path, warm_model_dir, capsys):
    out, config = tmp_path / "run", tmp_path / "run.toml"
    config.write_text(CONFIG.format(out=out, model=warm_model_dir).replace('"chain_sum"', '"chain_sums"'))
    assert main(["train", "--config", str(config)]) == 2
    (line,) = error_lines(capsys)
    assert "task.generators[0] (chain_sums): unknown reasoning-gym generator; reasoning-gym has ab, acre" in line
    assert "chain_sum, " in line and not out.exists()
