"""Provenance of a run: grpolab's git commit (dirty or not; none outside a checkout) and the CPU's model and
vector extensions, as the manifest records them for the report's "where and when" table."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from grpolab.common.provenance import code_commit, cpu_description, describe_cpu


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="needs git")
def test_the_commit_of_a_checkout_is_marked_dirty_when_a_tracked_file_changed(tmp_path):
    package = tmp_path / "repo" / "pkg"
    package.mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    assert code_commit(package) is None  # not a git checkout (yet): an installed copy, a suite's snapshot
    repo = tmp_path / "repo"
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git(repo, "rev-parse", "--short=12", "HEAD").strip()
    assert code_commit(package) == head
    (package / "untracked.py").write_text("y = 2\n")
    assert code_commit(package) == head  # untracked files do not change what ran
    (package / "a.py").write_text("x = 2\n")
    assert code_commit(package) == head + "+dirty"


def test_the_cpu_is_its_model_and_the_vector_extensions_that_change_speed_and_rounding(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    )
    cpu = cpu_description(cpuinfo)
    assert cpu == {"model": "AMD EPYC 9R14", "isa": ["avx2", "avx512f", "avx512_bf16"]}
    assert describe_cpu(cpu) == "AMD EPYC 9R14 (avx2, avx512f, avx512_bf16)"
    assert describe_cpu({"model": "Apple M2", "isa": []}) == "Apple M2"
    assert describe_cpu(None) == "-"
    assert cpu_description(tmp_path / "absent")["isa"] == []
