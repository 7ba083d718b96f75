"""The `grpolab` command: thin argument parsing that hands off to one module per sub-command.

``grpolab train --config run.toml --optim.lr 3e-4 --algo dapo`` sets any config field by its dotted
name; ``grpolab demo`` is ``train`` with the built-in defaults (tiny model, arithmetic task).
``grpolab train --help`` lists every field; ``grpolab config`` prints the resolved config as TOML.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from grpolab.commands.interrupts import Interrupts, stopping_on_signals
from grpolab.objectives.presets import PRESETS
from grpolab.objectives.surrogates import SURROGATES, get_surrogate
from grpolab.run.stop import RunStopped


def print_algorithms(console: Console) -> None:
    """Every preset: its settings on one line, its formula on the next; then every weight with its formula and the
    fields it reads (the registry of ``grpolab.objectives.surrogates``)."""
    console.print(
        "[bold]grpolab algorithms[/bold]  (any field can be overridden; docs/algorithms.md has the details)\n"
    )
    for spec in PRESETS.values():
        weight = spec.weight
        if get_surrogate(weight).reads_clip_range:
            weight += f"({spec.eps_low:g}, {spec.eps_high:g})"
        schedule = f"{spec.epochs}x{spec.steps_per_epoch} (epochs x steps)"
        extra = ", dynamic sampling" if spec.dynamic_sampling else ""
        extra += (
            ", each reward term normalized apart" if spec.multi_objective_aggregation == "normalize_then_sum" else ""
        )
        extra += f", group size {spec.group_size}" if spec.group_size is not None else ""
        if spec.needs_teacher:
            extra += f", teacher (teacher_kl_coef {spec.teacher_kl_coef:g}, reward_coef {spec.reward_coef:g})"
        console.print(
            f"[bold cyan]{spec.name:<17}[/] advantage={spec.baseline}/{spec.normalizer} weight={weight} "
            f"aggregation={spec.aggregation} schedule={schedule}{extra}",
            highlight=False,
            soft_wrap=True,
        )
        console.print(f"{'':<18}loss = {spec.formula()}", highlight=False, soft_wrap=True)
    console.print("\n[bold]weights[/bold]  (algorithm.weight; each reads the fields in brackets)\n")
    for s in SURROGATES.values():
        reads = f"  [{', '.join(s.reads)}]" if s.reads else ""
        console.print(
            f"  [bold cyan]{s.name:<8}[/] {escape(s.formula_line() + reads)}", highlight=False, soft_wrap=True
        )


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--a.b value`` / ``--a.b=value`` pairs -> {"a.b": parsed value}; dashes in names become underscores."""
    from grpolab.config import ConfigError, parse_value

    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --optim.lr 3e-4")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"--{name} needs a value")
            i += 1
            value = args[i]
        overrides[name.replace("-", "_")] = parse_value(value)
        i += 1
    return overrides


class _Parser(argparse.ArgumentParser):
    """A sub-command's parser; one that takes config fields (``lists_fields``) ends its help with every field,
    built only when the help is asked for."""

    lists_fields = False

    def format_help(self) -> str:
        if not self.lists_fields:
            return super().format_help()
        from grpolab.commands.fields import help_text

        return f"{super().format_help()}\n{help_text(max(60, min(120, shutil.get_terminal_size().columns)))}\n"


def _takes_fields(sub, name: str, what: str = "", **kwargs: Any) -> argparse.ArgumentParser:
    """A sub-command that reads a config: its help lists every field (``--dotted.name VALUE`` after its own
    options; ``what`` its positional arguments)."""
    usage = f"grpolab {name} {what + ' ' if what else ''}[options] [--dotted.name VALUE ...]"
    parser = sub.add_parser(name, usage=usage, **kwargs)
    parser.lists_fields = True
    return parser


def names_own_run(overrides: dict[str, Any]) -> bool:
    """Whether command-line overrides name a model or a task (``--model DIR`` or ``--model.path``, ``--task
    NAME`` or ``--task.name``): a run of its own, not the demo's tiny model on its addition task."""
    from grpolab.config import ALIASES

    return any(ALIASES.get(name, name) in ("model.path", "task.name") for name in overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpolab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser(
        "algorithms",
        help="list every algorithm preset with its settings and formula",
        description="Prints every algorithm preset (--algo NAME): its advantage (baseline / normalizer), "
        "per-token weight and clip range, aggregation and update schedule on one line, its loss formula on the "
        "next. Any of those settings can be overridden per run (--algorithm.eps_high 0.28; train --help lists "
        "them); docs/algorithms.md has the details.",
    )
    train = _takes_fields(
        sub,
        "train",
        help="train with a TOML config; --dotted.name value overrides any field",
        description="Train from --config FILE.toml, with any field overridden on the command line, or continue a "
        "run with --resume RUN_DIR. Without --config it needs a model or task of its own (--model DIR or --task "
        "NAME: every other field at its default); `grpolab demo` runs the built-in demo.",
    )
    train.add_argument("--config", metavar="FILE", help="TOML file (fields by section, e.g. [optim] lr = 1e-4)")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest complete checkpoint "
        "(exactly: weights, optimizer, RNGs, data position); --steps N may extend it, "
        "--threads and --log_every change no result and may change too",
    )
    _takes_fields(
        sub,
        "demo",
        help="train the built-in tiny model on the built-in task (CPU, minutes)",
        description="Warm-starts the built-in tiny model on the built-in addition task (once, cached), then "
        "trains it with GRPO; says first what it will do and how long each part should take. Any field below "
        "changes it (--algo dr_grpo --steps 40).",
    )
    config = _takes_fields(
        sub,
        "config",
        help="print the resolved config as TOML (what differs from the defaults; --all: every field)",
        description="Prints the config that --config FILE and the overrides resolve to, as TOML that "
        "`grpolab train --config` loads back: only what differs from the defaults, or every field with --all. "
        "Nothing is loaded or written.",
    )
    config.add_argument("--config", metavar="FILE", help="TOML file (or a run's config.json), as for train")
    config.add_argument("--all", action="store_true", help="every field, not only those that differ from defaults")
    probe = _takes_fields(sub, "probe", help="capacity check: two real updates at the config's worst-case shapes")
    probe.add_argument("--config", metavar="FILE", help="TOML file, as for train")
    probe.add_argument("--report", default="probe_report.json", help="where to write the JSON report (must not exist)")
    bench = _takes_fields(
        sub,
        "bench",
        "{rollout,step}",
        help="time every available rollout engine side by side: generation "
        "(rollout) or whole RL steps with the phase split (step)",
    )
    bench.add_argument("kind", choices=["rollout", "step"])
    bench.add_argument("--config", metavar="FILE", help="TOML file, as for train (default: the demo's settings)")
    bench.add_argument("--engines", help="comma-separated, e.g. hf,vllm (default: every available engine)")
    bench.add_argument("--repeats", type=int, default=3, help="timed generations / steps after one warm-up")
    bench.add_argument("--json", help="also write the figures to this JSON file (must not exist)")
    suite = sub.add_parser(
        "suite",
        help="a queue of runs, one process each, resumable: run SUITE.toml --output-root DIR | resume DIR | status DIR",
    )
    suite.add_argument("action", choices=["run", "resume", "status"])
    suite.add_argument("target", help="run: the suite TOML file; resume / status: the suite directory")
    suite.add_argument("--output-root", help="run: a new or empty directory for the suite")
    suite.add_argument(
        "--dry-run",
        action="store_true",
        help="run: print every resolved config, command and the expected checkpoint footprint (a [decide] suite: "
        "its plan, the seeds its question needs); write nothing",
    )
    suite.add_argument(
        "--run-dropped",
        metavar="ARM[,ARM]",
        help="resume of a [decide] suite: run these arms' dropped seeds anyway (their verdicts stay as recorded)",
    )
    suite.add_argument(
        "--pilot",
        help="run --dry-run of a [decide] suite: a folder of earlier runs of its arms (named ARM or ARM.sSEED, such "
        "as a suite's output root) whose final accuracies forecast the seeds and compute it will use",
    )
    suite.add_argument(
        "--devices",
        help="run / resume: place runs on these devices (such as 0,1,2,3), each on "
        "devices_per_run of them, as many at once as fit (default: one run at a time)",
    )
    suite.add_argument(
        "--launcher", choices=["local", "slurm"], help="run: local processes (default) or one Slurm batch job per run"
    )
    for option, what in (("partition", "partition"), ("time", "time limit, such as 04:00:00"), ("account", "account")):
        suite.add_argument(f"--{option}", help=f"run, with --launcher slurm: each job's {what}")
    report = sub.add_parser(
        "report",
        help="report.md, report.json and figures in DIR/report/ for a suite or run "
        "directory: run table, paired bootstrap CIs and McNemar tests, 2x2, seeds, pass@k, curves",
    )
    report.add_argument("directory", help="a suite directory, a run directory or a folder of run directories")
    compare = sub.add_parser(
        "compare",
        help="paired accuracy difference of two runs' last evaluations, with its bootstrap CI and McNemar p-value",
    )
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    export = sub.add_parser(
        "export",
        help="a LoRA checkpoint's adapter merged into its base: a Hugging Face model "
        "folder that transformers or vLLM loads without peft",
    )
    export.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N of a LoRA run")
    export.add_argument("out", help="a new or empty folder")
    from grpolab.commands.download import add_parser as add_download  # no torch: download loads no model

    add_download(sub)
    report.add_argument("--baseline", help="the run every other run is compared with (default: the first)")
    report.add_argument(
        "--runs",
        nargs="+",
        metavar="NAME",
        help="report only these runs (names or shell patterns such as 'grpo*'), into DIR/report-NAMES/",
    )
    for p in (report, compare):
        p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (at least 10,000)")
        p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return parser


def report_command(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from grpolab.common.progress import Reporter
    from grpolab.studies.report import compare_runs, write_report

    if args.resamples < 10_000:
        raise ValueError(f"--resamples {args.resamples}: use at least 10,000 for stable 95% intervals")
    if args.command == "report":
        path = write_report(
            Path(args.directory), Reporter(console), args.baseline, args.resamples, args.seed, args.runs
        )
        console.print(f"report: {path} (figures and report.json beside it)", highlight=False, soft_wrap=True)
        return 0
    c = compare_runs(Path(args.run_a), Path(args.run_b), args.resamples, args.seed)
    if "difference" not in c:
        raise ValueError(f"{args.run_a} vs {args.run_b}: {c.get('note')}")
    console.print(
        f"{c['run']} (step {c['step']}) vs {Path(args.run_b).name} (step {c['baseline_step']}), "
        f"{c['items']} paired items: accuracy {c['accuracy']:.3f} vs {c['baseline_accuracy']:.3f}, "
        f"difference {c['difference']:+.3f}, 95% CI [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] "
        f"(paired bootstrap, {args.resamples:,} resamples); McNemar exact p = {c['p_value']:.3g} "
        f"({c['only_run_right']} items right only in A, {c['only_baseline_right']} only in B)",
        highlight=False,
        soft_wrap=True,
    )
    if c["unpaired_items"] or c["differing_prompts"]:
        console.print(
            f"left out: {c['unpaired_items']} items evaluated by one run only, {c['differing_prompts']} "
            "with different prompts",
            highlight=False,
            soft_wrap=True,
        )
    return 0


def suite_command(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from grpolab.studies.suite.runner import SuiteRunner, prepare_suite, status_table

    if args.action == "status":
        console.print(status_table(Path(args.target)))
        return 0
    if args.action == "run":
        if not args.output_root:
            raise ValueError("suite run needs --output-root DIR (a new or empty directory)")
        slurm = {"partition": args.partition, "time": args.time, "account": args.account}
        placement = {"devices": args.devices, "launcher": args.launcher, "slurm": slurm}
        if args.pilot and not args.dry_run:
            raise ValueError("--pilot forecasts a decision suite's plan: use it with --dry-run")
        pilot = Path(args.pilot) if args.pilot else None
        if prepare_suite(args.target, Path(args.output_root), console, args.dry_run, placement, pilot) is None:
            return 0
        return SuiteRunner(Path(args.output_root).resolve(), console).execute()
    if args.launcher or args.partition or args.time or args.account:
        raise ValueError("suite resume keeps the suite's launcher and Slurm settings; only --devices may change")
    run_dropped = args.run_dropped.split(",") if args.run_dropped else None
    return SuiteRunner(Path(args.target).resolve(), console, args.devices, run_dropped).execute()


def bench_command(args: argparse.Namespace, cfg, console: Console) -> None:
    import json
    from pathlib import Path

    from grpolab.commands.bench import run_bench
    from grpolab.rollout.engines import ENGINES, engine_choices

    engines, skipped = (args.engines.split(","), None) if args.engines else engine_choices(cfg)
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or args.repeats < 1:
        raise ValueError(
            f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}"
            if unknown
            else "--repeats must be >= 1"
        )
    if args.json and Path(args.json).exists():
        raise FileExistsError(f"--json {args.json} already exists; not overwritten")
    results = run_bench(args.kind, cfg, engines, args.repeats, console, skipped)
    if args.json:
        figures = {
            "kind": args.kind,
            "config": cfg.model_dump(mode="json"),
            "results": results,
            "skipped": skipped or {},
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))


def run_command(args: argparse.Namespace, extra: list[str], console: Console) -> int:
    from pathlib import Path

    if args.command in ("suite", "report", "compare"):  # no model here: a report loads neither torch nor transformers
        if extra:
            raise ValueError(f"unexpected arguments {' '.join(extra)}")
        return suite_command(args, console) if args.command == "suite" else report_command(args, console)
    if args.command == "download":
        from grpolab.commands.download import run_download

        if extra:
            raise ValueError(f"unexpected arguments {' '.join(extra)}")
        return run_download(args, console)
    if args.command == "export":
        if extra:
            raise ValueError(f"unexpected arguments {' '.join(extra)}")
        from transformers.utils import logging as hf_logging

        from grpolab.models.lora import export_merged
        from grpolab.run.checkpoints import verify

        hf_logging.disable_progress_bar()
        verify(Path(args.checkpoint))  # before anything is loaded: one line for a damaged checkpoint
        from grpolab.common.progress import Reporter

        with Reporter(console).phase(f"export {args.checkpoint}"):  # loading and merging a large base takes a while
            done = export_merged(Path(args.checkpoint), Path(args.out))
        console.print(
            f"export: {done['checkpoint']} merged into its base {done['base']} -> {done['out']}",
            highlight=False,
            soft_wrap=True,
        )
        return 0
    from grpolab.config import ConfigError, load_config, load_run_config

    resume = getattr(args, "resume", None)
    if resume and args.config:
        raise ConfigError("--resume takes the run's own config; drop --config")
    overrides = parse_overrides(extra)
    if resume:  # a checkpoint folder, a run stopped before its config: one line saying what to give instead
        from grpolab.run.resume import check_target

        check_target(Path(resume))
    cfg = load_run_config(resume, overrides) if resume else load_config(getattr(args, "config", None), overrides)
    # bad values first (one line each), then a train that names no run of its own is refused
    if args.command == "train" and not resume and not args.config and not names_own_run(overrides):
        raise ConfigError(
            "train needs --config FILE.toml (or --resume RUN_DIR, or a model or task of its own: --model DIR, "
            "--task NAME); `grpolab demo` runs the built-in demo"
        )
    from grpolab.rollout.engines import check_settings

    check_settings(cfg)  # what the chosen engine cannot run: one line, before anything is written
    if args.command == "config":
        from grpolab.commands.fields import config_toml

        sys.stdout.write(config_toml(cfg, args.all))  # not through rich: [model] is not markup
        return 0
    from transformers.utils import logging as hf_logging  # here: reading and printing a config loads no model code

    hf_logging.disable_progress_bar()
    if args.command == "probe":
        from grpolab.commands.probe import run_probe
        from grpolab.common.progress import Reporter

        report = run_probe(cfg, Path(args.report), Reporter(console))
        console.print(
            f"probe: peak memory {report['peak_memory_mb']:.0f} MB ({report['peak_memory_kind']}), "
            f"{report['batch']['sequences']} x {report['batch']['sequence_length']} tokens; "
            f"report in {args.report}",
            highlight=False,
            soft_wrap=True,
        )
        return 0
    if args.command == "bench":
        bench_command(args, cfg, console)
        return 0
    from grpolab.run.trainer import train

    if args.command == "demo" and os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 says it
        from grpolab.commands.demo import print_demo_plan
        from grpolab.common.progress import Reporter

        print_demo_plan(cfg, Reporter(console))
    train(cfg, console, resume=bool(resume), stop=Interrupts.stop)
    return 0


def os_error_line(err: OSError) -> str:
    """An OSError as one line: the path(s) and what went wrong (disk full, read-only, a name too long, ...);
    one raised with a message of its own (no errno) keeps its message."""
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list) and err.args[0]:
        source, copy, why = err.args[0][0]  # a copy of a folder: each file that failed, with why
        more = len(err.args[0]) - 1
        why = re.sub(r"^\[Errno \d+\] ([^:]+).*", r"\1", str(why))
        return f"{copy}: {why} (copying {source}{f', and {more} more files' if more else ''})"
    if err.errno is None or not err.strerror:
        return str(err)
    paths = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    return f"{paths}: {err.strerror}" if paths else f"{err.strerror} (errno {err.errno})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    console = Console()
    if args.command == "algorithms":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        print_algorithms(console)
        return 0
    try:
        with stopping_on_signals():
            return run_command(args, extra, console)
    except RunStopped as stopped:
        console.print(f"[red]interrupted:[/red] {stopped}", highlight=False, soft_wrap=True)
        return 130
    except KeyboardInterrupt:
        console.print("[red]interrupted[/red]")
        return 130
    except Exception as err:
        if Interrupts.received:  # an engine process died of the same Ctrl-C
            console.print("[red]interrupted[/red]")
            return 130
        if not isinstance(err, (OSError, ValueError)):  # a refused setting imports no torch to say so
            from grpolab.objectives.losses import NonFiniteError  # here, so that report and compare never load torch
            from grpolab.rollout.engine_process import EngineDied
            from grpolab.rollout.failures import TooManyFailures
            from grpolab.rollout.sync_check import WeightSyncError

            if not isinstance(err, (NonFiniteError, WeightSyncError, EngineDied, TooManyFailures)):
                raise
        for line in (os_error_line(err) if isinstance(err, OSError) else str(err)).splitlines():
            console.print(f"[red]error:[/red] {escape(line)}", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
