"""The config's fields for people: the ``--help`` listing, docs/config.md, and a resolved config as TOML.

All three read ``grpolab.config.config_fields()`` (every dotted field with its type, default and
description, from the pydantic models), so they cannot drift apart. ``python -m grpolab.commands.fields >
docs/config.md`` regenerates the reference; tests/test_help.py keeps the file equal to it.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Iterator
from typing import Any, Literal

from grpolab.common.fields import FieldDoc, type_text
from grpolab.config import ALIASES, ConfigError, RunConfig, config_fields
from grpolab.objectives.presets import PRESETS

HEADER = (
    "Every field can be set in the --config TOML file, in its [section] (the top-level fields before any "
    "table), or on the command line after the other options by its dotted name: --optim.lr 3e-4 or "
    "--optim.lr=3e-4 (dashes or underscores; values are TOML literals: 3, 0.5, true, [1, 8], {rank = 8}). "
    "`grpolab config [--config FILE] [overrides] [--all]` prints the resolved config as TOML."
)


def value_text(value: Any) -> str:
    """A default as written in TOML (None, which TOML lacks, as None)."""
    if value is None:
        return "None"
    return _toml_value(json.loads(json.dumps(value, default=lambda model: model.model_dump(mode="json"))))


def _type(doc: FieldDoc) -> str:
    return ", ".join((type_text(doc.annotation), *doc.constraints))


def _default(doc: FieldDoc) -> str:
    return "required" if doc.required else value_text(doc.default)


def _kind(tag: str) -> str:
    """A task kind's ``task.name``: its tag, or for the kinds of your own the import path's form."""
    return "package.module:Class" if tag == "imported" else tag


def groups() -> Iterator[tuple[str, str, list[FieldDoc]]]:
    """(title, what the section is, its fields) for the top level and each section and task kind, in the
    models' order; a task kind's ``name`` is in its title, a section's own row is its title."""
    docs = config_fields()
    sections = {(d.name, d.variant): d for d in docs if d.is_section}
    kinds = {d.variant: d for d in docs if d.name == "task.name"}
    order: dict[tuple[str, str | None], list[FieldDoc]] = {("", None): []}
    for doc in docs:
        key = (doc.section.removesuffix("[]"), doc.variant)
        order.setdefault(key, [])
        if doc.is_section:
            order.setdefault((doc.name, doc.variant), [])
            if doc.name == "task":  # one row for the kind; each kind's fields follow in a group of their own
                tags = tuple(_kind(v) for v in kinds)
                order[("task", None)].append(
                    FieldDoc(
                        "task.name",
                        "task",
                        None,
                        Literal[tags],
                        doc.default.name,
                        "the task kind: a built-in one (its fields below) or a task class of your own",
                    )
                )
        elif not (doc.name == "task.name" and doc.variant is not None):
            order[key].append(doc)
    for (section, variant), fields in order.items():
        if not section:
            yield "top level", "", fields
            continue
        own = sections.get((section, variant)) or sections.get((section, None))
        if section == "task" and variant is not None:
            yield f'[task] name = "{_kind(variant)}"', kinds[variant].description, fields
            continue
        kind = f' (task.name = "{variant}")' if variant and section != "task" else ""
        brackets = f"[[{section.removesuffix('[]')}]]" if own and own.is_list else f"[{section}]"
        default = "" if own is None or own.is_list or own.default is not None else " (default: None)"
        yield f"{brackets}{kind}", (own.description if own else "") + default, fields


def help_text(width: int = 100) -> str:
    """The listing ``train --help`` and its siblings end with: short names, then every field by section, each
    with its type, default and description."""
    lines = ["config fields:", *textwrap.wrap(HEADER, width), "", "short names:"]
    lines += [f"  --{alias.replace('_', '-'):<14} = --{target}" for alias, target in ALIASES.items()]
    lines.append("  (the top-level fields below are short already: --steps, --threads, --output-dir, --seed)")
    body = textwrap.TextWrapper(width=width, initial_indent=" " * 8, subsequent_indent=" " * 8)
    for title, what, docs in groups():
        lines += ["", f"{title}{': ' + what if what else ''}" if title != "top level" else "top level:"]
        for doc in docs:
            lines.append(f"  --{doc.name} {_type(doc)} = {_default(doc)}")
            lines += body.wrap(doc.description)
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Table-safe: a | would split the cell, a <name> would be read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def markdown() -> str:
    """docs/config.md: the same fields as ``--help``, as tables."""
    out = [
        "# Config reference",
        "",
        "<!-- Generated from the config's own field descriptions: `python -m grpolab.commands.fields > "
        "docs/config.md`. tests/test_help.py fails when this file differs. -->",
        "",
        *textwrap.wrap(
            f"{HEADER} `grpolab train --help` lists the same fields in the terminal. A field missing from a file "
            "or command line keeps the default below; an unknown or mistyped one is refused, naming the closest "
            "field.",
            110,
        ),
        "",
        "## Short names",
        "",
        "| on the command line | sets |",
        "|---|---|",
        *(f"| `--{a.replace('_', '-')}` | `{t}` |" for a, t in ALIASES.items()),
        "",
        "The top-level fields are short already: `--steps`, `--threads`, `--output-dir`, `--seed`.",
    ]
    for title, what, docs in groups():
        out += ["", f"## {'Top level' if title == 'top level' else f'`{title}`'}", ""]
        if what:
            out += [what[0].upper() + what[1:] + ".", ""]
        if not docs:
            continue
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        for doc in docs:
            default = _default(doc)
            out.append(
                f"| `{doc.name}` | {_cell(_type(doc))} | "
                f"{default if default == 'required' else '`' + _cell(default) + '`'} | {_cell(doc.description)} |"
            )
    return "\n".join(out) + "\n"


# ---- a resolved config as TOML ----------------------------------------------------------------------------
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("-inf" if value < 0 else "inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return f"[{', '.join(_toml_value(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"{value!r}: no TOML form")


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _table(data: dict[str, Any], path: str) -> list[str]:
    """``data`` as TOML under ``[path]``: its values first, then its sub-tables and arrays of tables; a None
    (TOML has none) as a comment, the field left out, which keeps the default."""
    lines = []
    for key, value in data.items():
        if value is None:
            lines.append(f"# {_key(key)} = None")
        elif not (isinstance(value, dict) and value) and not _is_tables(value):
            lines.append(f"{_key(key)} = {_toml_value(value)}")
    for key, value in data.items():
        name = f"{path}.{_key(key)}" if path else _key(key)
        if isinstance(value, dict) and value:
            own = any(not (isinstance(v, dict) and v) and not _is_tables(v) for v in value.values())
            lines += ["", f"[{name}]"] if own else []  # a table of tables only: TOML implies its header
            lines += _table(value, name)
        elif _is_tables(value):
            for item in value:
                lines += ["", f"[[{name}]]", *_table(item, name)]
    return lines


def _nones(data: Any, name: str = "") -> Iterator[str]:
    if data is None:
        yield name
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _nones(value, f"{name}.{key}" if name else key)
    elif isinstance(data, list):
        for value in data:
            yield from _nones(value, f"{name}[]")


def differences(cfg: RunConfig) -> dict[str, Any]:
    """What ``cfg`` sets beyond the defaults, as loading reads it back: a section given keeps its own fields'
    defaults, the algorithm's fields merge into its preset, a task of another kind names its kind."""
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    spec = cfg.algorithm.model_dump(mode="json")
    preset = PRESETS[cfg.algorithm.name].model_dump(mode="json")
    algorithm = {k: v for k, v in spec.items() if preset.get(k) != v}
    if cfg.algorithm.name != RunConfig.model_fields["algorithm"].get_default(call_default_factory=True).name:
        algorithm = {"name": cfg.algorithm.name, **algorithm}
    data.pop("algorithm", None)
    if algorithm:
        data["algorithm"] = algorithm
    if "task" in data or type(cfg.task) is not type(RunConfig().task):
        data["task"] = {"name": cfg.task.name, **data.get("task", {})}
    return data


def config_toml(cfg: RunConfig, every_field: bool = False) -> str:
    """``cfg`` as a TOML file that ``--config`` loads back to the same config: what differs from the defaults,
    or with ``every_field`` all of it (unset fields as ``# name = None`` comments). ConfigError for a field
    set to None where its default is not (TOML cannot say it; keep such a config as JSON)."""
    changed = differences(cfg)
    unsayable = list(_nones(changed))
    if unsayable:
        raise ConfigError(
            f"{unsayable[0]} is None, which TOML cannot write (its default is not None); keep this config as JSON"
        )
    what = "every field" if every_field else "what differs from the defaults (--all: every field)"
    head = [f"# grpolab config: {what}; grpolab train --config THIS_FILE runs it"]
    body = _table(cfg.model_dump(mode="json") if every_field else changed, "")
    return "\n".join(head + (body if body else ["# (every field at its default)"])) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
