"""The weight-sync check: non-finite differences fail, and a calibrated limit sees a stale bf16 engine."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import quick_config
from rich.console import Console

from grpolab.rollout.hf.engine import HFEngine
from grpolab.rollout.sync_check import SyncMonitor, WeightSyncError, verify_weight_sync
from grpolab.run.trainer import Trainer


def _pair(n=4, t=6, noise=1e-3, seed=0):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(n, t, generator=g)
    engine = trainer + noise * torch.randn(n, t, generator=g)
    mask = torch.zeros(n, t)
    mask[:, 2:] = 1
    return engine, trainer, mask


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_engine_logprobs_fail_the_check(bad):
    engine, trainer, mask = _pair()
    engine[1, 3] = bad
    with pytest.raises(WeightSyncError, match="disagree"):
        verify_weight_sync(engine, trainer, mask, mean_abs_diff=10.0)
    with pytest.raises(WeightSyncError):
        verify_weight_sync(engine, trainer, mask, max_abs_diff=10.0)
    with pytest.raises(WeightSyncError):
        SyncMonitor(None, 0.1, noise_multiple=None).check(engine, trainer, mask)
    engine[1, 3] = 0.0
    engine[1, 0] = bad  # outside the response mask: ignored
    verify_weight_sync(engine, trainer, mask, mean_abs_diff=10.0)


def test_monitor_calibrates_on_the_first_check_then_enforces_a_multiple():
    monitor = SyncMonitor(None, 0.1, noise_multiple=3.0, min_floor=1e-6)
    engine, trainer, mask = _pair(noise=1e-3)
    first = monitor.check(engine, trainer, mask)
    assert monitor.noise_floor == pytest.approx(first["sync/logprob_diff_mean"])
    assert first["sync/noise_floor_mean"] == monitor.noise_floor
    monitor.check(*_pair(noise=1.5e-3, seed=1))  # noise of the same order passes
    with pytest.raises(WeightSyncError, match="mean"):
        monitor.check(*_pair(noise=5e-3, seed=2))  # far below the absolute 0.1, above 3 x the floor
    assert SyncMonitor(None, 0.1, noise_multiple=None).check(*_pair(noise=5e-3, seed=2))  # absolute only: passes
    floored = SyncMonitor(None, None, noise_multiple=3.0, min_floor=1e-2)
    floored.check(*_pair(noise=1e-6))
    floored.check(*_pair(noise=5e-3, seed=3))  # within 3 x the minimum floor


class CopyEngine:
    """A bf16 engine with its own copy of the weights, like vLLM: ``sync_weights`` copies (and
    rounds) the trainer's weights into it, unless ``skip`` is set (a broken sync)."""

    def __init__(self, model, tokenizer):
        self.copy = copy.deepcopy(model).to(torch.bfloat16)
        self.inner = HFEngine(self.copy, tokenizer, max_batch_size=256)
        self.skip = False

    def generate(self, prompts, n, params):
        return self.inner.generate(prompts, n, params)

    def sync_weights(self, model):
        if not self.skip:
            with torch.no_grad():
                for mine, theirs in zip(self.copy.parameters(), model.parameters()):
                    mine.copy_(theirs)

    def close(self):
        pass


def test_a_broken_sync_in_bf16_is_caught_by_the_calibrated_limit(warm_model_dir, tmp_path):
    cfg = quick_config(
        warm_model_dir,
        tmp_path / "run",
        **{"model.dtype": "bfloat16", "rollout.sync_check": True, "optim.lr": 1e-5, "rollout.prompts_per_step": 16},
    )
    trainer = Trainer(cfg, Console(quiet=True))
    trainer.parts.collector.engine = CopyEngine(trainer.parts.model, trainer.parts.tokenizer)
    limit = cfg.rollout.sync_limits("bfloat16")[1]
    for step in range(1, 4):  # in sync: the calibrated limit holds
        record = trainer.train_step(step)
        assert record["sync/logprob_diff_mean"] < trainer.parts.sync_monitor.calibrated_limit()
    assert 0 < trainer.parts.sync_monitor.noise_floor < limit / 10  # the absolute bf16 limit is far above the floor
    trainer.parts.engine.skip = True  # from now on the engine keeps the step-3 weights
    with pytest.raises(WeightSyncError):
        for step in range(4, 16):
            record = trainer.train_step(step)
            assert record["sync/logprob_diff_mean"] < limit  # the absolute limit alone never fires
    assert step <= 14, "caught within ten stale steps at lr 1e-5"


def _shifted(diff: float, n=4, t=6):
    """Engine log-probs ``diff`` above the trainer's on every response token: mean and max |diff| = diff."""
    trainer = -torch.rand(n, t, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    mask = torch.zeros(n, t)
    mask[:, 2:] = 1
    return (trainer.double() + diff).float(), trainer, mask


def test_the_noise_floor_is_the_largest_of_a_window_of_checks():
    """Calibrated on the first check alone (1e-3), a limit of 3e-3 stops the in-sync noise of a later step (5e-3);
    over a window of three checks the floor is their largest (2e-3) and the stop 6e-3. A check within the window
    is already held to the limit of the checks before it."""
    monitor = SyncMonitor(None, None, noise_multiple=3.0, min_floor=1e-9, calibration_steps=3)
    for diff in (1e-3, 2e-3, 1.5e-3):
        monitor.check(*_shifted(diff))
    assert monitor.noise_floor == pytest.approx(2e-3, rel=1e-4) and monitor.calibrated == 3
    assert monitor.check(*_shifted(5e-3))["sync/noise_floor_mean"] == pytest.approx(2e-3, rel=1e-4)
    with pytest.raises(WeightSyncError, match="mean"):
        monitor.check(*_shifted(7e-3))
    early = SyncMonitor(None, None, noise_multiple=3.0, min_floor=1e-9, calibration_steps=3)
    early.check(*_shifted(1e-3))
    with pytest.raises(WeightSyncError):
        early.check(*_shifted(3.5e-3))  # within the window: above 3 x the floor so far


def test_the_margin_is_the_observed_difference_over_the_stop_limit_every_step():
    """margin = max over the limits in force of observed / limit (1 = the run stops): mean 3e-3 of a calibrated
    6e-3 is 0.5, max 3e-3 of an absolute 1e-2 is 0.3."""
    monitor = SyncMonitor(1e-2, 0.1, noise_multiple=3.0, min_floor=1e-9, calibration_steps=1)
    first = monitor.check(*_shifted(2e-3))
    assert first["sync/margin"] == pytest.approx(0.2, rel=1e-4)  # before calibration: max 2e-3 of 1e-2
    record = monitor.check(*_shifted(3e-3))
    assert record["sync/mean_limit"] == pytest.approx(6e-3, rel=1e-4)
    assert record["sync/margin"] == pytest.approx(0.5, rel=1e-4)


def test_a_margin_past_the_warn_level_is_one_line_until_it_falls_back():
    lines: list[str] = []
    monitor = SyncMonitor(
        None, None, noise_multiple=3.0, min_floor=1e-9, calibration_steps=1, warn_margin=0.6, warn=lines.append
    )
    monitor.check(*_shifted(1e-3))  # limit 3e-3 from here on
    monitor.check(*_shifted(1.5e-3))  # margin 0.5
    assert lines == []
    monitor.check(*_shifted(2.1e-3))  # 0.7
    monitor.check(*_shifted(2.4e-3))  # 0.8: still the same excursion
    assert len(lines) == 1 and "0.70" in lines[0] and "stops at 1" in lines[0]
    monitor.check(*_shifted(1e-3))
    monitor.check(*_shifted(2.1e-3))
    assert len(lines) == 2


def test_the_calibration_window_survives_a_resume():
    monitor = SyncMonitor(None, None, noise_multiple=3.0, min_floor=1e-9, calibration_steps=3)
    monitor.check(*_shifted(1e-3))
    resumed = SyncMonitor(None, None, noise_multiple=3.0, min_floor=1e-9, calibration_steps=3)
    resumed.load_state_dict(monitor.state_dict())
    for m in (monitor, resumed):
        m.check(*_shifted(2e-3))
        m.check(*_shifted(1e-3))
    assert resumed.state_dict() == monitor.state_dict() and resumed.calibrated == 3
    resumed.load_state_dict({"noise_floor": 1e-3})  # a checkpoint from before the window: calibrated on one check
    assert resumed.calibrated == 1


def test_a_run_records_its_sync_margin_and_calibrates_over_its_window(warm_model_dir, tmp_path):
    """Every step logs its margin; a warn level every step passes gives one line for the whole excursion."""
    cfg = quick_config(
        warm_model_dir, tmp_path / "run", **{"rollout.sync_calibration_steps": 2, "rollout.sync_warn_margin": 1e-9}
    )
    out = io.StringIO()
    trainer = Trainer(cfg, Console(file=out, width=400))
    records = [trainer.train_step(step) for step in (1, 2, 3)]
    trainer.close()
    means = [r["sync/logprob_diff_mean"] for r in records]
    assert records[2]["sync/noise_floor_mean"] == max(means[:2])
    assert all(0 < r["sync/margin"] < 1 for r in records)
    assert out.getvalue().count("sync check: engine and trainer log-probs are at") == 1
