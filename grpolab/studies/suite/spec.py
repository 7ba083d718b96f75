"""A suite file: shared settings plus a list of runs (preset, seed, overrides, optional init_from).

    [suite]
    name = "demo_all"
    devices = "0,1,2,3"    # optional: runs placed on these devices, as many at once as fit
    launcher = "local"     # or "slurm": one batch job per run, asking for what [slurm] says
    [slurm]
    partition = "gpu"
    time = "04:00:00"
    [base]                 # any run config field, by section, as in a run's TOML
    steps = 40
    devices_per_run = 1    # a suite setting (also per run): more than 1 runs under torchrun
    [base.eval]
    every = 10
    [[runs]]
    name = "grpo"
    algo = "grpo"
    seed = 0
    overrides = { "optim.lr" = 3e-4 }
    [[runs]]
    name = "maxrl_restart"
    algo = "maxrl"
    init_from = "grpo"     # start from that run's final checkpoint: fresh optimizer, this run's seed
    factors = { normalizer = "std", aggregation = "sequence" }   # optional: a factorial design's cell

Runs that declare the same two factors with two levels each give the report a 2x2 interaction.

With a ``[decide]`` section the suite decides as it goes (``grpolab.studies.decision``): each ``[[runs]]`` entry
is an arm (no ``seed``, no ``init_from``), run at each of ``seeds`` in rounds (round r: seed r of every arm still
in play, named ARM.sSEED); after each round every arm's confidence sequence is updated and the arms it decides
get no further seed::

    [decide]
    baseline = "grpo"      # or leave it out: find the best
    delta = 0.05           # the smallest accuracy difference that matters
    alpha = 0.05           # the family-wise error rate, at every round at once
    seeds = [0, 1, 2, 3]   # the budget: at most this many seeds per arm
    sequence = "normal"    # or "betting" (no assumption but the bounds; needs many seeds)
    seed_sd = 0.15         # normal: the stated spread of one seed's paired accuracy difference
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from grpolab.config import ConfigError, RunConfig, apply_override, validate_config


class SuiteRun(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        max_length=200,
        description="names the run's folder, config, log and job files: at most 200 characters, so "
        "that each fits a file name (255 bytes) with its suffix",
    )
    algo: str
    seed: int = 0
    devices_per_run: int | None = Field(
        None,
        ge=1,
        description="devices of this run (default: [base]'s, else 1); "
        "more than one: the run is started under torchrun, one process each",
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted config fields")
    init_from: str | None = Field(
        None, description="an earlier run of this suite whose final checkpoint starts this one"
    )
    factors: dict[str, str] = Field(default_factory=dict, description="factor -> level, for the report's 2x2")
    arm: str | None = Field(None, description="set by [decide]: the arm this run is a seed of")
    round: int | None = Field(None, description="set by [decide]: the round (the index of its seed)")


class DecideSection(BaseModel):
    """A suite that decides as it goes (the module docstring): the question, its error rate and its budget."""

    model_config = ConfigDict(extra="forbid")

    baseline: str | None = Field(None, description="the arm the others are compared with; none: find the best")
    delta: float = Field(gt=0, lt=1, description="the smallest accuracy difference that matters")
    alpha: float = Field(0.05, gt=0, lt=1, description="family-wise error rate, at every round at once")
    seeds: list[int] = Field([0, 1, 2, 3], min_length=1, description="each arm's seeds, one per round: the budget")
    sequence: Literal["betting", "normal"] = "betting"
    seed_sd: float | None = Field(
        None, gt=0, le=2, description="normal: the stated sd of one seed's paired accuracy difference"
    )

    @model_validator(mode="after")
    def _consistent(self) -> DecideSection:
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("decide.seeds lists a seed twice")
        if (self.sequence == "normal") != (self.seed_sd is not None):
            raise ValueError("decide.seed_sd is the normal sequence's stated spread: set both or neither")
        return self


class SuiteSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "suite"
    devices: str | list[int | str] | None = Field(
        None, description="devices to place runs on, such as '0,1,2,3' (the command line's --devices wins)"
    )
    launcher: Literal["local", "slurm"] = "local"


class SlurmSettings(BaseModel):
    """What each run's batch job asks Slurm for (the command line's --partition, --time, --account win)."""

    model_config = ConfigDict(extra="forbid")

    partition: str | None = None
    time: str | None = Field(None, description="a job's time limit, in sbatch's format (such as 04:00:00)")
    account: str | None = None
    qos: str | None = None
    mem: str | None = Field(None, description="memory per job, in sbatch's format (such as 64G)")
    cpus_per_run: int | None = Field(None, ge=1)
    gpus_per_device: int = Field(1, ge=0, description="GPUs asked per device of the run; 0 on a CPU cluster")
    extra: list[str] = Field(default_factory=list, description="more sbatch options, verbatim")


class SuiteSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    suite: SuiteSection = Field(default_factory=SuiteSection)
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)
    base: dict[str, Any] = Field(default_factory=dict)
    decide: DecideSection | None = None
    runs: list[SuiteRun] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _devices_per_run_of_base(cls, data: Any) -> Any:
        """``[base] devices_per_run`` is a suite setting, not a run config field: it becomes each run's default."""
        if isinstance(data, dict) and isinstance(data.get("base"), dict) and "devices_per_run" in data["base"]:
            base = dict(data["base"])
            default = base.pop("devices_per_run")
            runs = [
                run if not isinstance(run, dict) or "devices_per_run" in run else {**run, "devices_per_run": default}
                for run in data.get("runs", [])
            ]
            data = {**data, "base": base, "runs": runs}
        return data

    @model_validator(mode="after")
    def _rounds(self) -> SuiteSpec:
        """With [decide]: every arm once per seed, round by round (refusals first, one line each)."""
        if any(run.arm is not None or run.round is not None for run in self.runs):
            raise ValueError("arm and round are set by [decide], not in [[runs]]")
        if self.decide is None:
            return self
        arms = [run.name for run in self.runs]
        for run in self.runs:
            if "seed" in run.model_fields_set or run.init_from is not None:
                raise ValueError(f"run {run.name!r}: with [decide] each run is an arm: its seeds are decide.seeds")
        if self.decide.baseline is not None and self.decide.baseline not in arms:
            raise ValueError(f"decide.baseline {self.decide.baseline!r} is not one of the runs ({', '.join(arms)})")
        if len(arms) < 2:
            raise ValueError("[decide] needs at least two arms")
        self.runs = [
            run.model_copy(update={"name": f"{run.name}.s{seed}", "seed": seed, "arm": run.name, "round": r})
            for r, seed in enumerate(self.decide.seeds)
            for run in self.runs
        ]
        return self

    @model_validator(mode="after")
    def _names(self) -> SuiteSpec:
        seen: set[str] = set()
        for run in self.runs:
            if run.name in seen:
                raise ValueError(f"run name {run.name!r} is used twice")
            if run.init_from is not None and run.init_from not in seen:
                raise ValueError(f"run {run.name!r}: init_from {run.init_from!r} is not an earlier run of the suite")
            seen.add(run.name)
        return self

    @property
    def name(self) -> str:
        return self.suite.name


def load_suite(path: str | Path) -> SuiteSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"suite file not found: {path}")
    try:
        return SuiteSpec.model_validate(tomllib.loads(path.read_text()))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    except ValidationError as err:
        raise ConfigError(
            "\n".join(f"{path}: {e['msg']} ({'.'.join(map(str, e['loc']))})" for e in err.errors())
        ) from None


def final_checkpoint(run_dir: Path, cfg: RunConfig) -> Path:
    """Where a run's last checkpoint goes: checkpoints/step_NNNNNN of its final step."""
    return run_dir / "checkpoints" / f"step_{cfg.steps:06d}"


def output_dir_problems(spec: SuiteSpec, root: Path) -> list[str]:
    """A suite places every run at ROOT/runs/NAME itself: an ``output_dir`` in [base] or in a run's overrides
    (two runs on one directory, or a user's directory moved aside) is refused, one line each."""
    problems = []
    if "output_dir" in spec.base:
        problems.append(f"base: output_dir is set by the suite (each run goes to {root / 'runs' / 'NAME'}); remove it")
    for run in spec.runs:
        if any(key.split(".")[0] == "output_dir" for key in run.overrides):
            problems.append(
                f"run {run.name}: output_dir is set by the suite ({root / 'runs' / run.name}); "
                "remove it from its overrides"
            )
    return problems


def shared_directory_problems(configs: dict[str, RunConfig]) -> list[str]:
    """Two runs of one suite must never share a run directory (a defence: names are unique already)."""
    owner: dict[str, str] = {}
    problems = []
    for name, cfg in configs.items():
        key = str(Path(cfg.output_dir or "").resolve())
        if key in owner:
            problems.append(f"run {name}: its run directory {key} is also run {owner[key]}'s")
        owner.setdefault(key, name)
    return problems


def resolve_runs(spec: SuiteSpec, root: Path) -> dict[str, RunConfig]:
    """Every run's validated config, by name (the settings its engine cannot run refused too, as the run
    itself would); problems are reported together, one line each."""
    from grpolab.rollout.engines import check_settings

    problems = output_dir_problems(spec, root)
    if problems:
        raise ConfigError("\n".join(problems))
    configs: dict[str, RunConfig] = {}
    for run in spec.runs:
        data = copy.deepcopy(spec.base)
        data["algorithm"] = {**data.get("algorithm", {}), "name": run.algo}
        data["seed"] = run.seed
        data["output_dir"] = str(root / "runs" / run.name)
        if run.init_from is not None and run.init_from in configs:
            source = configs[run.init_from]
            data.setdefault("model", {})["path"] = str(final_checkpoint(Path(source.output_dir), source))
            data["model"].pop("revision", None)  # a hub id's revision: the checkpoint is a local folder
        try:
            for dotted, value in run.overrides.items():
                apply_override(data, dotted, value)
            configs[run.name] = validate_config(data)
            check_settings(configs[run.name])
        except ConfigError as err:
            problems += [f"run {run.name}: {line}" for line in str(err).splitlines()]
    problems += shared_directory_problems(configs)
    if problems:
        raise ConfigError("\n".join(problems))
    return configs
