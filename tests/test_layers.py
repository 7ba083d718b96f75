"""The package's layers, enforced: import-linter's contracts in pyproject.toml (docs/architecture.md).

The contracts hold for the code as it is, and break, naming the import, when a lower folder imports a
higher one or two files of a folder import each other (checked on a copy of the package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import grpolab

pytest.importorskip("importlinter", reason="the contracts run import-linter, a test tool: pip install 'grpolab[test]'")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(grpolab.__file__).resolve().parent


def lint_imports(source_root: Path) -> subprocess.CompletedProcess:
    """import-linter's command on the package found under ``source_root``, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", script, "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=source_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_folder_imports_only_the_layers_below_it_and_no_files_import_each_other():
    out = lint_imports(PACKAGE.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


@pytest.fixture
def package_copy(tmp_path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "grpolab", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("objectives/losses.py", "grpolab.run.trainer"),  # math importing the run around it
        ("rollout/collect.py", "grpolab.learning.learner"),  # rollout importing the learning above it
        ("models/loading.py", "grpolab.config"),  # models importing the config that reads them
        ("rollout/engines.py", "grpolab.config"),  # an engine reading the assembled config, not its protocol
    ],
)
def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(package_copy, importer, imported):
    _append(package_copy / "grpolab" / importer, f"import {imported}  # noqa")
    out = lint_imports(package_copy)
    assert out.returncode == 1
    module = "grpolab." + importer.removesuffix(".py").replace("/", ".")
    assert f"{module} -> {imported}" in out.stdout


def test_two_files_of_a_folder_importing_each_other_break_the_contract(package_copy):
    # learner imports update; update importing learner back (even inside a function) is a cycle
    _append(package_copy / "grpolab/learning/update.py", "def _late():\n    import grpolab.learning.learner  # noqa")
    out = lint_imports(package_copy)
    assert out.returncode == 1
    assert "No cycles are allowed in grpolab.learning" in out.stdout
