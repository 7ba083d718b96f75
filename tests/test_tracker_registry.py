"""The trackers by registry: ``grpolab.common.tracker_names`` declares each ``log.trackers`` name (the config's
choices, the package it needs), ``grpolab.run.trackers.registry`` holds each one's factory, registered in its own
module. A tracker declared and registered here, in the test, is accepted by the config, checked, named and built
like the built-in ones; nothing else in the package names a tracker."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

import grpolab
from grpolab.common.extras import MissingPackage
from grpolab.common.fields import type_text
from grpolab.common.tracker_names import TRACKER_NAMES, DeclaredTracker, choices_text, import_package
from grpolab.config import ConfigError, LogConfig, load_config
from grpolab.run.trackers import check_trackers, identities, open_trackers
from grpolab.run.trackers.registry import TRACKERS, TrackerStart, register_tracker

PACKAGE = Path(grpolab.__file__).resolve().parent


class MemoryTracker:
    """A tracker that keeps what it gets in a list."""

    name, resends, mode = "memory", True, "local"

    def __init__(self, start: TrackerStart):
        self.start, self.logged, self.closed = start, [], None

    def describe(self) -> str:
        return f"memory {self.start.run['label']}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        pass

    def close(self, finished: bool) -> None:
        self.closed = finished


@pytest.fixture
def memory_tracker(monkeypatch) -> dict[str, Any]:
    """The ``memory`` tracker, declared (its package: ``json``) and registered for this test only; what its
    check and factory saw."""
    seen: dict[str, Any] = {"checks": 0, "built": []}
    monkeypatch.setitem(TRACKER_NAMES, "memory", DeclaredTracker("memory", "json", "a list in this process"))
    monkeypatch.setitem(TRACKERS, "memory", None)  # undone at the end: the key removed again

    def check() -> None:
        seen["checks"] += 1

    def identity(settings: LogConfig, run_name: str, previous: dict[str, Any] | None) -> dict[str, Any]:
        return previous or {"label": f"{settings.project}/{run_name}"}

    @register_tracker("memory", identity=identity, check=check)
    def start_memory(start: TrackerStart) -> MemoryTracker:
        tracker = MemoryTracker(start)
        seen["built"].append(tracker)
        return tracker

    return seen


def test_every_declared_tracker_has_a_factory_and_every_factory_a_declared_name():
    assert list(TRACKERS) and set(TRACKERS) == set(TRACKER_NAMES)
    for name, kind in TRACKERS.items():
        assert kind.name == name


def test_a_tracker_registered_in_a_test_is_accepted_checked_named_and_built(memory_tracker, tmp_path):
    settings = load_config(None, {"log.trackers": "memory,tensorboard", "log.project": "p"}).log
    assert settings.trackers == ["memory", "tensorboard"]
    only_memory = settings.model_copy(update={"trackers": ["memory"]})
    check_trackers(only_memory)
    assert memory_tracker["checks"] == 1
    runs = identities(only_memory, tmp_path / "run-a", previous=None)
    assert runs == {"memory": {"label": "p/run-a"}}
    assert identities(only_memory, tmp_path / "run-b", previous=runs) == runs  # a resume continues its run
    said: list[str] = []
    trackers, modes = open_trackers(
        only_memory, tmp_path, runs, continued={"memory"}, config={}, first_step=3, sent_through=-1, say=said.append
    )
    (built,) = memory_tracker["built"]
    assert built.start.run == {"label": "p/run-a"} and built.start.continued and built.start.first_step == 3
    assert modes == {"memory": "local"} and said == ["tracker: memory p/run-a"]
    trackers.log({"step": 4, "reward_mean": 0.5, "note": "text"})
    trackers.close(finished=True)
    assert built.logged == [(4, {"reward_mean": 0.5})] and built.closed is True


def test_an_unknown_name_is_refused_with_exactly_the_declared_names(memory_tracker):
    with pytest.raises(ConfigError) as refused:
        load_config(None, {"log.trackers": "wandb,mlflow"})
    message = str(refused.value)
    assert message == f"log.trackers.1: Input should be {choices_text()}"
    assert re.findall(r"'([^']+)'", message) == list(TRACKER_NAMES)
    assert "'memory'" in message and "mlflow" not in message


def test_the_field_listing_shows_the_declared_names(memory_tracker):
    shown = type_text(LogConfig.model_fields["trackers"].annotation)
    assert shown == "list[" + " | ".join(f'"{name}"' for name in TRACKER_NAMES) + "]"


def test_a_factory_for_an_undeclared_name_is_refused():
    with pytest.raises(ValueError, match="'mlflow' is not declared"):
        register_tracker("mlflow", identity=lambda settings, run_name, previous: {})
    assert "mlflow" not in TRACKERS


def test_a_missing_tracker_package_is_one_line_naming_its_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(
        MissingPackage, match=r"^log.trackers wandb needs the wandb package: pip install 'grpolab\[trackers\]'$"
    ):
        import_package("wandb")
    with pytest.raises(MissingPackage, match="wandb needs the wandb package"):
        check_trackers(LogConfig(trackers=["wandb"]))  # before anything on disk moves


def tracker_names_in_source(package: Path) -> list[str]:
    """Every line that names a tracker as a string (``"wandb"``), but in ``common/tracker_names.py`` (the
    declarations) and in the module that registers that tracker (its own)."""
    names = "|".join(re.escape(name) for name in TRACKER_NAMES)
    quoted = re.compile(rf"""["']({names})["']""")
    own = {name: Path(sys.modules[kind.start.__module__].__file__).resolve() for name, kind in TRACKERS.items()}
    declarations = (package / "common" / "tracker_names.py").resolve()
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.resolve() == declarations:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(own.get(name) != path.resolve() for name in quoted.findall(line)):
                found.append(f"{path.relative_to(package).as_posix()}:{number}: {line.strip()}")
    return found


def test_no_module_but_the_registry_and_its_own_names_a_tracker():
    """The tracker names live in their declarations and each in its own module: the config, the run and the
    rest ask the registry (a branch on a name elsewhere is found)."""
    assert not tracker_names_in_source(PACKAGE), "\n".join(tracker_names_in_source(PACKAGE))


def test_a_branch_on_a_tracker_name_is_found(tmp_path):
    (tmp_path / "trainer.py").write_text('if "trackio" in settings.trackers:\n    pass\n')
    assert tracker_names_in_source(tmp_path) == ['trainer.py:1: if "trackio" in settings.trackers:']
