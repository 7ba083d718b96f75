"""Pydantic validation errors as one readable line per bad field."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from pydantic import ValidationError

UnknownField = Callable[[tuple[str | int, ...], Any], str]
"""An unknown key's line, from its location (tags left out) and its value: say what was meant."""


def describe_validation_error(
    err: ValidationError, root: str = "config", tags: Collection[str] = (), unknown: UnknownField | None = None
) -> list[str]:
    """One readable line per bad field: ``dotted.field: message``; ``tags`` (a tagged union's, which pydantic
    puts in the location) are left out of the dotted name; ``unknown`` words the line of a key the model does
    not have (pydantic's 'Extra inputs are not permitted')."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in tags)
        if unknown is not None and e["type"] == "extra_forbidden":
            lines.append(unknown(loc, e["input"]))
        else:
            lines.append(f"{'.'.join(str(p) for p in loc) or root}: {e['msg'].removeprefix('Value error, ')}")
    return lines
