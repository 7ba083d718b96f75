"""A settings record as a run or suite keeps it (its JSON form): its fingerprint, and the first field where a
found record differs from the recorded one, said by its dotted name."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def config_sha256(data: dict[str, Any]) -> str:
    """SHA-256 of a config's JSON form with sorted keys: what a run or suite records and later verifies."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def first_difference(recorded: Any, found: Any, prefix: str = "") -> str | None:
    """The first dotted field (in sorted order) where ``found`` differs from ``recorded``, as
    'optim.lr is 0.05, was 0.0001'; None when they are equal."""
    if isinstance(recorded, dict) and isinstance(found, dict):
        for key in sorted(set(recorded) | set(found)):
            name = f"{prefix}{key}"
            if key not in found:
                return f"{name} was removed (was {json.dumps(recorded[key])})"
            if key not in recorded:
                return f"{name} was added ({json.dumps(found[key])})"
            if (diff := first_difference(recorded[key], found[key], f"{name}.")) is not None:
                return diff
        return None
    if recorded == found and type(recorded) is type(found):
        return None
    return f"{prefix.removesuffix('.') or 'the whole config'} is {json.dumps(found)}, was {json.dumps(recorded)}"
