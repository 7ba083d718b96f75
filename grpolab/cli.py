"""The `grpolab` command: thin argument parsing that hands off to one module per sub-command."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from grpolab.algorithms import PRESETS


def print_algorithms(console: Console) -> None:
    """Every preset: its settings on one line, its formula on the next."""
    console.print("[bold]grpolab algorithms[/bold]  (any field can be overridden; docs/algorithms.md has the details)\n")
    for spec in PRESETS.values():
        weight = spec.weight if spec.weight in ("none", "noclip") else f"{spec.weight}({spec.eps_low:g}, {spec.eps_high:g})"
        schedule = f"{spec.epochs}x{spec.steps_per_epoch} (epochs x steps)"
        extra = ", dynamic sampling" if spec.dynamic_sampling else ""
        console.print(f"[bold cyan]{spec.name:<17}[/] advantage={spec.baseline}/{spec.normalizer} weight={weight} "
                      f"aggregation={spec.aggregation} schedule={schedule}{extra}", highlight=False, soft_wrap=True)
        console.print(f"{'':<18}loss = {spec.formula()}", highlight=False, soft_wrap=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpolab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("algorithms", help="list every algorithm preset with its settings and formula")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "algorithms":
        print_algorithms(console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
