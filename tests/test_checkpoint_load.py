"""One verified load for every grpolab checkpoint wherever it is read (``--resume``, ``model.path``, a suite's
``init_from``, ``grpolab export``):

- every file its ``checkpoint.json`` lists must check out first: a bit flip or a truncation is refused in one
  line (never a raw SafetensorError), before a run directory exists;
- a ``checkpoint.json`` that parses but holds a bad entry is a damaged checkpoint: a resume falls back to the
  next older verified one, export refuses in one line, with no 'done' line and before loading anything;
- a LoRA checkpoint loads only with its own adapter settings (rank, alpha, rsLoRA, DoRA, targets, saved
  modules) and onto the base its adapter was trained on (its SHA-256, recorded beside the adapter).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TASK, quick_config
from safetensors.torch import load_file, save_file

from grpolab.commands.cli import main
from grpolab.config import LoraSettings
from grpolab.models.loading import load_policy
from grpolab.models.lora import BASE_RECORD, add_adapter, settings_mismatch
from grpolab.run.checkpoints import newest_verified, problem, save_checkpoint
from grpolab.run.state import STATE_FILE
from grpolab.run.trainer import train

START = {
    "steps": 1,
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 8,
    "rollout.max_new_tokens": 40,
    **{f"task.{k}": v for k, v in TASK.items()},
}


def _train_args(model_path, out, **extra) -> list[str]:
    return [
        "train",
        f"--model.path={model_path}",
        *[f"--{k}={v}" for k, v in {**START, **extra}.items()],
        "--output-dir",
        str(out),
    ]


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture
def full_checkpoint(warm_model_dir, tmp_path):
    """A full-weight grpolab checkpoint of the warm-started model, written by the checkpoint writer itself."""
    model, tokenizer = load_policy(warm_model_dir)
    (tmp_path / "source").mkdir()
    return save_checkpoint(model, tokenizer, tmp_path / "source", 1)


@pytest.mark.parametrize("damage", ["bit flip", "truncation"])
def test_a_damaged_checkpoint_as_model_path_is_refused_in_one_line_before_the_run_directory(
    full_checkpoint, tmp_path, capsys, damage
):
    weights = full_checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "bit flip":
        data[-7] ^= 0x10  # one bit of the last tensor's data: the file still parses
    else:
        data = data[: len(data) // 2]
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(_train_args(full_checkpoint, tmp_path / "run")) == 2
    out = capsys.readouterr().out
    why = "model.safetensors does not match its SHA-256" if damage == "bit flip" else "model.safetensors has"
    assert len(_error_lines(out)) == 1 and why in out and "not loaded" in out, out
    assert "SafetensorError" not in out and "Traceback" not in out
    assert not (tmp_path / "run").exists(), "refused before the run directory exists"


@pytest.mark.parametrize("entry", [3, None, {}, {"bytes": "12", "sha256": "00"}, {"sha256": "00"}])
def test_a_checkpoint_json_with_a_bad_entry_is_a_damaged_checkpoint(warm_model_dir, tmp_path, capsys, entry):
    model, tokenizer = load_policy(warm_model_dir)
    run = tmp_path / "run"
    run.mkdir()
    state = lambda folder: torch.save({"step": 0}, folder / STATE_FILE)  # noqa: E731
    older, newer = (save_checkpoint(model, tokenizer, run, step, state) for step in (1, 2))
    listing = json.loads((newer / "checkpoint.json").read_text())
    listing["files"]["model.safetensors"] = entry
    (newer / "checkpoint.json").write_text(json.dumps(listing))

    assert "its entry for 'model.safetensors' is not a size and a SHA-256" in problem(newer)
    found = newest_verified(run, (STATE_FILE,))  # what a resume continues from
    assert found.checkpoint == older and [p for p, _ in found.damaged] == [newer]
    capsys.readouterr()
    assert main(["export", str(newer), str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert len(_error_lines(out)) == 1 and "not a size and a SHA-256); not loaded" in out, out
    assert "done in" not in out and "Traceback" not in out and not (tmp_path / "out").exists()


def test_a_suite_run_starts_only_from_the_checkpoint_recorded_when_its_source_completed(full_checkpoint, tmp_path):
    from grpolab.run.checkpoints import weights_sha256
    from grpolab.studies.manifest import RunRecord, SuiteManifest
    from grpolab.studies.suite.verify import start_checkpoint_problem

    def record(name, **fields):
        return RunRecord(name=name, run_dir=str(tmp_path / name), config_file="c.json", config_sha256="0", **fields)

    source = record(
        "grpo",
        state="completed",
        final_checkpoint=str(full_checkpoint),
        final_checkpoint_sha256=weights_sha256(full_checkpoint),
    )
    follower = record("next", init_from="grpo")
    manifest = SuiteManifest(suite="s", source_file="s.toml", runs=[source, follower])
    assert start_checkpoint_problem(follower, manifest) is None
    assert start_checkpoint_problem(source, manifest) is None
    source.final_checkpoint_sha256 = "0" * 64  # another checkpoint now stands where the recorded one was
    assert start_checkpoint_problem(follower, manifest) == (
        f"init_from grpo: its final checkpoint {full_checkpoint} is not the one recorded when it completed "
        "(its weights' SHA-256 differs); not run"
    )
    (full_checkpoint / "checkpoint.json").unlink()
    assert "(no checkpoint.json); not run" in start_checkpoint_problem(follower, manifest)


# ---- LoRA: the checkpoint's own settings, on its own base ----


@pytest.fixture(scope="module")
def lora_start(warm_model_dir, tmp_path_factory):
    """A LoRA run (rank 4, alpha 32, q_proj and v_proj) on a private copy of the base, one step, checkpointed."""
    root = tmp_path_factory.mktemp("lora_start")
    base = root / "base"
    shutil.copytree(warm_model_dir, base)
    run = root / "run"
    train(
        quick_config(
            base,
            run,
            **{
                **START,
                "model.lora.rank": 4,
                "model.lora.alpha": 32,
                "model.lora.target_modules": ["q_proj", "v_proj"],
                "checkpoint.every": 1,
                "eval.every": 1,
                "optim.lr": 0.05,
            },
        )
    )
    return base, run, run / "checkpoints" / "step_000001"


OWN = {"rank": 4, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"alpha": None}, "lora_alpha 4"),
        ({"rank": 8}, "r 8"),
        ({"target_modules": ["q_proj"]}, "target_modules ['q_proj']"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
    ],
)
def test_a_lora_checkpoint_loads_only_with_its_own_settings(lora_start, change, field):
    base, _, checkpoint = lora_start
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    own = add_adapter(load_policy(base)[0], LoraSettings(**OWN), seed=0, base_dir=base)
    own.load(checkpoint)
    other = add_adapter(load_policy(base)[0], LoraSettings(**{**OWN, **change}), seed=0, base_dir=base)
    with pytest.raises(
        ValueError,
        match=r"loads only with its own settings, and \[model.lora\] gives "
        + field.replace("[", r"\[").replace("]", r"\]"),
    ):
        other.load(checkpoint)
    if change == {"alpha": None}:  # what loading it anyway would serve: another policy
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(other.peft_model, load_file(checkpoint / "adapter_model.safetensors"))
        gap = (_logprobs(own.model, ids) - _logprobs(other.model, ids)).abs().max().item()
        assert gap > 0.05, f"alpha 32 read as 4 moves the log-probs by {gap:.3f} nats"


def test_rslora_and_dora_are_settings_of_the_checkpoint_too(lora_start):
    _, _, checkpoint = lora_start
    saved = json.loads((checkpoint / "adapter_config.json").read_text())
    assert settings_mismatch(saved, checkpoint) is None
    assert settings_mismatch({**saved, "use_rslora": True}, checkpoint) == "use_rslora True (the checkpoint's: None)"
    assert settings_mismatch({**saved, "use_dora": True}, checkpoint) == "use_dora True (the checkpoint's: None)"


def test_a_run_starting_from_a_lora_checkpoint_with_other_settings_is_refused(lora_start, tmp_path, capsys):
    _, _, checkpoint = lora_start
    capsys.readouterr()
    other = {"model.lora.rank": 4, "model.lora.target_modules": '["q_proj","v_proj"]'}
    assert main(_train_args(checkpoint, tmp_path / "next", **other)) == 2
    out = capsys.readouterr().out
    assert len(_error_lines(out)) == 1 and "gives lora_alpha 4 (the checkpoint's: 32)" in out, out
    assert not (tmp_path / "next").exists()


def test_a_changed_base_is_refused_by_resume_model_path_and_export(lora_start, tmp_path, capsys):
    base, run, checkpoint = lora_start
    assert json.loads((checkpoint / BASE_RECORD).read_text())["path"] == str(base)
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(weights), metadata={"format": "pt"})
    try:
        capsys.readouterr()
        assert main(["train", "--resume", str(run), "--steps", "2"]) == 2
        out = capsys.readouterr().out
        assert len(_error_lines(out)) == 1 and f"its base model {base} changed since the adapter was trained" in out
        assert not (run / "checkpoints" / "step_000002").exists()
        own = {f"model.lora.{k}": json.dumps(v) if isinstance(v, list) else v for k, v in OWN.items()}
        assert main(_train_args(checkpoint, tmp_path / "next", **own)) == 2
        assert "changed since the adapter was trained" in capsys.readouterr().out
        assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 2
        out = capsys.readouterr().out
        assert len(_error_lines(out)) == 1 and "changed since the adapter was trained" in out, out
        assert "done in" not in out and not (tmp_path / "merged").exists()
    finally:
        weights.write_bytes(original)
    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0, "the same base again: exported"
