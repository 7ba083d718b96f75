"""Files and folders that appear whole or not at all: written under a temporary sibling name, every file
and folder fsynced, renamed into place, the parent fsynced after, so a kill or a power cut leaves the old
content or the new, never a part.

A temporary name says who writes it: ``.NAME-HOST-PID-RANDOM.tmp`` (NAME cut to fit a file name, HOST a
short hash of the machine's name). Each writer removes the temporaries of earlier writes of the same target
whose owner process is gone (same machine, pid no longer alive); a live writer's, or one on another machine
(a shared file system), is never touched, so concurrent writers never disturb each other. An OSError on
the way names the target's path."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TAIL = re.compile(r"-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$")
STEM_MAX = 255 - len(".-00000000-4294967296-00000000.tmp")  # the longest NAME part that leaves a legal file name


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path, sync: Callable[[Path], None] = fsync_path, files: bool = True) -> None:
    """fsync every file under ``folder`` (unless ``files`` is False: the caller synced them), then every
    folder, deepest first, ``folder`` last."""
    paths = sorted(Path(folder).rglob("*"))
    for path in paths if files else []:
        if path.is_file() and not path.is_symlink():
            sync(path)
    for path in sorted(
        [p for p in paths if p.is_dir() and not p.is_symlink()] + [Path(folder)], key=lambda p: -len(p.parts)
    ):
        sync(path)


def temp_path(target: Path) -> Path:
    """A sibling of ``target`` that no other writer uses, named after this process."""
    target = Path(target)
    return target.parent / f".{target.name[:STEM_MAX]}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def owner_gone(path: Path) -> bool:
    """Whether ``path`` is a temporary of this module whose writer, on this machine, is no longer running."""
    match = _TAIL.search(Path(path).name)
    return bool(match) and match["host"] == _HOST and not _alive(int(match["pid"]))


def remove_stale(target: Path) -> list[Path]:
    """Remove the temporaries of earlier writes of ``target`` whose owner is gone; returns them."""
    target = Path(target)
    prefix = f".{target.name[:STEM_MAX]}-"
    removed = []
    try:
        entries = list(target.parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for path in entries:
        name = path.name
        if not name.startswith(prefix) or not _TAIL.fullmatch(name[len(prefix) - 1 :]) or not owner_gone(path):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def named(err: OSError, path: Path, tmp: Path | None = None) -> OSError:
    """``err`` naming ``path`` when it names no path itself (a write that ran out of space names none) or
    names the temporary ``tmp`` standing in for ``path`` (a file inside it: the same file inside ``path``)."""
    if err.errno is None:
        return err
    name = None if err.filename is None else str(err.filename)
    if name is not None and tmp is not None and (name == str(tmp) or name.startswith(str(tmp) + os.sep)):
        name = str(path) + name[len(str(tmp)) :]
    if name is None or name != err.filename:
        return type(err)(err.errno, err.strerror or os.strerror(err.errno), name or str(path))
    return err


_RUST_IO = re.compile(r"\(os error (\d+)\)")


def as_os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: itself, one it was raised from (``raise ... from``; not one it was merely
    raised while handling: that error has its own say), or the errno of a library that words it in its own
    error (safetensors: "... (os error 28)"); None for anything else."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__
    match = _RUST_IO.search(str(err))
    if match:
        number = int(match[1])
        return OSError(number, os.strerror(number))
    return None


class RecordingWriter(io.RawIOBase):
    """A binary file ``f`` that remembers the OSError of a failed write, for a library that turns it into an
    error of its own without it (``torch.save``: "unexpected pos")."""

    def __init__(self, f: IO[bytes]):
        super().__init__()
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            name = getattr(self.f, "name", None)
            self.error = named(err, Path(name)) if isinstance(name, str) else err
            raise


@contextmanager
def atomic_file(target: Path, mode: str = "w", sync: Callable[[Path], None] = fsync_path) -> Iterator[IO]:
    """Open a temporary sibling of ``target`` for writing (``mode`` "w" or "wb"); when the block ends
    without an error it is fsynced and renamed to ``target`` (replacing it), and the parent fsynced.
    On an error the temporary is removed and ``target`` is unchanged."""
    target = Path(target)
    remove_stale(target)
    tmp = temp_path(target)
    try:
        try:
            with open(tmp, mode) as f:
                yield f
                f.flush()
            sync(tmp)
            os.replace(tmp, target)
            sync(target.parent)
        except OSError as err:
            raise named(err, target, tmp) from None
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def write_file(target: Path, data: str | bytes, sync: Callable[[Path], None] = fsync_path) -> Path:
    """``target`` holding ``data``, written atomically."""
    with atomic_file(target, "wb" if isinstance(data, bytes) else "w", sync) as f:
        f.write(data)
    return Path(target)


def _put_in_place(tmp: Path, target: Path, replace: Callable[[Path], None] | None) -> None:
    """Rename ``tmp`` to ``target``. An existing ``target`` fails the rename, unless it is an empty folder or
    ``replace`` is given: then ``replace(target)`` is asked (it raises to refuse), the old one is renamed
    aside to a temporary of ours and removed after. Concurrent writers all succeed; the last one's stays."""
    aside: list[Path] = []
    while True:
        try:
            os.rename(tmp, target)
            break
        except OSError as err:
            if replace is None or err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        replace(target)
        old = temp_path(target)
        try:
            os.rename(target, old)
        except FileNotFoundError:  # another writer moved it first
            continue
        aside.append(old)
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_folder(
    target: Path,
    replace: Callable[[Path], None] | None = None,
    sync: Callable[[Path], None] = fsync_path,
    files_synced: bool = False,
) -> Iterator[Path]:
    """A new temporary folder beside ``target`` to write into; when the block ends without an error every
    file (unless ``files_synced``: the block fsynced each itself) and folder in it is fsynced, it is renamed to ``target`` (which may be absent or an empty folder;
    see ``_put_in_place`` for ``replace``) and the parent fsynced. On an error, or when ``target`` already
    holds something, the temporary is removed and the error raised (naming ``target``)."""
    target = Path(target)
    remove_stale(target)
    tmp = temp_path(target)
    try:
        try:
            tmp.mkdir()
            yield tmp
            fsync_tree(tmp, sync, files=not files_synced)
            _put_in_place(tmp, target, replace)
            sync(target.parent)
        except Exception as err:
            os_error = as_os_error(err)
            if os_error is None:
                raise
            raise named(os_error, target, tmp) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
