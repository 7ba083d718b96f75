"""Where a model comes from: ``model.path`` (or ``teacher.path``) names one source, and the source turns it into a
local Hugging Face folder that every loader then reads the same way.

The sources, in the order they claim a spec:

=============  ================================================================================================
``like:NAME``  random weights at a reference model's shapes (``grpolab.models.like``)
``gguf:FILE``  a GGUF file, or a packaged short name, converted once (``grpolab.models.gguf``)
(no path)      the demo's warm-started tiny model for the task (``grpolab.models.tinymodel``)
``org/name``   a Hugging Face hub id at ``model.revision``: the cache's snapshot, else downloaded
               (``grpolab.models.hub``)
a folder       a local Hugging Face model folder, or a LoRA run's checkpoint whose base is still there
=============  ================================================================================================

A new source is one class here (what its spec looks like, what refuses it before anything is written, how it
becomes a folder, what its folder records) and its place in ``SOURCES``; nothing that loads a model changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.common.progress import Reporter
from grpolab.models.gguf import GGUF_PREFIX, absolute_spec, gguf_file, gguf_model_dir, gguf_source
from grpolab.models.hub import check_available, is_hub_id, resolve, snapshot_of
from grpolab.models.like import LIKE_PREFIX, like_model_dir
from grpolab.models.tinymodel import warm_start_model, warm_start_settings
from grpolab.tasks.base import Task


@dataclass(frozen=True)
class FolderRequest:
    """What turning a spec into a folder may need besides the spec: the task (a ``like:`` tokenizer is trained on
    its texts; the warm start solves its problems), ``like_overrides`` (``like:`` only), ``warm_start`` (the demo
    model's recipe changes), ``revision`` (hub ids only) and where a long build, download or conversion shows
    its progress."""

    task: Task
    like_overrides: dict[str, int] | None = None
    warm_start: dict[str, Any] | None = None
    revision: str | None = None
    reporter: Reporter | None = None


class ModelSource:
    """One kind of ``model.path``. Subclasses say which specs they claim and how each becomes a folder."""

    label = "a local folder"
    takes_revision = False  # model.revision picks among the source's versions
    takes_like_overrides = False

    def claims(self, spec: str | None) -> bool:
        raise NotImplementedError

    def check(self, spec: str | None, revision: str | None) -> None:
        """Refuse, in one line and before anything is converted or written, a spec that cannot load."""

    def absolute(self, spec: str) -> str:
        """``spec`` naming the same model from any working directory (a suite's runs start elsewhere)."""
        return spec

    def folder(self, spec: str | None, request: FolderRequest) -> Path:
        raise NotImplementedError

    def record(self, folder: Path) -> dict[str, Any]:
        """What this source adds to the manifest's record of a folder it made (empty for other folders)."""
        return {}


class LikeSource(ModelSource):
    label = "a like: model"
    takes_like_overrides = True

    def claims(self, spec: str | None) -> bool:
        return spec is not None and spec.startswith(LIKE_PREFIX)

    def folder(self, spec: str | None, request: FolderRequest) -> Path:
        folder = like_model_dir(spec[len(LIKE_PREFIX) :], request.task, request.like_overrides)
        if request.reporter is not None:
            request.reporter.line(
                f"{spec}: random weights at the real shapes (for memory and speed): "
                "completions rarely stop and run to max_new_tokens"
            )
        return folder


class GgufSource(ModelSource):
    label = "a GGUF file"

    def claims(self, spec: str | None) -> bool:
        return spec is not None and spec.startswith(GGUF_PREFIX)

    def check(self, spec: str | None, revision: str | None) -> None:
        gguf_file(spec[len(GGUF_PREFIX) :])

    def absolute(self, spec: str) -> str:
        return GGUF_PREFIX + absolute_spec(spec[len(GGUF_PREFIX) :])

    def folder(self, spec: str | None, request: FolderRequest) -> Path:
        return gguf_model_dir(spec[len(GGUF_PREFIX) :], request.reporter)

    def record(self, folder: Path) -> dict[str, Any]:
        source = gguf_source(folder)
        return {"gguf_source": source} if source is not None else {}


class WarmStartSource(ModelSource):
    label = "the demo's warm-started model"

    def claims(self, spec: str | None) -> bool:
        return spec is None

    def folder(self, spec: str | None, request: FolderRequest) -> Path:
        settings = warm_start_settings(request.task, request.warm_start)
        return warm_start_model(request.task, settings, reporter=request.reporter)


class HubSource(ModelSource):
    label = "a Hugging Face hub id"
    takes_revision = True

    def claims(self, spec: str | None) -> bool:
        return spec is not None and is_hub_id(spec)

    def check(self, spec: str | None, revision: str | None) -> None:
        check_available(spec, revision)

    def folder(self, spec: str | None, request: FolderRequest) -> Path:
        return check_model_path(str(resolve(spec, request.revision, request.reporter).folder))

    def record(self, folder: Path) -> dict[str, Any]:
        snapshot = snapshot_of(folder)
        return {"hub_id": snapshot[0], "revision": snapshot[1]} if snapshot else {}


class FolderSource(ModelSource):
    def claims(self, spec: str | None) -> bool:
        return spec is not None

    def check(self, spec: str | None, revision: str | None) -> None:
        check_model_path(spec)

    def absolute(self, spec: str) -> str:
        return str(Path(spec).resolve())

    def folder(self, spec: str | None, request: FolderRequest) -> Path:
        return check_model_path(spec)


SOURCES: tuple[ModelSource, ...] = (LikeSource(), GgufSource(), WarmStartSource(), HubSource(), FolderSource())


def source_of(spec: str | None) -> ModelSource:
    """The source that claims ``spec`` (the first in ``SOURCES``; a folder claims any path left)."""
    return next(source for source in SOURCES if source.claims(spec))


def check_model_spec(spec: str | None, revision: str | None = None) -> None:
    """Refuse, before anything is converted or written, a ``model.path`` that cannot load: a missing
    directory, a missing GGUF file or short name, a hub id not in the cache while offline, a ``revision`` for
    anything but a hub id (``like:`` names are checked when built)."""
    source = source_of(spec)
    if revision is not None and not source.takes_revision:
        raise ValueError(
            f"model.revision {revision} applies to a Hugging Face hub id (org/name), and model.path "
            f"{spec} is {'a local folder' if spec and Path(spec).expanduser().exists() else 'not one'}"
        )
    source.check(spec, revision)


def resolve_model_dir(spec: str | None, request: FolderRequest) -> Path:
    """The local Hugging Face folder ``spec`` names (built, converted or downloaded once and cached, with
    progress on ``request.reporter``); ``like_overrides`` for any other source than ``like:`` is refused."""
    source = source_of(spec)
    if request.like_overrides and not source.takes_like_overrides:
        raise ValueError("model.like_overrides applies only to like: models")
    return source.folder(spec, request)


def absolute_model_spec(spec: str) -> str:
    """``model.path`` naming the same model from any working directory; a hub id is one already."""
    return source_of(spec).absolute(spec)


def folder_record(folder: Path) -> dict[str, Any]:
    """What the sources know of ``folder``: a hub snapshot's id and commit, a converted GGUF file's record."""
    record: dict[str, Any] = {}
    for source in SOURCES:
        record.update(source.record(folder))
    return record


def check_model_path(path: str) -> Path:
    """A local model directory ``path`` as a Path; raises FileNotFoundError when it is not one."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir} (a Hugging Face hub id has the form org/name)")
    if (model_dir / "adapter_config.json").is_file():  # a LoRA run's checkpoint: its base must still be there
        check_model_path(json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"])
        return model_dir
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {model_dir}")
    return model_dir


def is_local_folder(spec: str | None) -> bool:
    """Whether ``spec`` names an existing local folder (not a ``like:``, ``gguf:``, warm start or hub id)."""
    return isinstance(source_of(spec), FolderSource) and Path(spec).expanduser().is_dir()
