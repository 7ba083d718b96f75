"""The trackers a run can also log to, by the name ``log.trackers`` takes: what each needs installed and where it
logs (a phrase of the field's description). Light on purpose (no tracker package is imported here): the config
reads its choices here, and ``grpolab.run.trackers`` registers each tracker's factory against these names.

A new tracker is declared here once (``declare_tracker``) and registered with its factory in its own module of
``grpolab.run.trackers`` (docs/architecture.md: Where a new tracker goes)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from grpolab.common.extras import MissingPackage


@dataclass(frozen=True)
class DeclaredTracker:
    """A tracker's name, the ``package`` it imports and the pyproject ``extra`` that installs it, where it logs
    (``logs_to``: the field's description), and whether ``log.NAME = true`` is an earlier version's spelling of
    listing it (``old_switch``: run directories hold it in their config.json, and a resume reads that)."""

    name: str
    package: str
    logs_to: str
    extra: str = "trackers"
    old_switch: bool = False

    @property
    def install(self) -> str:
        return f"pip install 'grpolab[{self.extra}]'"


TRACKER_NAMES: dict[str, DeclaredTracker] = {}
"""The trackers by ``log.trackers`` name, in declaration order (``declare_tracker``)."""


def declare_tracker(name: str, package: str, logs_to: str, *, extra: str = "trackers", old_switch: bool = False):
    """Make ``name`` a choice of ``log.trackers``: a tracker that needs ``package`` (installed by ``extra``)."""
    TRACKER_NAMES[name] = DeclaredTracker(name, package, logs_to, extra, old_switch)


def tracker_names() -> list[str]:
    return list(TRACKER_NAMES)


def choices_text() -> str:
    """The names as a refusal lists them: ``'tensorboard', 'wandb' or 'trackio'``."""
    quoted = [f"'{name}'" for name in TRACKER_NAMES]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def import_package(name: str) -> ModuleType:
    """The package the tracker ``name`` needs, imported; ``MissingPackage`` naming the install when it is missing
    or broken (one line, before anything on disk moves)."""
    declared = TRACKER_NAMES[name]
    package, install = declared.package, declared.install
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name != package:  # installed, but something it imports is not
            raise MissingPackage(
                f"log.trackers {name}: the {package} package does not import ({err}); {install}"
            ) from None
        raise MissingPackage(f"log.trackers {name} needs the {package} package: {install}") from None
    except ImportError as err:
        raise MissingPackage(f"log.trackers {name}: the {package} package does not import ({err}); {install}") from None


declare_tracker("tensorboard", "tensorboard", "RUN_DIR/tensorboard", old_switch=True)
declare_tracker(
    "wandb", "wandb", "offline into RUN_DIR/wandb unless WANDB_MODE, WANDB_API_KEY or a wandb login say otherwise"
)
declare_tracker("trackio", "trackio", "its local database, or TRACKIO_SPACE_ID")
