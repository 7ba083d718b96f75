"""Suites for the suite tests, shared per session: the tiny two-run suite file, the uninterrupted suite of
real ``grpolab train`` runs (the reference of every exact-resume check of a real suite), and the fake
trainer (tests/fake_trainer.py) that tests the scheduler's logic in seconds, with its own uninterrupted suite.

Use from a test module with ``pytest_plugins = ["suite_fixtures"]`` (a plugin, so that each session fixture
is made once for every module that uses it).
"""

from __future__ import annotations

from pathlib import Path

import fake_trainer
import pytest
from suite_runs import suite_file

from grpolab.commands.cli import main


@pytest.fixture(scope="session")
def finished(warm_model_dir, tmp_path_factory) -> Path:
    """The output root of the tiny suite run uninterrupted, with real ``grpolab train`` runs."""
    tmp = tmp_path_factory.mktemp("suite")
    assert main(["suite", "run", str(suite_file(tmp, warm_model_dir)), "--output-root", str(tmp / "out")]) == 0
    return tmp / "out"


@pytest.fixture(scope="session")
def fake_hook(tmp_path_factory) -> Path:
    """A folder whose sitecustomize.py turns every run process into the fake trainer."""
    return fake_trainer.install(tmp_path_factory.mktemp("fake_hook"))


class FakeRuns:
    """The fake trainer for this test's suites: ``use(slow=..., fail=..., extra=...)`` puts it on PYTHONPATH
    (so the runner's run processes, local or in Slurm jobs, become fakes) with per-run settings;
    ``start_seconds``: how long each run process takes before it touches its run directory."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hook: Path, tmp_path: Path):
        self.monkeypatch, self.hook, self.tmp_path = monkeypatch, hook, tmp_path

    def use(
        self,
        slow: dict[str, float] | None = None,
        fail: dict[str, int] | None = None,
        extra: str = "",
        step_seconds: float = 0.05,
        start_seconds: float = 0.0,
        accuracy: dict[str, float] | None = None,
    ) -> str:
        """The PYTHONPATH now set (run processes inherit it)."""
        hook = fake_trainer.install(self.tmp_path / "fake_hook", extra) if extra else self.hook
        self.monkeypatch.setenv("PYTHONPATH", str(hook))
        self.monkeypatch.setenv("GRPOLAB_FAKE_STEP_SECONDS", str(step_seconds))
        self.monkeypatch.setenv("GRPOLAB_FAKE_START_SECONDS", str(start_seconds))
        self.monkeypatch.setenv("GRPOLAB_FAKE_SLOW", ",".join(f"{k}={v}" for k, v in (slow or {}).items()))
        self.monkeypatch.setenv("GRPOLAB_FAKE_FAIL", ",".join(f"{k}:{v}" for k, v in (fail or {}).items()))
        self.monkeypatch.setenv("GRPOLAB_FAKE_ACCURACY", ",".join(f"{k}={v}" for k, v in (accuracy or {}).items()))
        return str(hook)


@pytest.fixture
def fake_runs(monkeypatch, fake_hook, tmp_path) -> FakeRuns:
    return FakeRuns(monkeypatch, fake_hook, tmp_path)


@pytest.fixture(scope="session")
def fake_finished(warm_model_dir, fake_hook, tmp_path_factory) -> Path:
    """The tiny suite run uninterrupted with fake runs: the reference of the fake-run resume checks."""
    tmp = tmp_path_factory.mktemp("fake_suite")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(fake_hook))
        patch.setenv("GRPOLAB_FAKE_STEP_SECONDS", "0")
        patch.delenv("GRPOLAB_FAKE_START_SECONDS", raising=False)
        patch.delenv("GRPOLAB_FAKE_SLOW", raising=False)
        patch.delenv("GRPOLAB_FAKE_FAIL", raising=False)
        assert main(["suite", "run", str(suite_file(tmp, warm_model_dir)), "--output-root", str(tmp / "out")]) == 0
    return tmp / "out"
