"""Making a suite: every run resolved and validated, the code and data frozen into the new suite directory,
the reward models' folders hashed (once each; the runs read them where they are), each run's config
written and recorded (the config itself and its SHA-256), and the manifest of queued runs; or, for a dry
run, the plan printed and nothing written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from grpolab.common.atomic import write_file
from grpolab.common.progress import Reporter
from grpolab.common.records import config_sha256
from grpolab.config import RunConfig
from grpolab.models.hub import current_commit, is_hub_id
from grpolab.models.sources import absolute_model_spec, check_model_spec
from grpolab.run.rundir import RunDirError
from grpolab.studies.manifest import MANIFEST, PREPARING, RunRecord, SuiteManifest
from grpolab.studies.suite.launch import LAUNCHERS, suite_launcher
from grpolab.studies.suite.placement import parse_devices
from grpolab.studies.suite.snapshot import (
    check_package_links,
    hash_reward_model,
    snapshot_code,
    snapshot_data,
    task_key,
)
from grpolab.studies.suite.spec import SuiteRun, SuiteSpec, load_suite, resolve_runs
from grpolab.tasks.folder_hash import tree_sha256


def launch_prefix(world_size: int) -> list[str]:
    """This Python, or torchrun (one process per device, its own rendezvous on a free port) above it."""
    if world_size == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]


def train_command(config_file: Path, world_size: int = 1) -> list[str]:
    """The child process of a run's first attempt."""
    return [*launch_prefix(world_size), "-m", "grpolab.commands.cli", "train", "--config", str(config_file)]


def resume_command(run_dir: Path, world_size: int = 1) -> list[str]:
    """The child process that continues a run from its newest verified checkpoint."""
    return [*launch_prefix(world_size), "-m", "grpolab.commands.cli", "train", "--resume", str(run_dir)]


def placement_of(
    spec: SuiteSpec, devices: str | None = None, launcher: str | None = None, slurm: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Where the runs go: the launcher, the device list (None: one run at a time on what each run sees)
    and the Slurm settings; the command line's values win over the suite file's. One-line errors."""
    listed = devices if devices is not None else spec.suite.devices
    placed = parse_devices(listed) if listed is not None else None
    return LAUNCHERS[launcher or spec.suite.launcher].place(spec, placed, slurm)


def prepare_suite(
    suite_file: str | Path,
    root: Path,
    console: Console,
    dry_run: bool = False,
    placement: dict[str, Any] | None = None,
    pilot: Path | None = None,
) -> SuiteManifest | None:
    """Resolve and validate every run; with ``dry_run`` print the configs, commands and checkpoint
    footprint and write nothing; otherwise snapshot code and data into the new ``root`` and write the
    manifest of queued runs. ``placement``: the command line's devices, launcher and Slurm settings; ``pilot``:
    earlier runs of a decision suite's arms, for its plan."""
    spec = load_suite(suite_file)
    root = root.resolve()
    configs = resolve_runs(spec, root)
    where = placement_of(spec, **(placement or {}))
    if root.exists() and (not root.is_dir() or any(root.iterdir())) and not unfinished(root):
        raise RunDirError(f"suite output root already exists and is not empty: {root} (choose a new --output-root)")
    if dry_run:
        print_plan(spec, configs, root, console, where)
        if spec.decide is not None:
            for line in decision_plan(spec, configs, pilot):
                console.print(line, highlight=False, soft_wrap=True)
        return None
    check_package_links()  # before anything is written: a snapshot would copy in what a link leads to
    for run in spec.runs:  # a start model that cannot load is refused now, not hours into the queue
        if run.init_from is None:
            check_model_spec(configs[run.name].model.path, configs[run.name].model.revision)
    if root.exists():  # empty, or what an unfinished preparation left
        _empty(root)
    root.mkdir(parents=True, exist_ok=True)
    write_file(root / PREPARING, f"a suite is being prepared here; it is one once {MANIFEST} exists\n")
    try:
        manifest = _prepare(spec, suite_file, root, configs, where, console)
    except BaseException:
        _empty(root)  # as it was: a retry into it starts clean
        raise
    (root / PREPARING).unlink()
    return manifest


def _empty(root: Path) -> None:
    for path in root.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def unfinished(root: Path) -> bool:
    """Whether ``root`` holds a suite whose preparation was stopped (killed) before its manifest was written."""
    return (root / PREPARING).is_file() and not (root / MANIFEST).exists()


def _prepare(
    spec: SuiteSpec,
    suite_file: str | Path,
    root: Path,
    configs: dict[str, RunConfig],
    where: dict[str, Any],
    console: Console,
) -> SuiteManifest:
    """The snapshot, each run's config and the manifest (written last) in ``root``."""
    code = snapshot_code(root / "snapshot" / "src")
    data: dict[str, dict[str, Any]] = {}
    hashed: dict[str, dict[str, str]] = {}  # reward model folder -> its files' SHA-256s, hashed once a suite
    reporter = Reporter(console)
    records = []
    for run in spec.runs:
        cfg = configs[run.name]
        key = task_key(cfg)
        folder = root / "snapshot" / "data" / key
        if key not in data:
            data[key] = snapshot_data(cfg, folder)
        models = []
        for model in data[key]["reward_models"]:
            if model["path"] not in hashed:
                hashed[model["path"]] = hash_reward_model(model["path"], reporter)
            files = hashed[model["path"]]
            models.append({**model, "sha256": tree_sha256(files), "files": files})
        records.append(
            write_run_config(run, frozen_config(cfg, data[key], run.init_from), root, folder, data[key], models)
        )
    manifest = SuiteManifest(
        suite=spec.name,
        source_file=str(Path(suite_file).resolve()),
        code=code,
        placement=where,
        runs=records,
        decide=spec.decide.model_dump() if spec.decide is not None else None,
    )
    manifest.save(root)
    return manifest


def frozen_config(cfg: RunConfig, data: dict[str, Any], init_from: str | None) -> RunConfig:
    """The run's config reading the data snapshot's file copies, with an absolute start model and teacher (a hub
    id pinned to the commit its revision names now: every run of the suite loads the same one, however long the
    queue) and absolute reward model folders."""
    paths = {k.removeprefix("task."): v for k, v in data["task_paths"].items()}
    updates = {"task": cfg.task.model_copy(update={**paths, **cfg.task.absolute_reward_models()})}
    if cfg.model.path and init_from is None:
        model = {"path": absolute_model_spec(cfg.model.path)}
        if is_hub_id(cfg.model.path):
            model["revision"] = current_commit(cfg.model.path, cfg.model.revision)
        updates["model"] = cfg.model.model_copy(update=model)
    if cfg.teacher.path:  # on-policy distillation's teacher: the same one from every run's folder, pinned alike
        teacher = {"path": absolute_model_spec(cfg.teacher.path)}
        if is_hub_id(cfg.teacher.path):
            teacher["revision"] = current_commit(cfg.teacher.path, cfg.teacher.revision)
        updates["teacher"] = cfg.teacher.model_copy(update=teacher)
    return cfg.model_copy(update=updates)


def write_run_config(
    run: SuiteRun,
    cfg: RunConfig,
    root: Path,
    folder: Path,
    data: dict[str, Any],
    reward_models: list[dict[str, Any]] | None = None,
) -> RunRecord:
    """configs/NAME.json and the run's record: the config as it reads back, its SHA-256, its data snapshot,
    its reward models' folders and SHA-256s."""
    config = json.loads(json.dumps(cfg.model_dump(mode="json")))
    config_file = root / "configs" / f"{run.name}.json"
    config_file.parent.mkdir(exist_ok=True)
    write_file(config_file, json.dumps(config, indent=2))
    return RunRecord(
        name=run.name,
        run_dir=str(cfg.output_dir),
        config_file=str(config_file),
        config=config,
        config_sha256=config_sha256(config),
        init_from=run.init_from,
        factors=run.factors,
        arm=run.arm,
        round=run.round,
        world_size=run.devices_per_run or 1,
        data_sha256={k: data[f"{k}_sha256"] for k in ("train", "validation", "prompt")},
        data_dir=str(folder),
        data_files_sha256=data["files_sha256"],
        reward_models=reward_models or [],
    )


def decision_plan(spec: SuiteSpec, configs: dict[str, RunConfig], pilot: Path | None) -> list[str]:
    """A decision suite's plan (``grpolab.studies.planning``): the spread of one paired difference is the stated
    seed_sd, else the pilot's (its arms' seed spread, where it has two seeds of an arm), else 0.05, said."""
    from grpolab.studies.decision import Question
    from grpolab.studies.planning import pilot_accuracies, plan_lines

    decide = spec.decide
    arms = tuple(dict.fromkeys(run.arm for run in spec.runs))
    found = pilot_accuracies(pilot, arms) if pilot is not None else None
    lines, sd = [], decide.seed_sd
    if sd is None and found is not None and (spread := found.paired_spread()) is not None:
        sd, note = spread, f"the pilot's seed spread, {spread:.3f}"
    elif sd is None:
        sd, note = 0.05, "0.05, assumed (no seed_sd, no pilot with two seeds of an arm)"
    else:
        note = "the stated seed_sd"
        spread = found.paired_spread() if found is not None else None
        if spread is not None and spread > sd:
            note += (
                f"; the pilot's seeds spread more ({spread:.3f}): the normal sequence's guarantee needs a "
                f"seed_sd of at least that"
            )
    lines.append(f"\none paired difference's spread: {note}")
    question = Question.of(arms, decide.model_dump())
    steps = max(cfg.steps for cfg in configs.values())
    means = found.means() if found is not None else None
    return lines + plan_lines(question, len(decide.seeds), sd, means, steps)


def print_plan(
    spec: SuiteSpec, configs: dict[str, RunConfig], root: Path, console: Console, where: dict[str, Any]
) -> None:
    """Where the runs go; each run's command, resolved config and checkpoint footprint; the suite's total."""
    from grpolab.studies.suite.footprint import checkpoint_bytes

    total = 0
    console.print(
        f"suite {spec.name}: {len(configs)} runs into {root} (dry run: nothing written)",
        highlight=False,
        soft_wrap=True,
    )
    suite_launcher(where).print_placement(console)
    for run in spec.runs:
        cfg = configs[run.name]
        size = checkpoint_bytes(cfg, configs)
        total += size or 0
        command = train_command(root / "configs" / f"{run.name}.json", run.devices_per_run or 1)
        console.print(f"\n[bold]{run.name}[/]: {' '.join(command)}", highlight=False, soft_wrap=True)
        console.print(json.dumps(cfg.model_dump(mode="json"), sort_keys=True), highlight=False, soft_wrap=True)
        console.print(
            f"checkpoints: {cfg.steps // cfg.checkpoint.every + (cfg.steps % cfg.checkpoint.every != 0)}, "
            f"about {size / 1e6:.1f} MB"
            if size is not None
            else "checkpoints: size unknown",
            highlight=False,
        )
    console.print(f"\nexpected checkpoint footprint: about {total / 1e6:.1f} MB", highlight=False)
