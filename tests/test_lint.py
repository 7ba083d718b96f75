"""The code's style, enforced: ruff's linter and formatter with the project's settings (``[tool.ruff]`` in
pyproject.toml) find nothing to change in the package, the tests and the benchmarks, and they do fail, naming
the file, on a planted unused import and a badly formatted line (checked on a copy)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff", reason="the style checks run ruff, a test tool: pip install 'grpolab[test]'")

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("grpolab", "tests", "benchmarks")


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--config", str(ROOT / "pyproject.toml")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_linter_finds_nothing():
    out = ruff("check", *CHECKED)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_formatter_would_change_nothing():
    out = ruff("format", "--check", *CHECKED)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("planted, command", [("import os\n", "check"), ("x = [1,2 ,3]\n", "format")])
def test_a_planted_violation_is_named(planted, command, tmp_path):
    copy = tmp_path / "grpolab"
    shutil.copytree(ROOT / "grpolab", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "common" / "planted.py").write_text('"""A planted violation."""\n\n' + planted)
    out = ruff(command, *(["--check"] if command == "format" else []), "grpolab", cwd=tmp_path)
    assert out.returncode == 1 and "planted.py" in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_docs_hold_no_figure_waiting_to_be_measured():
    """A stale figure is marked MEASURE(...) until it is re-measured; none may land in the docs."""
    root = Path(__file__).resolve().parents[1]
    marked = [
        str(p.relative_to(root))
        for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        if "MEASURE" in p.read_text()
    ]
    assert marked == []
