"""Pydantic validation errors as one readable line per bad field."""

from __future__ import annotations

from collections.abc import Collection

from pydantic import ValidationError


def describe_validation_error(err: ValidationError, root: str = "config", tags: Collection[str] = ()) -> list[str]:
    """One readable line per bad field: ``dotted.field: message``; ``tags`` (a tagged union's, which pydantic
    puts in the location) are left out of the dotted name."""
    return [
        f"{'.'.join(str(p) for p in e['loc'] if p not in tags) or root}: {e['msg'].removeprefix('Value error, ')}"
        for e in err.errors()
    ]
