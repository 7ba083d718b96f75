"""The fields of a nested pydantic settings model, each by its dotted name, and "did you mean" for a wrong one.

A field whose type is a model (or an optional one) is a section: its fields follow it, named
``section.field``. A union of models tagged with ``Tag`` (a discriminated union) gives each member's fields
with that member's tag as their ``variant``; a list of models gives its items' fields as ``name[].field``.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, Tag
from pydantic_core import PydanticUndefined

REQUIRED = PydanticUndefined  # the default of a field that has none


@dataclass(frozen=True)
class FieldDoc:
    """One field: ``name`` dotted (``optim.lr``, ``task.rewards[].function``), ``section`` the dotted table
    it sits in ("" at the top), ``variant`` the tag of the union member it belongs to (None outside one),
    ``default`` the value a run gets without setting it (``REQUIRED`` when it must be set), ``is_section``
    for a field that is itself a table (or a list of tables: ``is_list``)."""

    name: str
    section: str
    variant: str | None
    annotation: Any
    default: Any
    description: str
    constraints: tuple[str, ...] = ()
    is_section: bool = False
    is_list: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "at least"))


def _constraints(metadata: Iterable[Any]) -> tuple[str, ...]:
    return tuple(
        f"{word} {getattr(m, attr)}" for m in metadata for attr, word in _BOUNDS if getattr(m, attr, None) is not None
    )


@dataclass(frozen=True)
class RegistryChoices:
    """``Annotated[str, ..., RegistryChoices(names)]``: a string whose choices a registry holds (validated by a
    validator of its own), shown as those choices are at the time (``"a" | "b"``)."""

    names: Callable[[], Iterable[str]]


def _registry_choices(annotation: Any) -> RegistryChoices | None:
    while typing.get_origin(annotation) is typing.Annotated:
        found = [m for m in typing.get_args(annotation)[1:] if isinstance(m, RegistryChoices)]
        if found:
            return found[0]
        annotation = typing.get_args(annotation)[0]
    return None


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _members(annotation: Any) -> list[Any]:
    """The members of a union (``X | None`` included), else [annotation]."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(_strip(annotation), type) and issubclass(_strip(annotation), BaseModel)


def _tag(annotation: Any) -> str | None:
    if typing.get_origin(annotation) is typing.Annotated:
        return next((m.tag for m in typing.get_args(annotation)[1:] if isinstance(m, Tag)), None)
    return None


def walk(
    model: type[BaseModel], instance: BaseModel | None = None, prefix: str = "", variant: str | None = None
) -> Iterator[FieldDoc]:
    """Every field of ``model`` and of its sections, in declaration order (a section before its fields).
    Defaults are read from ``instance`` where given (a default config), else from the class."""
    for name, info in model.model_fields.items():
        if instance is not None:
            default = getattr(instance, name)
        elif info.default_factory is not None:
            default = info.default_factory()
        else:
            default = info.default
        dotted = f"{prefix}{name}"
        members = [m for m in _members(info.annotation) if m is not type(None)]
        is_list = len(members) == 1 and typing.get_origin(_strip(members[0])) is list
        items = [typing.get_args(_strip(members[0]))[0]] if is_list else members
        models = [m for m in items if _is_model(m)]
        doc = FieldDoc(
            dotted,
            prefix.removesuffix("."),
            variant,
            info.annotation,
            default,
            info.description or "",
            _constraints(info.metadata),
            is_section=bool(models) and len(models) == len(items),
            is_list=is_list and bool(models),
        )
        yield doc
        if not doc.is_section:
            continue
        child = f"{dotted}[]." if doc.is_list else f"{dotted}."
        tagged = len(models) > 1
        for member in models:
            cls = _strip(member)
            own = default if isinstance(default, cls) and not doc.is_list else None
            yield from walk(cls, own, child, _tag(member) if tagged else variant)


def type_text(annotation: Any) -> str:
    """A field's type in words a TOML writer reads: ``int``, ``float | none``, ``"sum" | "mean"``,
    ``list[str]``, ``[float, float]``, ``table``."""
    choices = _registry_choices(annotation)
    if choices is not None:
        return " | ".join(f'"{name}"' for name in choices.names())
    annotation = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "none"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is list:
        return f"list[{type_text(args[0])}]" if not _is_model(args[0]) else "list of tables"
    if origin is tuple:
        return f"[{', '.join(type_text(a) for a in args)}]"
    if origin is dict:
        return "table"
    if _is_model(annotation):
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _split(name: str) -> tuple[str, str]:
    section, _, leaf = name.rpartition(".")
    return section, leaf


def suggest(name: str, names: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (difflib), or None when none is close: a near match of the whole dotted
    name first, then the closest field of the same section by its own name (a long shared prefix makes any two
    names of one section look alike in full), then a looser match of the whole name."""
    names = list(dict.fromkeys(names))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    if close:
        return close[0]
    section, leaf = _split(name)
    same_section = {_split(n)[1]: n for n in names if _split(n)[0] == section}
    close = difflib.get_close_matches(leaf, list(same_section), n=1, cutoff=0.6)
    if close:
        return same_section[close[0]]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _dotted(loc: tuple[str | int, ...]) -> str:
    """('task', 'rewards', 0, 'weight') -> 'task.rewards[].weight'."""
    return "".join("[]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(loc))


def _leaves(value: Any, name: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for key, v in value.items() for leaf in _leaves(v, f"{name}.{key}")]
    return [name]


PeerNames = Mapping[str, Mapping[str, tuple[str | None, str]]]
"""Other frameworks' setting names, by framework: name (or ``name=value``) -> (the field that corresponds, or
None; a note on how it differs or what comes closest). ``grpolab.common.peer_names`` holds them."""


def _value_key(value: Any) -> str | None:
    if isinstance(value, bool):
        return str(value).lower()
    return value.lower() if isinstance(value, str) else None


def peer_line(name: str, value: Any, peers: PeerNames) -> str | None:
    """The line for ``name`` (a dotted key; its last part is looked up) when it is another framework's setting:
    'learning_rate: unknown field; did you mean optim.lr? (TRL's learning_rate; ...)', or, with no
    counterpart, what comes closest; None when no framework has that name."""
    leaf = name.rpartition(".")[2]
    value_key = _value_key(value)
    for framework, names in peers.items():
        entry = (names.get(f"{leaf}={value_key}") if value_key is not None else None) or names.get(leaf)
        if entry is None:
            continue
        field, note = entry
        if field is None:
            return f"{name}: unknown field; {framework}'s {leaf} has no grpolab equivalent: {note}"
        return f"{name}: unknown field; did you mean {field}? ({framework}'s {leaf}{f'; {note}' if note else ''})"
    return None


def unknown_field(
    loc: tuple[str | int, ...],
    value: Any,
    known: list[str],
    aliases: Mapping[str, str] | None = None,
    peers: PeerNames | None = None,
) -> str:
    """One line for a key at ``loc`` that a settings model does not have, with the closest of the ``known``
    dotted names (or, for a top-level key, of the short ``aliases``) it may have meant: 'optim.lrr: unknown
    field; did you mean optim.lr?'. A mistyped section holding one field is named with that field ('optimm.lr',
    not 'optimm'). Another framework's name (``peers``, e.g. TRL's ``learning_rate``, also under a grpolab
    section: ``optim.learning_rate``) gets its grpolab name first (``peer_line``)."""
    aliases = aliases or {}
    name = _dotted(loc)
    leaves = _leaves(value, name)
    if peers:
        line = peer_line(name, value, peers)
        if line is None and len(leaves) == 1 and leaves[0] != name:
            line = peer_line(leaves[0], None, peers)
        if line is not None:
            return line
    if len(leaves) == 1 and suggest(leaves[0], known):
        name = leaves[0]
    match = suggest(name, [*known, *(aliases if "." not in name else ())])
    if match is None:
        return f"{name}: unknown field (grpolab train --help lists every field)"
    return f"{name}: unknown field; did you mean {match}{f' (short for {aliases[match]})' if match in aliases else ''}?"
