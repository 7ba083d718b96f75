"""The suite's code snapshot holds only the package's own files: a link leading out of the package (a linked
folder, a link to a system file) is refused in one line naming it and its target, before anything is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from suite_runs import suite_file

import grpolab.studies.suite.snapshot as snapshot
from grpolab.commands.cli import main
from grpolab.studies.suite.snapshot import SnapshotLinkError, snapshot_code


def fake_package(tmp_path: Path) -> Path:
    package = tmp_path / "pkg" / "grpolab"
    (package / "run").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "run" / "trainer.py").write_text("STEPS = 3\n")
    return package


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_link_leading_out_of_the_package_is_refused_in_one_line(tmp_path, kind):
    package = fake_package(tmp_path)
    outside = tmp_path / "elsewhere"
    if kind == "folder":
        (outside / "secrets").mkdir(parents=True)
        (outside / "secrets" / "key.txt").write_text("not the package's")
        target, link = outside / "secrets", package / "run" / "linked"
    else:
        outside.mkdir()
        (outside / "hostname").write_text("a system file")
        target, link = outside / "hostname", package / "hostname.py"
    os.symlink(target, link)
    with pytest.raises(SnapshotLinkError) as refused:
        snapshot_code(tmp_path / "snap", source=package)
    message = str(refused.value)
    assert "\n" not in message and str(link) in message and str(target) in message, message
    assert not (tmp_path / "snap").exists()  # nothing copied


def test_a_link_inside_the_package_is_copied_as_what_it_points_at(tmp_path):
    package = fake_package(tmp_path)
    os.symlink(package / "run" / "trainer.py", package / "alias.py")
    code = snapshot_code(tmp_path / "snap", source=package)
    assert (tmp_path / "snap" / "grpolab" / "alias.py").read_text() == "STEPS = 3\n"
    assert set(code["files"]) == {"__init__.py", "alias.py", "run/trainer.py"}


def test_suite_run_refuses_before_writing_anything(warm_model_dir, tmp_path, monkeypatch, capsys):
    package = fake_package(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_bytes(b"not the package's")
    os.symlink(tmp_path / "data", package / "up")
    monkeypatch.setattr(snapshot, "PACKAGE_DIR", package)
    root = tmp_path / "out"
    assert main(["suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root)]) == 2
    out = capsys.readouterr().out
    assert out.count("error:") == 1 and str(package / "up") in "".join(out.split()), out
    assert not root.exists()
