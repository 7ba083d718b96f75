"""Edges of the loop: refused configurations, devices of indices, stop strings in evaluation,
KL-only steps, and metrics over every response token."""

from __future__ import annotations

import pytest
import torch
from conftest import params_of, quick_config, same
from host_reads import HostReads
from rich.console import Console
from torch.overrides import TorchFunctionMode

from grpolab.commands.cli import main
from grpolab.config import ConfigError, load_config
from grpolab.rollout.engines import check_settings
from grpolab.rollout.evaluation import grade_completions, greedy
from grpolab.run.trainer import Trainer


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"engine": "vllm", "rollout.temperature": 2.5}, "temperatures up to 2"),
        ({"engine": "vllm", "rollout.top_p": 0.9}, "top_p = 1 and top_k = 0"),
        ({"engine": "vllm", "rollout.top_k": 20}, "top_p = 1 and top_k = 0"),
        ({"eval.pass_k": [0]}, "eval.pass_k.0"),
        ({"rollout.group_size": 1}, "group_size 1"),
        ({"rollout.group_size": 1, "algo": "dr_grpo"}, "every advantage would be 0"),
        ({"model.like_overrides": {"num_hidden_layers": 2}}, "only to a like:NAME model"),
        ({"model": "like:qwen3-0.6b", "engine": "vllm"}, "random weights"),
    ],
)
def test_configurations_that_cannot_run_or_learn_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):  # the config's own rules, then the chosen engine's
        check_settings(load_config(None, overrides))


def test_refusals_are_one_line_with_exit_2_and_write_nothing(warm_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "--model", str(warm_model_dir), "--output-dir", str(out), "--task.n_val", "16"]
    for extra in (["--engine", "vllm", "--rollout.temperature", "2.5"], ["--eval.n_examples", "17"]):
        assert main([*base, *extra]) == 2
        lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert not out.exists()


def test_rft_with_group_size_one_is_allowed():  # no group baseline: every sample has its own reward
    assert load_config(None, {"algo": "rft", "rollout.group_size": 1}).rollout.group_size == 1


class IndexDevices(TorchFunctionMode):
    """Records (device of the indexed tensor, device of the index) for every indexing call."""

    def __init__(self):
        super().__init__()
        self.pairs: list[tuple[torch.device, torch.device]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            source, index = args[0], args[1]
        elif func in (torch.Tensor.index_select, torch.index_select):
            source, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
        else:
            source = index = None
        if isinstance(source, torch.Tensor) and isinstance(index, torch.Tensor):
            self.pairs.append((source.device, index.device))
        return func(*args, **kwargs)


@pytest.mark.parametrize("algo", ["grpo", "rft", "offpolicy_clip"])
def test_every_index_of_an_update_lives_on_the_device_it_indexes(algo, warm_model_dir, tmp_path):
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", algo=algo), Console(quiet=True))
    rollout = trainer.parts.collector.collect(1)
    with IndexDevices() as recorder:
        trainer.parts.learner.learn(rollout)
    trainer.close()
    assert len(recorder.pairs) > 5  # pruning masks, minibatch indices, batch selection
    assert all(source == index for source, index in recorder.pairs), recorder.pairs


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_a_learning_step_reads_the_device_per_optimizer_step_not_per_micro_batch(algo, warm_model_dir, tmp_path):
    """Micro-batches of one row read as many values back from the device as micro-batches of 16 (GSPO: 4
    optimizer steps with frozen old and reference log-probs)."""
    reads = []
    for micro in (16, 1):
        cfg = quick_config(
            warm_model_dir,
            tmp_path / str(micro),
            algo=algo,
            reference="frozen",
            **{"optim.micro_batch_size": micro, "algorithm.beta": 0.04},
        )
        trainer = Trainer(cfg, Console(quiet=True))
        try:
            rollout = trainer.parts.collector.collect(1)
            with HostReads() as mode:
                trainer.parts.learner.learn(rollout)
        finally:
            trainer.close()
        reads.append(mode.count)
    assert reads[0] == reads[1] > 0


def test_step_indices_and_pruning_masks_are_made_on_the_data_device():
    """On a CPU machine every tensor is on the CPU, so the recorder above cannot see a mix-up; the
    "meta" device (shapes without data) shows where the index tensors are created."""
    from grpolab.learning.update import UpdateData, minibatches, rows_with_gradient
    from grpolab.objectives.presets import PRESETS

    meta = torch.device("meta")
    for spec in (PRESETS["grpo"], PRESETS["offpolicy_clip"]):
        steps = list(minibatches(spec, 256, torch.Generator().manual_seed(0), meta))
        assert len(steps) == spec.steps_per_epoch and all(i.device == meta for i in steps)
        data = UpdateData(
            advantages=torch.empty(256, device=meta), response_mask=torch.empty(256, 9, device=meta), old_logprobs=None
        )
        assert rows_with_gradient(spec, data, steps[0]).device == meta


def test_evaluation_with_stop_strings_grades_exactly_like_training(warm_model_dir, tmp_path):
    cfg = quick_config(warm_model_dir, tmp_path / "run", **{"rollout.stop_strings": ["</think>"], "eval.n_examples": 8})
    trainer = Trainer(cfg, Console(quiet=True))
    metrics = trainer.evaluate(0)
    prompts = [trainer.parts.prompt_ids[e.id] for e in trainer.parts.val_examples]
    completions = trainer.parts.engine.generate(prompts, 1, greedy(trainer.parts.collector.sampling_params(0, 0)))
    grades = [g[0] for g in grade_completions(trainer.parts.task, trainer.parts.val_examples, completions)]
    trainer.close()
    assert all(c[0].text.endswith("</think>") or c[0].truncated for c in completions)
    assert any(c[0].text.endswith("</think>") for c in completions)  # the stop string did cut
    assert metrics["val/accuracy"] == sum(g.answer_reward for g in grades) / len(grades)
    assert metrics["val/format_rate"] == sum(g.format_reward for g in grades) / len(grades)
    assert metrics["val/truncation_rate"] == sum(c[0].truncated for c in completions) / len(completions)


def test_kl_only_step_updates_the_parameters_and_logs_kl(warm_model_dir, tmp_path):
    trainer = Trainer(
        quick_config(warm_model_dir, tmp_path / "run", **{"algorithm.beta": 0.1, "rollout.max_new_tokens": 2})
    )
    with torch.no_grad():
        for p in trainer.parts.model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a policy away from its reference
    before = params_of(trainer.parts.model)
    record = trainer.train_step(1)  # two tokens hold no answer: every advantage is 0, only KL remains
    trainer.close()
    assert record["reward_mean"] == 0.0 and record["actual_updates"] == 1
    assert record["kl_ref"] > 0 and not same(before, params_of(trainer.parts.model))


def test_metrics_cover_every_response_token_even_when_rows_are_pruned(warm_model_dir, tmp_path):
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", algo="rft", reference="frozen"))
    rollout = trainer.parts.collector.collect(1)
    record = trainer.parts.learner.learn(rollout)
    tokens = sum(len(c.completion_ids) for c in rollout.flat())
    assert record["metric_tokens"] == tokens and "kl_ref" in record and "entropy" in record
    lean = Trainer(quick_config(warm_model_dir, tmp_path / "lean", algo="rft", **{"optim.full_metrics": False}))
    lean_record = lean.parts.learner.learn(rollout)
    lean.close()
    trainer.close()
    wrong = sum(
        len(c.completion_ids) for c, g in zip(rollout.flat(), [g for gr in rollout.grades for g in gr]) if g.reward == 0
    )
    assert lean_record["metric_tokens"] == tokens - wrong


def test_an_engine_error_raised_by_the_same_ctrl_c_still_exits_as_interrupted(monkeypatch, capsys):
    import signal

    import grpolab.commands.cli as cli

    def engine_died_of_the_interrupt(*args):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the trainer's own Ctrl-C, caught inside the library
        raise RuntimeError("vLLM finished a request with 'abort'")  # vLLM swallowed our KeyboardInterrupt

    monkeypatch.setattr(cli, "run_command", engine_died_of_the_interrupt)
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(["demo"]) == 130 and "interrupted" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    monkeypatch.setattr(cli, "run_command", lambda *a: (_ for _ in ()).throw(RuntimeError("real failure")))
    with pytest.raises(RuntimeError, match="real failure"):
        cli.main(["demo"])
