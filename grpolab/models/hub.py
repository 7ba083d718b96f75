"""Hugging Face hub ids: ``org/name`` (and a revision) resolved to a snapshot folder of the local Hugging Face
cache, the cache first, downloaded only when it is not there and the network is allowed.

Everything then loads from that folder (``HF_HUB_CACHE/models--org--name/snapshots/COMMIT``): the tokenizer,
the model and an engine of its own alike, so a cached model works offline (``HF_HUB_OFFLINE=1``). The folder's
name is the commit a run records. ``refs/main`` moves only when something refreshes the cache (``grpolab
download``, another tool): a run resolves the same commit until then.

``huggingface_hub`` reads ``HF_HOME`` / ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` when it is imported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from huggingface_hub.utils import validate_repo_id as _validate_repo_id

from grpolab.common.progress import Reporter

try:  # a snapshot an interrupted download left: huggingface_hub 2.x names it (from the listing it keeps of a
    # download); 1.x (the one beside transformers 5.17) keeps no listing and returns such a snapshot as whole
    from huggingface_hub.errors import IncompleteSnapshotError
except ImportError:

    class IncompleteSnapshotError(LocalEntryNotFoundError):  # type: ignore[no-redef]
        """Never raised by this huggingface_hub (1.x)."""


DEFAULT_REVISION = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")
_ORG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Snapshot:
    """A repository at ``revision`` (as asked: a branch, tag or commit) in the cache: its ``commit`` and ``folder``."""

    repo_id: str
    revision: str
    commit: str
    folder: Path


def is_hub_id(spec: str) -> bool:
    """Whether ``model.path`` names a hub repository: no existing local path (a local path always wins) and
    of the form ``org/name``."""
    return has_hub_id_form(spec) and not Path(spec).expanduser().exists()


def has_hub_id_form(spec: str) -> bool:
    """``org/name``: one slash, the hub's characters, no ``--`` or ``..``."""
    if not _ORG_NAME.fullmatch(spec):
        return False
    try:
        _validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def snapshot_of(folder: Path) -> tuple[str, str] | None:
    """(repository id, commit) of a snapshot folder of the Hugging Face cache
    (``.../models--org--name/snapshots/COMMIT``), else None."""
    folder = Path(folder)
    kind, _, name = folder.parent.parent.name.partition("--")
    if folder.parent.name != "snapshots" or kind not in ("models", "datasets") or not name:
        return None
    return name.replace("--", "/"), folder.name


def _what(repo_id: str, revision: str, repo_type: str) -> str:
    at = "" if revision == DEFAULT_REVISION else f" at revision {revision}"
    return f"{'dataset' if repo_type == 'dataset' else 'model'} {repo_id}{at}"


def _download_command(repo_id: str, revision: str, repo_type: str) -> str:
    flags = ("" if revision == DEFAULT_REVISION else f" --revision {revision}") + (
        " --dataset" if repo_type == "dataset" else ""
    )
    return f"grpolab download {repo_id}{flags}"


def _cached(repo_id: str, revision: str, repo_type: str) -> Snapshot:
    """The cached snapshot, complete as far as the cache's own file listing tells; LocalEntryNotFoundError
    (IncompleteSnapshotError for an interrupted download) when it is not there."""
    folder = snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True)
    return Snapshot(repo_id, revision, Path(folder).name, Path(folder))


def _not_cached(
    repo_id: str, revision: str, repo_type: str, err: LocalEntryNotFoundError, or_local: bool = True
) -> FileNotFoundError:
    """The one line for a repository that is not (wholly) in the cache while downloads are off (``or_local``:
    a model may be a local folder instead)."""
    what, command = _what(repo_id, revision, repo_type), _download_command(repo_id, revision, repo_type)
    if isinstance(err, IncompleteSnapshotError):
        return FileNotFoundError(
            f"{what} is only partly in the Hugging Face cache {constants.HF_HUB_CACHE} (an interrupted download; "
            f"HF_HUB_OFFLINE=1): run '{command}' on a machine with network to complete it"
        )
    local = ", or give a local folder" if repo_type == "model" and or_local else ""
    return FileNotFoundError(
        f"{what} is not in the Hugging Face cache {constants.HF_HUB_CACHE} (HF_HUB_OFFLINE=1): "
        f"run '{command}' on a machine with network{local}"
    )


def _hub_error(repo_id: str, revision: str, repo_type: str, err: Exception, or_local: bool = True) -> Exception:
    """What the hub answered, as one line (``or_local``: a model may be a local folder instead)."""
    what = _what(repo_id, revision, repo_type)
    if isinstance(err, RevisionNotFoundError):
        return ValueError(f"{what}: the hub has no such revision (a branch, a tag or a 40-character commit)")
    if isinstance(err, RepositoryNotFoundError):  # gated too
        local = ", nor a local folder" if repo_type == "model" and or_local else ""
        return FileNotFoundError(
            f"{what}: no such repository on the Hugging Face hub{local} (a private or gated one needs "
            "'hf auth login' and its terms accepted on its page)"
        )
    return FileNotFoundError(
        f"{what} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and the hub cannot be reached "
        f"({type(err.__cause__ or err).__name__}): check the network, or run "
        f"'{_download_command(repo_id, revision, repo_type)}' where there is one"
    )


@contextmanager
def _progress(reporter: Reporter | None, title: str) -> Iterator[None]:
    """Hugging Face's own bars on a terminal; when the output is not one, no bars and a phase's plain lines."""
    was_disabled = are_progress_bars_disabled()
    plain = reporter is None or reporter.plain
    (disable_progress_bars if plain else enable_progress_bars)()
    try:
        if reporter is not None and not plain:
            reporter.line(title)  # the bars below are Hugging Face's, not the reporter's live ones
        with reporter.phase(title) if reporter is not None and plain else nullcontext():
            yield
    finally:
        (disable_progress_bars if was_disabled else enable_progress_bars)()


def resolve(
    repo_id: str,
    revision: str | None = None,
    reporter: Reporter | None = None,
    repo_type: str = "model",
    refresh: bool = False,
) -> Snapshot:
    """The snapshot of ``repo_id`` at ``revision`` (default main): the cache's, else (or with ``refresh``:
    a branch re-read from the hub first) downloaded with progress on ``reporter``. Offline, only the cache's.
    One-line errors (FileNotFoundError, ValueError) saying what to run."""
    revision = revision or DEFAULT_REVISION
    if not refresh or constants.HF_HUB_OFFLINE:
        try:
            return _cached(repo_id, revision, repo_type)
        except LocalEntryNotFoundError as err:
            if constants.HF_HUB_OFFLINE:
                raise _not_cached(repo_id, revision, repo_type, err, or_local=not refresh) from None
    with _progress(reporter, f"download {_what(repo_id, revision, repo_type)}"):
        try:
            folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision))
        except (RepositoryNotFoundError, RevisionNotFoundError, LocalEntryNotFoundError) as err:
            raise _hub_error(repo_id, revision, repo_type, err, or_local=not refresh) from None
    return Snapshot(repo_id, revision, folder.name, folder)


def cached_folder(repo_id: str, revision: str | None = None) -> Path | None:
    """The model's snapshot folder when the cache holds it whole, else None (nothing is downloaded)."""
    try:
        return _cached(repo_id, revision or DEFAULT_REVISION, "model").folder
    except LocalEntryNotFoundError:
        return None


def check_available(repo_id: str, revision: str | None = None) -> None:
    """Refuse, before anything is written, a model that cannot load: offline and not (wholly) cached. Online
    a missing one is downloaded when the run loads it."""
    revision = revision or DEFAULT_REVISION
    if constants.HF_HUB_OFFLINE:
        try:
            _cached(repo_id, revision, "model")
        except LocalEntryNotFoundError as err:
            raise _not_cached(repo_id, revision, "model", err) from None


def current_commit(repo_id: str, revision: str | None = None) -> str:
    """The commit a run loading ``repo_id`` at ``revision`` would use now, without downloading anything: the
    revision itself when it is a commit, the cache's (``refs/REVISION``), else the hub's answer; offline and
    not cached: one line saying what to run."""
    revision = revision or DEFAULT_REVISION
    if COMMIT.fullmatch(revision):
        return revision
    try:
        return _cached(repo_id, revision, "model").commit
    except LocalEntryNotFoundError as err:
        if constants.HF_HUB_OFFLINE:
            raise _not_cached(repo_id, revision, "model", err) from None
    try:
        return HfApi().repo_info(repo_id, revision=revision).sha
    except Exception as err:  # noqa: BLE001 -- a network failure raises the hub client's own HTTP library's errors
        raise _hub_error(repo_id, revision, "model", err) from None
