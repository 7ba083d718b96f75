"""The frozen teacher of on-policy distillation (``algorithm.teacher_kl_coef`` > 0, the ``opd`` preset).

``[teacher]`` names any causal LM the policy could be (a local folder, a hub id, ``gguf:FILE``); it is loaded
once, frozen, on the trainer's device (``load_teacher``), and scores the sampled tokens of each rollout batch in
one forward without gradients, through the same memory-lean log-prob path as the reference
(``grpolab.learning.learner``). The teacher reads the student's token ids, so its tokenizer must give every token
the same id (``check_teacher_tokenizer``); its identity (folder, config, revision, SHA-256 of its files) goes to
the run's manifest and a resume refuses another (``check_teacher_record``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpolab.common.progress import Reporter
from grpolab.models.loading import DTYPES, load_policy, model_record
from grpolab.models.settings import TeacherConfig
from grpolab.models.sources import FolderRequest, check_model_spec, resolve_model_dir
from grpolab.tasks.base import Task
from grpolab.tasks.folder_hash import model_bytes, model_files, tree_sha256

# the prompt formats a tokenizer's chat template never renders (any other may: its template must then match)
TEMPLATE_FREE_FORMATS = ("r1_zero", "template")


def check_teacher_tokenizer(student: Any, teacher: Any, name: str, chat_prompts: bool) -> None:
    """One line when the teacher would read the student's token ids differently: a token with another id (or
    missing), another EOS token, or (``chat_prompts``: the prompts are rendered by the policy's chat template,
    which the teacher then reads) another chat template. The vocabularies are compared token by token, not
    by size; merges are not compared (the teacher only reads ids)."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    for token, token_id in sorted(ours.items(), key=lambda kv: kv[1]):
        if theirs.get(token) != token_id:
            where = "missing" if token not in theirs else f"id {theirs[token]}"
            raise ValueError(
                f"teacher {name}: its tokenizer differs from the policy's: token {token!r} is id {token_id} in the "
                f"policy's and {where} in the teacher's; on-policy distillation needs the same tokenizer"
            )
    extra = sorted(set(theirs) - set(ours))
    if extra:
        raise ValueError(
            f"teacher {name}: its tokenizer has {len(extra)} tokens the policy's lacks (e.g. {extra[0]!r}); "
            "on-policy distillation needs the same tokenizer"
        )
    if student.eos_token_id != teacher.eos_token_id:
        raise ValueError(
            f"teacher {name}: its eos token is id {teacher.eos_token_id}, the policy's {student.eos_token_id}; "
            "on-policy distillation needs the same tokenizer"
        )
    if chat_prompts and getattr(student, "chat_template", None) != getattr(teacher, "chat_template", None):
        raise ValueError(
            f"teacher {name}: its chat template differs from the policy's, and the teacher would score completions "
            "of prompts rendered by the policy's template; use task.prompt.format 'r1_zero' or 'template', or a "
            "teacher with the policy's template"
        )


@dataclass
class Teacher:
    """A loaded teacher: its frozen model, its folder and its manifest record."""

    model: nn.Module
    model_dir: Path
    record: dict[str, Any]


def load_teacher(
    teacher: TeacherConfig,
    task: Task,
    policy_tokenizer: Any,
    prompt_format: str | None,
    compute_dtype: torch.dtype,
    device: torch.device,
    reporter: Reporter,
) -> Teacher:
    """The teacher of ``[teacher]``, frozen in eval mode on ``device`` in its dtype (auto: ``compute_dtype``), its
    tokenizer checked against the policy's (``check_teacher_tokenizer``; the chat template too unless the task's
    ``prompt_format`` renders no template) and its files hashed for the manifest."""
    check_model_spec(teacher.path, teacher.revision)
    model_dir = resolve_model_dir(teacher.path, FolderRequest(task, revision=teacher.revision, reporter=reporter))
    dtype = compute_dtype if teacher.dtype == "auto" else DTYPES[teacher.dtype]
    with reporter.phase(f"load teacher {model_dir}") as phase:
        model, tokenizer = load_policy(model_dir, dtype, device)
        check_teacher_tokenizer(policy_tokenizer, tokenizer, teacher.path, prompt_format not in TEMPLATE_FREE_FORMATS)
        model.eval().requires_grad_(False)  # frozen in place: no copy of a model that may be large
        phase.info = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, {dtype}"
    total = model_bytes(model_dir)
    with reporter.phase(
        f"hash teacher {model_dir}", total=max(1, -(-total // 2**20)), unit="MiB", done_note=None
    ) as phase:
        done = [0]

        def advance(size: int) -> None:
            done[0] += size
            phase.advance(done[0] // 2**20 - phase.done)

        files = model_files(model_dir, on_file=advance)
    record = {**model_record(model, model_dir), "path": teacher.path, "files_sha256": tree_sha256(files)}
    return Teacher(model, model_dir, record)


def check_teacher_record(recorded: dict[str, Any] | None, teacher: Teacher | None, manifest: Path) -> None:
    """A resumed run keeps its teacher: one line when the teacher now loaded is not the one ``manifest`` recorded
    (its config, revision or files changed)."""
    if recorded is None or teacher is None:
        return
    for key in ("files_sha256", "config_sha256", "revision"):
        if recorded.get(key) != teacher.record.get(key):
            raise ValueError(
                f"teacher {teacher.record['path']} changed since the run started ({manifest}: its {key} was "
                f"{recorded.get(key)}, now {teacher.record.get(key)}); a resumed run keeps its teacher"
            )
