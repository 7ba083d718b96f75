"""On-policy distillation runs: a tiny student learns from a tiny teacher with its tokenizer, the teacher is
recorded and kept on resume, and a teacher with another tokenizer is refused before anything is written."""

from __future__ import annotations

import json
import shutil

import torch
from conftest import TASK, params_of, quick_config, same

from grpolab.commands.cli import main
from grpolab.config import load_run_config
from grpolab.learning.batching import collate
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer, train

QUIET = {"eval.every": 100, "checkpoint.every": 100}  # no evaluation nor checkpoint in the steps of a test


def exact_reverse_kl(student, teacher, batch) -> float:
    """KL(pi_student || pi_teacher) summed over the whole vocabulary at every response position of ``batch``
    (fixed contexts), averaged over those positions: an exact measure, not the sampled estimator the loss uses."""
    with torch.no_grad():
        ids, attention = batch.input_ids, batch.attention_mask
        p = student(input_ids=ids, attention_mask=attention).logits[:, :-1].float().log_softmax(-1)
        q = teacher(input_ids=ids, attention_mask=attention).logits[:, :-1].float().log_softmax(-1)
        per_position = (p.exp() * (p - q)).sum(-1)  # the logits at t - 1 predict token t
        mask = batch.response_mask[:, 1:]
        return float((per_position * mask).sum() / mask.sum())


def test_the_students_reverse_kl_to_the_teacher_falls(warm_model_dir, warm_teacher_dir, tmp_path):
    """Eight steps of opd (task reward unused, reward_coef 0) bring the student's exact reverse KL to the teacher
    down on fixed contexts; each update is on-policy (ratio exactly 1). The per-token signal is one sample per
    position, so the steps are larger batches at a small learning rate (at 1e-3 the noise wins on this model)."""
    overrides = {"teacher.path": str(warm_teacher_dir), "optim.lr": 3e-4, "rollout.prompts_per_step": 16}
    cfg = quick_config(warm_model_dir, tmp_path / "run", algo="opd", steps=8, **overrides, **QUIET)
    trainer = Trainer(cfg)
    parts = trainer.parts
    fixed = collate(
        [c for group in parts.collector.collect(1).completions for c in group], parts.tokenizer.pad_token_id
    )
    kls = [exact_reverse_kl(parts.model, parts.teacher.model, fixed)]
    for step in range(1, 9):
        before = params_of(parts.model)
        record = trainer.train_step(step)
        assert record["actual_updates"] == 1 and not same(before, params_of(parts.model))
        assert record["first_update/ratio_mean"] == 1.0 and record["teacher_kl"] > 0
        kls.append(exact_reverse_kl(parts.model, parts.teacher.model, fixed))
    trainer.close()
    assert kls[0] > 0.05, kls  # the teacher differs from the student
    assert kls[-1] < 0.9 * kls[0], kls


def test_the_manifest_records_the_teacher_and_a_resume_keeps_it(warm_model_dir, warm_teacher_dir, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(warm_teacher_dir, teacher)
    run = tmp_path / "run"
    cfg = quick_config(
        warm_model_dir, run, algo="opd", steps=1, **{"teacher.path": str(teacher), "checkpoint.every": 1}
    )
    train(cfg)
    recorded = json.loads((run / "manifest.json").read_text())["teacher"]
    assert recorded["path"] == str(teacher) and len(recorded["files_sha256"]) == 64
    assert [r["teacher_kl"] > 0 for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [True]

    assert main(["train", "--resume", str(run), "--steps", "2"]) == 0  # the same teacher: resumed
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "teacher_kl" in r] == [1, 2]

    weights = next(teacher.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # another teacher under the same path
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 2
    err = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "changed since the run started" in err[0] and "keeps its teacher" in err[0], err
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing moved
    assert load_run_config(run).teacher.path == str(teacher)


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_directory_exists(
    warm_model_dir, tiny_model_dirs, tmp_path, capsys
):
    run = tmp_path / "run"
    args = ["train", "--model", str(warm_model_dir), "--algo", "opd", "--teacher.path", str(tiny_model_dirs["llama"])]
    task = [part for key, value in TASK.items() for part in (f"--task.{key}", str(value))]
    assert main([*args, "--output-dir", str(run), *task]) == 2
    err = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "its tokenizer differs from the policy's" in err[0], err
    assert not run.exists()


def test_grpolab_probe_runs_a_distillation_update_with_its_teacher(warm_model_dir, warm_teacher_dir, tmp_path):
    """The probe's update is the run's: the teacher scores its batch first (without it the loss refuses)."""
    from grpolab.commands.probe import run_probe

    cfg = quick_config(warm_model_dir, tmp_path / "run", algo="opd", **{"teacher.path": str(warm_teacher_dir)})
    report = run_probe(cfg, tmp_path / "probe.json")
    assert report["complete"] and json.loads((tmp_path / "probe.json").read_text())["complete"]
