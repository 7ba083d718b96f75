"""The sections that the run layer reads: ``[checkpoint]`` (``grpolab.run.checkpoints``), ``[log]`` (the
trackers, ``grpolab.run.trackers``) and ``[warn]`` (``grpolab.run.health``). They sit here, one layer below
``grpolab.run``, because the run layer is where the assembled config is consumed: every other section lives in
the folder whose code reads it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from grpolab.common.fields import RegistryChoices
from grpolab.common.settings import Section
from grpolab.common.tracker_names import TRACKER_NAMES, choices_text, tracker_names


class CheckpointConfig(Section):
    every: int = Field(50, ge=1, description="a verified checkpoint every N steps (and at the last step)")
    keep_last: int | None = Field(
        None,
        ge=1,
        description="keep only the newest N checkpoints (the oldest are "
        "removed once a newer one verifies); None keeps all",
    )


def _declared_tracker(name: str) -> str:
    if name not in TRACKER_NAMES:  # as pydantic words a Literal's refusal
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": choices_text()})
    return name


TrackerName = Annotated[str, AfterValidator(_declared_tracker), RegistryChoices(tracker_names)]
"""A ``log.trackers`` choice: a name ``grpolab.common.tracker_names`` declares (read when validated)."""


def _trackers_description() -> str:
    listed = ", ".join(f'"{t.name}" ({t.logs_to})' for t in TRACKER_NAMES.values())
    installs = " or ".join(dict.fromkeys(t.install for t in TRACKER_NAMES.values()))
    return (
        f"also log every metrics.jsonl record there: {listed}; a list, or names separated by commas; needs {installs}"
    )


class LogConfig(Section):
    """``[log]``: the trackers a run also logs to, beside its metrics.jsonl (docs/running.md: Trackers)."""

    trackers: list[TrackerName] = Field(default_factory=list, description=_trackers_description())
    project: str = Field("grpolab", min_length=1, description="the W&B and Trackio project")
    run_name: str | None = Field(
        None, min_length=1, description="the run's name in W&B and Trackio; None = the run directory's name"
    )
    completions_every: int | None = Field(
        10,
        ge=1,
        description="every N steps (and the last) the trackers get a table of the step's sampled completions "
        "(prompt, completion, reward and its terms, advantage); None = never",
    )
    completions_max: int = Field(
        64, ge=1, description="rows of a completions table at most: the step's first prompt groups, whole"
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        """``NAME = true``, an earlier version's spelling of ``trackers = ["NAME"]`` for the trackers declared
        with an ``old_switch`` (run directories of earlier versions hold it in their config.json, and a resume
        reads that)."""
        if not isinstance(data, dict):
            return data
        for name in [t.name for t in TRACKER_NAMES.values() if t.old_switch and t.name in data]:
            data = dict(data)
            old = data.pop(name)
            if not isinstance(old, bool):
                raise ValueError(f'{name} (the old spelling of trackers = ["{name}"]) must be true or false')
            trackers = data.get("trackers", [])
            if isinstance(trackers, str):
                trackers = _names(trackers)
            if old and isinstance(trackers, list) and name not in trackers:
                data["trackers"] = [*trackers, name]
        return data

    @field_validator("trackers", mode="before")
    @classmethod
    def _tracker_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # --log.trackers NAME,NAME
            value = _names(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = list(dict.fromkeys(value))  # each once, in order
        return value


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


class WarnConfig(Section):
    """When the run warns that it cannot learn (the other warnings' thresholds: ``grpolab.run.health``)."""

    no_signal_steps: int = Field(
        5,
        ge=1,
        description="warn after this many steps in a row in which every group's rewards were equal (no "
        "learning signal: advantages 0, updates skipped); a shorter run warns at its end when no step had one",
    )
