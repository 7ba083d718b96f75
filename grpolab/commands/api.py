"""The Python door: ``grpolab.train(...)`` and ``grpolab.resume(...)``, the same runs as ``grpolab train``.

Settings are the TOML's: a config file, a dict or a ``RunConfig``, and keyword arguments by section (``optim={"lr":
1e-5}``), by top-level name (``steps=20``) or by dotted name (``**{"optim.lr": 1e-5}``), the CLI's short names too
(``algo="dr_grpo"``). Besides, from Python only:

* ``model``: a hub id, a folder or ``gguf:FILE`` as in ``model.path``, or a loaded transformers model with its
  ``tokenizer``, saved once into ``RUN_DIR/inputs/model`` as the run's base (so resume, provenance and suites
  see a folder, as for any run);
* ``dataset`` / ``eval_dataset``: rows as a list of dicts or a ``datasets.Dataset`` (written once into
  ``RUN_DIR/inputs/*.jsonl``), or a file or ``hub:`` source as in ``task.train``: the ``dataset`` task kind;
* ``rewards``: Python functions ``f(completion, answer, **info) -> float`` (a script's ``__main__``, a notebook
  cell, a lambda: pickled by value into the config, run in worker processes with a time bound), verifier
  names, or reward tables as in ``[[task.rewards]]``.

Everything is validated before anything is written: a bad setting, a used run directory or a function that
cannot be sent to a worker process is one ``ConfigError`` / ``ValueError`` line. Progress goes to the console
(bars on a terminal; time-stamped lines in a notebook or a log). Ctrl-C (an interrupted notebook cell) stops
after the current step with a checkpoint; ``grpolab.resume(run_dir)`` continues it exactly.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpolab.config import (
    ALIASES,
    ConfigError,
    RunConfig,
    apply_override,
    load_run_config,
    read_config_file,
    validate_config,
)

if TYPE_CHECKING:
    from rich.console import Console

RewardLike = Callable[..., float] | str | Mapping[str, Any]


@dataclass
class Result:
    """A run's outcome, read from its directory (the same files the CLI's runs leave).

    ``summary`` is summary.json (start and final accuracy, rewards, updates, warnings); ``final`` the last
    evaluation's metrics (``val/accuracy``, ``val/format_rate``, ...); ``evaluations`` every evaluation's metrics
    by step; ``records(step)`` the per-item evaluation records; ``report()`` writes ``grpolab report``'s files
    and returns its numbers (report.json)."""

    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every line of metrics.jsonl: one record per step and one per evaluation."""
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    @property
    def evaluations(self) -> dict[int, dict[str, Any]]:
        """{step: that evaluation's metrics}, in order."""
        return {r["step"]: r for r in self.metrics if "val/accuracy" in r}

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluation's metrics ({} before the first)."""
        evaluations = self.evaluations
        return evaluations[max(evaluations)] if evaluations else {}

    def records(self, step: int | None = None) -> list[dict[str, Any]]:
        """The per-item evaluation records of ``step`` (default: the last evaluation): id, completion,
        extracted and gold answer, correct, reward terms, length, ..."""
        from grpolab.run.rundir import eval_record_steps, eval_records_path

        steps = eval_record_steps(self.run_dir)
        if not steps:
            return []
        path = eval_records_path(self.run_dir, steps[-1] if step is None else step)
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def report(self, resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
        """``grpolab report RUN_DIR``: writes RUN_DIR/report/ (report.md, figures) and returns report.json."""
        from rich.console import Console

        from grpolab.common.progress import Reporter
        from grpolab.studies.report import write_report

        path = write_report(self.run_dir, Reporter(Console(quiet=True)), None, resamples, seed, None)
        return json.loads((Path(path).parent / "report.json").read_text())


def train(
    config: str | Path | Mapping[str, Any] | RunConfig | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    dataset: Any = None,
    eval_dataset: Any = None,
    rewards: Iterable[RewardLike] | None = None,
    console: Console | None = None,
    **settings: Any,
) -> Result:
    """Train a policy with RL and return its ``Result``; the run directory is ``output_dir`` (new or empty) or
    ``runs/<time>-<algorithm>``.

    Args:
        config: a TOML file (or a run's config.json), a dict of sections as in the TOML, or a ``RunConfig``.
        model: a hub id, a folder or ``gguf:FILE``; or a loaded transformers model (then ``tokenizer`` too).
        tokenizer: the loaded model's tokenizer.
        dataset: train rows (a list of dicts, a ``datasets.Dataset``) or a source as in ``task.train`` (a
            .jsonl / .parquet file, ``hub:NAME:SPLIT``); the ``dataset`` task kind with its settings.
        eval_dataset: validation rows or source; without it, ``task.validation_size`` rows of ``dataset``
            (default: 10%, at most 200).
        rewards: functions ``f(completion, answer, **info) -> float``, verifier names (numeric, math, exact,
            regex) or tables as in ``[[task.rewards]]`` (``{"function": f, "weight": 0.5, "name": "len"}``); the
            first is the correctness (accuracy).
        console: a ``rich.console.Console`` for the progress (default: standard output).
        **settings: any config field: ``steps=20``, ``algo="dr_grpo"``, ``optim={"lr": 1e-5}``,
            ``**{"rollout.group_size": 8}``.

    Raises:
        ConfigError: a bad setting (one line per problem), before anything is written.
        ValueError / OSError: a run that cannot start (a used directory, a missing file, a function that cannot
            be sent to a worker process), before anything is written.
    """
    from grpolab.run.rundir import CONFIG_FILE, INPUTS_DIR, resolve_run_dir

    data = _config_data(config)
    for name, value in settings.items():
        _set(data, name, value)
    if isinstance(model, Mapping):  # the [model] table
        _set(data, "model", model)
    elif model is not None and not _is_loaded_model(model):
        _set(data, "model.path", str(model))
    if tokenizer is not None and not _is_loaded_model(model):
        raise ConfigError("tokenizer= goes with a loaded model (model=a transformers model)")
    _set_task(data, dataset, eval_dataset, rewards)
    label = (data.get("algorithm") or {}).get("name", "grpo") if isinstance(data.get("algorithm"), dict) else "grpo"
    run_dir = resolve_run_dir(data.get("output_dir"), label).resolve()
    data["output_dir"] = str(run_dir)
    inputs = run_dir / INPUTS_DIR
    staged: dict[str, Callable[[Path], None]] = {}
    if _is_loaded_model(model):
        if tokenizer is None:
            raise ConfigError("model= a loaded transformers model needs its tokenizer= too")
        staged["model"] = lambda path: _save_model(model, tokenizer, path)
        _set(data, "model.path", str(inputs / "model"))
    for key, rows in (("train", dataset), ("validation", eval_dataset)):
        if rows is not None and not isinstance(rows, (str, Path)):
            records = _rows(rows, key)
            staged[f"{key}.jsonl"] = lambda path, records=records: _write_jsonl(records, path)
            _set(data, f"task.{key}", str(inputs / f"{key}.jsonl"))
    cfg = validate_config(data)  # every setting checked before anything is written
    if not staged:
        return _run(cfg, console, resume=False)
    if inputs.exists():
        raise FileExistsError(f"{inputs} holds the inputs of an earlier start; choose another output_dir")
    created = not run_dir.exists()
    inputs.mkdir(parents=True)
    try:
        for name, write in staged.items():
            write(inputs / name)
        return _run(cfg, console, resume=False)
    except BaseException:
        if not (run_dir / CONFIG_FILE).exists():  # refused before it started (bad rows, a model that fails to load)
            shutil.rmtree(inputs, ignore_errors=True)  # what this call wrote, nothing else
            if created and not any(run_dir.iterdir()):
                run_dir.rmdir()
        raise


def resume(run_dir: str | Path, *, console: Console | None = None, **settings: Any) -> Result:
    """Continue the run in ``run_dir`` exactly, from its newest complete checkpoint (as ``grpolab train --resume
    RUN_DIR``); ``steps=N`` may extend it, ``threads`` and ``log_every`` change no result and may change too."""
    from grpolab.run.resume import check_target

    check_target(Path(run_dir))
    overrides = {ALIASES.get(name, name): value for name, value in settings.items()}
    return _run(load_run_config(run_dir, overrides), console, resume=True)


def _run(cfg: RunConfig, console: Console | None, resume: bool) -> Result:
    """The CLI's run: Ctrl-C (SIGINT, SIGTERM; an interrupted notebook cell) stops after the current step with
    a checkpoint, a second one at once."""
    from transformers.utils import logging as hf_logging

    from grpolab.commands.interrupts import stopping_on_signals
    from grpolab.rollout.engines import check_settings
    from grpolab.run.trainer import train as run_training

    hf_logging.disable_progress_bar()
    check_settings(cfg)
    with stopping_on_signals() as stop:
        summary = run_training(cfg, console, resume=resume, stop=stop)
    return Result(Path(cfg.output_dir), summary)


def _config_data(config: str | Path | Mapping[str, Any] | RunConfig | None) -> dict[str, Any]:
    """The settings as the nested dict a TOML file gives."""
    if config is None:
        return {}
    if isinstance(config, RunConfig):
        return config.model_dump(mode="json")
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    return read_config_file(Path(config))


def _set(data: dict[str, Any], name: str, value: Any) -> None:
    """``data[name] = value`` for a dotted (or short) name; a table given for a section merges into it."""
    dotted = name if isinstance(value, Mapping) else ALIASES.get(name, name)  # task={...} is the table, not task.name
    node: Any = data
    for part in dotted.split(".")[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    leaf = dotted.rpartition(".")[2]
    if isinstance(value, Mapping) and isinstance(node, dict) and isinstance(node.get(leaf), dict):
        for key, inner in value.items():
            _set(node[leaf], key, inner)
        return
    apply_override(data, dotted, dict(value) if isinstance(value, Mapping) else value)


def _set_task(data: dict[str, Any], dataset: Any, eval_dataset: Any, rewards: Iterable[RewardLike] | None) -> None:
    """``dataset`` / ``eval_dataset`` / ``rewards`` into the ``[task]`` table (the ``dataset`` kind)."""
    if dataset is None and eval_dataset is None and rewards is None:
        return
    task = data.setdefault("task", {})
    if not isinstance(task, dict):
        raise ConfigError(f"task: a table, not {type(task).__name__}")
    if task.get("name", "dataset") != "dataset" and (dataset is not None or eval_dataset is not None):
        raise ConfigError(f"dataset= is the dataset task's data; the config's task.name is {task['name']!r}")
    if dataset is not None:
        task["name"] = "dataset"
        if isinstance(dataset, (str, Path)):
            task["train"] = str(dataset)
    if eval_dataset is not None:
        if isinstance(eval_dataset, (str, Path)):
            task["validation"] = str(eval_dataset)
        task.pop("validation_size", None)
    elif dataset is not None and "validation" not in task and "validation_size" not in task:
        count = len(dataset) if hasattr(dataset, "__len__") and not isinstance(dataset, (str, Path)) else None
        task["validation_size"] = min(200, max(1, round(0.1 * count))) if count else 0.1
    if rewards is not None:
        if isinstance(rewards, (str, Mapping)) or callable(rewards):
            rewards = [rewards]
        task["rewards"] = [_reward_table(r, i) for i, r in enumerate(rewards)]


def _reward_table(reward: RewardLike, index: int) -> dict[str, Any]:
    """A ``[[task.rewards]]`` table for a function (named after it; a lambda: ``reward<index>``), a verifier
    name or a table."""
    if isinstance(reward, Mapping):
        return dict(reward)
    if isinstance(reward, str):
        return {"function": reward}
    if not callable(reward):
        raise ConfigError(f"rewards[{index}]: a function, a verifier name or a table, not {type(reward).__name__}")
    name = getattr(reward, "__name__", "")
    return {"function": reward, "name": name if name.isidentifier() else f"reward{index}"}


def _rows(rows: Any, split: str) -> list[dict[str, Any]]:
    """A list of dicts or a ``datasets.Dataset`` as JSON-able rows."""
    if hasattr(rows, "to_list") and callable(rows.to_list):  # datasets.Dataset
        rows = rows.to_list()
    if isinstance(rows, Mapping) or not isinstance(rows, Iterable):
        raise ConfigError(f"{split} rows: a list of dicts or a datasets.Dataset, not {type(rows).__name__}")
    rows = list(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"{split} rows: row {i} is a {type(row).__name__}, not a dict")
    if not rows:
        raise ConfigError(f"{split} rows: empty")
    try:
        return json.loads(json.dumps([dict(r) for r in rows], default=str))
    except ValueError as err:
        raise ConfigError(f"{split} rows: not JSON-able ({err})") from None


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    from grpolab.common.atomic import write_file

    write_file(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _is_loaded_model(model: Any) -> bool:
    return model is not None and hasattr(model, "save_pretrained") and hasattr(model, "config")


def _save_model(model: Any, tokenizer: Any, path: Path) -> None:
    """The loaded model and tokenizer as a Hugging Face folder (safetensors): the run's base."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
