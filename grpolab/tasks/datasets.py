"""Question/answer rows from local JSONL or Parquet files, or from the Hugging Face hub.

Every loader returns ``{"question": str, "answer": str}`` dicts, whatever the source's field names,
so fingerprints do not depend on the file format. Parquet needs the optional ``pyarrow`` and the
hub needs the optional ``datasets`` package; both fail with a clear ``DataError`` when missing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataError(ValueError):
    """Data that cannot be used; the message names the file and, where known, the line or row."""


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) per non-blank line; malformed JSON names the file and line number."""
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) per Parquet row; needs pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'grpolab[parquet]')") from None
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as err:
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    for index, record in enumerate(records):
        yield f"{path} row {index}", record


def _to_qa(location: str, record: Any, question_field: str, answer_field: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise DataError(f"{location}: expected a JSON object, got {type(record).__name__}")
    for name in (question_field, answer_field):
        if name not in record:
            raise DataError(f"{location}: missing field {name!r} (fields: {', '.join(map(str, record))})")
        if not isinstance(record[name], str):
            raise DataError(f"{location}: field {name!r} is {type(record[name]).__name__}, expected a string")
    return {"question": record[question_field], "answer": record[answer_field]}


def local_records(path: str | Path) -> list[tuple[str, Any]]:
    """(location, record) of every row of a local ``.jsonl`` or ``.parquet`` file; the location is
    ``file:line`` (JSONL) or ``file row N`` (Parquet).

    Raises DataError for a missing file, an unknown suffix, a malformed line (with its line number)
    or Parquet without pyarrow.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return list(_jsonl_records(path))
    if suffix in PARQUET_SUFFIXES:
        return list(_parquet_records(path))
    raise DataError(f"{path}: unknown data format {suffix!r}; use {JSONL_SUFFIXES + PARQUET_SUFFIXES}")


def load_rows(path: str | Path, question_field: str = "question", answer_field: str = "answer") -> list[dict[str, str]]:
    """All rows of a local ``.jsonl`` or ``.parquet`` file as ``{"question", "answer"}`` dicts.

    Raises DataError as ``local_records`` does, and for a missing or non-string field.
    """
    return [_to_qa(loc, rec, question_field, answer_field) for loc, rec in local_records(path)]


def hub_records(name: str, split: str, config: str | None = None, revision: str | None = None) -> list[tuple[str, Any]]:
    """(location, record) of a hub dataset split via the optional ``datasets`` package
    (e.g. ``"openai/gsm8k", "test", "main"``).

    Raises DataError when ``datasets`` is not installed or the hub cannot be reached.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{HUB_PREFIX}{name}: a hub dataset needs the datasets package: pip install 'grpolab[hub]' (or download "
            "the files and give local paths)"
        ) from None
    source = f"hub dataset {name!r} (config {config!r}, split {split!r})"
    try:
        records = datasets.load_dataset(name, config, split=split, revision=revision)
    except Exception as err:
        raise DataError(f"{source}: could not load ({type(err).__name__}: {err})") from None
    return [(f"{source} row {i}", dict(rec)) for i, rec in enumerate(records)]


HUB_PREFIX = "hub:"


def source_records(source: str | Path) -> list[tuple[str, Any]]:
    """(location, record) from a local ``.jsonl`` / ``.parquet`` file, or ``hub:NAME[:CONFIG]:SPLIT``
    through ``datasets`` (e.g. ``hub:openai/gsm8k:main:test``)."""
    text = str(source)
    if not text.startswith(HUB_PREFIX):
        return local_records(source)
    parts = text[len(HUB_PREFIX) :].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise DataError(f"{text!r}: expected hub:NAME:SPLIT or hub:NAME:CONFIG:SPLIT")
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    return hub_records(name, split, config)


def load_source(
    source: str | Path, question_field: str = "question", answer_field: str = "answer"
) -> list[dict[str, str]]:
    """``{"question", "answer"}`` rows of ``source`` (see ``source_records``)."""
    return [_to_qa(loc, rec, question_field, answer_field) for loc, rec in source_records(source)]


def first_n(rows: list[dict[str, str]], n: int | None, source: str = "data") -> list[dict[str, str]]:
    """The first ``n`` rows (all when ``n`` is None); DataError when fewer than ``n`` exist."""
    if n is None:
        return list(rows)
    if n < 0:
        raise DataError(f"{source}: cannot take {n} rows")
    if n > len(rows):
        raise DataError(f"{source}: asked for the first {n} rows but it has only {len(rows)}")
    return rows[:n]


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 characters kept."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def rows_sha256(rows: list[dict[str, str]]) -> str:
    """SHA-256 (hex) of the canonical JSON of ``rows`` (a list, in order)."""
    return hashlib.sha256(canonical_json(rows).encode("utf-8", "surrogatepass")).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def text_sha256(text: str) -> str:
    """SHA-256 (hex) of a string, e.g. a prompt template, as UTF-8."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
