"""Reading a run config: a TOML file (or a run's config.json) plus dotted command-line overrides
(``--optim.lr 3e-4``, or a short name: ``--algo dapo``), validated in one go with one line per bad field; a
resume's config, of which only ``RESUME_OVERRIDES`` may change; and the list of every field by its dotted name
(what ``--help``, ``grpolab config`` and docs/config.md show)."""

from __future__ import annotations

import functools
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from grpolab.common.fields import FieldDoc, unknown_field, walk
from grpolab.common.settings import ConfigError
from grpolab.common.validation import describe_validation_error
from grpolab.config.run_config import RunConfig
from grpolab.tasks.configs import TASK_KINDS

ALIASES = {
    "algo": "algorithm.name",
    "model": "model.path",
    "task": "task.name",
    "engine": "rollout.engine",
    "vllm_python": "rollout.vllm.python",
}
"""Short names on the command line (``--algo dapo``) for deeper fields; the top-level fields (``--steps``,
``--threads``, ``--output-dir``) are short already."""


@functools.cache
def config_fields() -> tuple[FieldDoc, ...]:
    """Every field of a run config by its dotted name (sections, task kinds' fields, ``task.rewards[].weight``),
    with a default config's values as defaults: what ``--help``, ``grpolab config`` and docs/config.md list."""
    return tuple(walk(RunConfig, RunConfig()))


def unknown_field_line(loc: tuple[str | int, ...], value: Any, names: list[str] | None = None) -> str:
    """One line for a key the config does not have, with the closest dotted name (or short name) it may have
    meant: 'optim.lrr: unknown field; did you mean optim.lr?' (``grpolab.common.fields.unknown_field``); a TRL name
    gets its grpolab name ('learning_rate: unknown field; did you mean optim.lr? ...', ``grpolab.common.peer_names``)."""
    from grpolab.common.peer_names import PEER_NAMES

    if names is not None:
        return unknown_field(loc, value, names)
    return unknown_field(loc, value, [f.name for f in config_fields()], ALIASES, PEER_NAMES)


def parse_value(text: str) -> Any:
    """A command-line value as a TOML literal (numbers, booleans, lists, inline tables, quoted strings), else
    a JSON list or object (``[{"function": "numeric"}]``), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if text.lstrip().startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data[a][b] = value`` for dotted name ``a.b``."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    node[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read ``path`` (TOML, or a run's config.json), apply dotted ``overrides``, validate. Raises ConfigError with one line per problem."""
    data = read_config_file(Path(path)) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        apply_override(data, ALIASES.get(dotted, dotted), value)
    return validate_config(data)


def read_config_file(path: Path) -> dict[str, Any]:
    """The nested settings of a TOML file (or a run's config.json), not validated yet; ConfigError when it is
    missing or unreadable."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None


def validate_config(data: dict[str, Any]) -> RunConfig:
    """A run config from its nested dict; raises ConfigError with one line per problem."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        lines = describe_validation_error(err, tags=TASK_KINDS, unknown=unknown_field_line)
        raise ConfigError("\n".join(lines)) from None


RESUME_OVERRIDES = ("steps", "log_every", "threads", "model.revision")
"""What a resume may change: ``steps`` (to extend a run, never to shorten it), the fields that change no
result (how often it logs, its CPU threads) and ``model.revision``, only to pin the commit the run started
from (``grpolab.run.resume`` checks it); config.json and the manifest's resume entry record the change."""


def load_run_config(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The config of the run in ``run_dir`` (its config.json), for a resume: only the ``RESUME_OVERRIDES``
    may change, so that the resumed run computes exactly what it started to."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"nothing to resume: {path} not found")
    changed = sorted(set(overrides or {}) - set(RESUME_OVERRIDES))
    if changed:
        raise ConfigError(
            f"a resumed run keeps its config; only {', '.join(RESUME_OVERRIDES)} may change "
            f"(got {', '.join('--' + c for c in changed)})"
        )
    data = read_config_json(path)
    for dotted, value in (overrides or {}).items():
        apply_override(data, dotted, value)
    data["output_dir"] = str(run_dir)
    return validate_config(data)


def read_config_json(path: Path) -> dict[str, Any]:
    """A config saved as JSON (a run's config.json, a suite's configs/NAME.json); ConfigError when it is
    not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a config (a JSON object), but a {type(data).__name__}")
    return data
