"""``grpolab download ID [ID ...] [--revision R] [--dataset]``: hub models (or datasets) into the Hugging Face
cache, for a machine that will train offline (``HF_HUB_OFFLINE=1``; copy the cache, or share ``HF_HOME``).

Each id's branch or tag is read from the hub again (a cached ``main`` is refreshed); offline, the cache alone
answers. Each id gets one line: its commit and its folder, or the one line saying why not.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from grpolab.common.progress import Reporter

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


def add_parser(sub: argparse._SubParsersAction) -> None:
    download = sub.add_parser(
        "download",
        help="fetch hub models (or datasets) into the Hugging Face cache for offline use; prints each commit and folder",
    )
    download.add_argument("ids", nargs="+", metavar="ID", help="a hub id, org/name")
    download.add_argument("--revision", help="a branch, tag or commit for every id (default main)")
    download.add_argument("--dataset", action="store_true", help="the ids are datasets, not models")


def run_download(args: argparse.Namespace, console: Console) -> int:
    """Each id into the cache, one line each; 2 when any failed (an id not of the form org/name: before any)."""
    from grpolab.models.hub import has_hub_id_form, resolve  # here: every other command's parser skips the hub client

    bad = [i for i in args.ids if not has_hub_id_form(i)]
    if bad:
        raise ValueError(f"not a hub id of the form org/name: {', '.join(bad)}")
    reporter, repo_type, failed = Reporter(console), "dataset" if args.dataset else "model", 0
    for repo_id in args.ids:
        try:
            snapshot = resolve(repo_id, args.revision, reporter, repo_type=repo_type, refresh=True)
        except (OSError, ValueError) as err:
            console.print(f"[red]error:[/red] {escape(str(err))}", highlight=False, soft_wrap=True)
            failed += 1
            continue
        files = sorted(
            str(p.relative_to(snapshot.folder)) for p in snapshot.folder.rglob("*") if p.name.endswith(DATA_SUFFIXES)
        )
        data = f"; data files: {', '.join(files[:8])}{' ...' if len(files) > 8 else ''}" if args.dataset else ""
        console.print(
            f"download: {repo_type} {repo_id} ({snapshot.revision}) commit {snapshot.commit} -> {snapshot.folder}{data}",
            highlight=False,
            soft_wrap=True,
        )
    return 2 if failed else 0
