"""Before a suite runs or resumes anything, what it is about to run is checked against what it recorded
when it was made: each unfinished run's config file, the code snapshot and the data snapshot. A suite
whose frozen inputs were edited is refused with one line per problem, before anything on disk moves.

A run's reward models are read where they are (hashed, not copied): before each attempt of the run starts,
their folders are hashed again (``reward_model_problem``) and a changed one fails that run with one line."""

from __future__ import annotations

from pathlib import Path

from grpolab.common.progress import Reporter
from grpolab.common.records import config_sha256, first_difference
from grpolab.config import ConfigError, read_config_json
from grpolab.run.checkpoints import weights_sha256
from grpolab.studies.manifest import DONE, RunRecord, SuiteManifest
from grpolab.studies.suite.snapshot import hash_reward_model
from grpolab.tasks.datasets import file_sha256
from grpolab.tasks.folder_hash import tree_files, tree_sha256

DATA_FILES = {"train": "train.jsonl", "validation": "validation.jsonl", "prompt": "prompt_template.txt"}


class SuiteChanged(ConfigError):
    """A suite's recorded config, code or data no longer matches its files; nothing was run or moved."""


def config_problem(record: RunRecord) -> str | None:
    """The run's config file against its recorded SHA-256, naming the first field that differs."""
    path = Path(record.config_file)
    try:
        found = read_config_json(path)
    except FileNotFoundError:
        return f"{path} is missing; run {record.name} not run"
    except ConfigError as err:
        return f"{err}; run {record.name} not run"
    if config_sha256(found) == record.config_sha256:
        return None
    diff = first_difference(record.config, found) if record.config else None
    return f"{path} was edited after the suite was made: {diff or 'its SHA-256 differs'}; not run"


def first_changed_file(recorded: dict[str, str], found: dict[str, str]) -> str:
    """'grpolab/run/trainer.py was changed' (or removed, added) for the first path, in sorted order, that differs."""
    for name in sorted(set(recorded) | set(found)):
        if name not in found:
            return f"{name} was removed"
        if name not in recorded:
            return f"{name} was added"
        if recorded[name] != found[name]:
            return f"{name} was changed"
    return "its SHA-256 differs"


def code_problem(code: dict) -> str | None:
    """The code snapshot's tree against its recorded SHA-256, naming the first changed file."""
    folder = Path(code.get("path", "")) / "grpolab"
    if not folder.is_dir():
        return f"the code snapshot {folder} is missing; not run"
    found = tree_files(folder)
    if tree_sha256(found) == code.get("sha256"):
        return None
    what = first_changed_file(code["files"], found) if "files" in code else "its SHA-256 differs"
    return f"the code snapshot {folder} was changed after the suite was made: {what}; not run"


def data_folder(record: RunRecord, root: Path) -> Path | None:
    """The run's data snapshot folder: recorded, or (a suite made before it was) the one whose rows match."""
    if record.data_dir is not None:
        return Path(record.data_dir)
    for folder in sorted((root / "snapshot" / "data").glob("*/")):
        path = folder / DATA_FILES["train"]
        if path.is_file() and file_sha256(path) == record.data_sha256.get("train"):
            return folder
    return None


def data_problem(record: RunRecord, root: Path) -> str | None:
    """The run's frozen rows, prompt template and copied source files against their recorded SHA-256s."""
    folder = data_folder(record, root)
    if folder is None:
        return f"run {record.name}: no data snapshot under {root / 'snapshot' / 'data'} holds its rows; not run"
    expected = {str(folder / name): record.data_sha256.get(key) for key, name in DATA_FILES.items()}
    for path, digest in {**expected, **record.data_files_sha256}.items():
        if digest is None:
            continue
        if not Path(path).is_file():
            return f"{path} is missing from the data snapshot; not run"
        if file_sha256(Path(path)) != digest:
            return f"{path} was edited after the suite was made (its SHA-256 differs); not run"
    return None


def reward_model_problem(record: RunRecord, reporter: Reporter) -> str | None:
    """The run's reward model folders, hashed once each, against their recorded SHA-256s: the first changed one
    as 'reward model DIR changed since the suite was prepared: model.safetensors was changed; ...'; None when
    none changed."""
    for path in dict.fromkeys(model["path"] for model in record.reward_models):  # a folder twice: hashed once
        model = next(m for m in record.reward_models if m["path"] == path)
        folder = Path(path)
        if not folder.is_dir():
            what = "the folder is missing"
        else:
            found = hash_reward_model(folder, reporter)
            if tree_sha256(found) == model["sha256"]:
                continue
            what = first_changed_file(model["files"], found) if "files" in model else "its SHA-256 differs"
        return (
            f"reward model {folder} changed since the suite was prepared: {what}; restore it and resume, "
            "or make a new suite"
        )
    return None


def start_checkpoint_problem(record: RunRecord, manifest: SuiteManifest) -> str | None:
    """A run that starts from an earlier run's final checkpoint (``init_from``): that checkpoint's weights must
    be the ones recorded when the earlier run completed (their SHA-256s as its checkpoint.json lists them; the
    run itself checks every file against that list before loading it, ``grpolab.run.checkpoints.verify``)."""
    source = next((r for r in manifest.runs if r.name == record.init_from), None)
    if source is None or source.final_checkpoint is None or source.final_checkpoint_sha256 is None:
        return None
    checkpoint = Path(source.final_checkpoint)
    try:
        why = None if weights_sha256(checkpoint) == source.final_checkpoint_sha256 else "its weights' SHA-256 differs"
    except (ValueError, OSError) as err:
        why = str(err)
    return (
        None
        if why is None
        else f"init_from {source.name}: its final checkpoint {checkpoint} is not the one "
        f"recorded when it completed ({why}); not run"
    )


def verify_suite(root: Path, manifest: SuiteManifest) -> None:
    """Every unfinished run's config, the code snapshot and the data its runs read, against the manifest;
    raises ``SuiteChanged`` with one line per problem."""
    pending = [r for r in manifest.runs if r.state not in DONE]
    if not pending:
        return
    problems = [code_problem(manifest.code)]
    for record in pending:
        problems += [config_problem(record), data_problem(record, root)]
    problems = list(dict.fromkeys(p for p in problems if p is not None))  # shared data folders: said once
    if problems:
        raise SuiteChanged("\n".join(problems))
