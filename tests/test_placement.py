"""Placing runs on devices: disjoint sets, the file's order, init_from waits, one-line errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from grpolab.commands.cli import main
from grpolab.studies.suite.placement import DevicePool, next_to_start, parse_devices
from grpolab.studies.suite.spec import load_suite


@dataclass
class Run:
    name: str
    world_size: int = 1
    init_from: str | None = None


def test_devices_parse_from_text_or_a_list_and_refuse_repeats_or_blanks():
    assert parse_devices("0, 1,2,3") == ["0", "1", "2", "3"] and parse_devices([4, 5]) == ["4", "5"]
    for bad, why in (("0,0", "0 listed more than once"), ("", "comma-separated"), ("0,,1", "comma-separated")):
        with pytest.raises(ValueError, match=why):
            parse_devices(bad)


def test_a_pool_hands_out_disjoint_sets_in_the_lists_order_and_takes_them_back():
    pool = DevicePool(["0", "1", "2", "3"])
    assert pool.take("a", 2) == ["0", "1"] and pool.take("b", 1) == ["2"]
    assert pool.take("c", 2) is None and pool.free() == ["3"]
    pool.release("a")
    assert pool.take("c", 2) == ["0", "1"] and pool.free() == ["3"]
    pool.hold("orphan", ["3", "9"])  # a device no longer listed is ignored
    assert pool.free() == [] and pool.holder == {"0": "c", "1": "c", "2": "b", "3": "orphan"}


def test_runs_start_in_the_files_order_a_wide_run_blocks_the_rest_and_init_from_waits_for_its_source():
    a, wide, b, warm = Run("a"), Run("wide", 2), Run("b"), Run("warm", init_from="a")
    free = {"n": 1}

    def fits(run):
        return run.world_size <= free["n"]

    assert next_to_start([wide, b], set(), fits) is None  # b does not jump ahead of the wide run
    assert next_to_start([warm, b], set(), fits) is b  # warm waits for a; b goes on
    assert next_to_start([warm, b], {"a"}, fits) is warm
    free["n"] = 2
    assert next_to_start([a, wide], set(), fits) is a


def test_devices_per_run_of_base_is_each_runs_default(tmp_path):
    path = tmp_path / "suite.toml"
    path.write_text(
        '[suite]\ndevices = "0,1"\n[base]\nsteps = 3\ndevices_per_run = 2\n'
        '[[runs]]\nname = "a"\nalgo = "grpo"\n[[runs]]\nname = "b"\nalgo = "grpo"\ndevices_per_run = 1\n'
    )
    spec = load_suite(path)
    assert [run.devices_per_run for run in spec.runs] == [2, 1] and "devices_per_run" not in spec.base
    assert spec.suite.devices == "0,1" and spec.suite.launcher == "local"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--devices", "0"], "error: run wide needs 2 devices; only 1 are listed (0)"),
        (["--devices", "0,1,0"], "error: devices '0,1,0': 0 listed more than once"),
        (["--launcher", "slurm", "--devices", "0,1"], "error: devices are placed by Slurm with the slurm launcher"),
    ],
)
def test_a_placement_that_cannot_work_is_one_error_line_before_anything_is_written(args, expected, tmp_path, capsys):
    path = tmp_path / "suite.toml"
    path.write_text('[base]\nsteps = 3\n[[runs]]\nname = "wide"\nalgo = "grpo"\ndevices_per_run = 2\n')
    assert main(["suite", "run", str(path), "--output-root", str(tmp_path / "out"), *args]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(expected), out
    assert not (tmp_path / "out").exists()


def test_a_dry_run_says_where_the_runs_go(tmp_path, capsys):
    path = tmp_path / "suite.toml"
    path.write_text('[slurm]\npartition = "gpu"\n[base]\nsteps = 3\n[[runs]]\nname = "a"\nalgo = "grpo"\n')
    assert (
        main(["suite", "run", str(path), "--output-root", str(tmp_path / "out"), "--dry-run", "--devices", "0,1"]) == 0
    )
    assert "placement: devices 0,1, as many runs at once as fit" in capsys.readouterr().out


def test_the_placement_names_the_launcher_the_runner_uses():
    """Each launcher a suite file may name is registered; the manifest's placement picks its object, which
    says whether the runner places runs on its own devices (local) or the launcher's scheduler does (Slurm)."""
    from typing import get_args

    from grpolab.studies.suite.launch import LAUNCHERS, LocalLauncher, SlurmLauncher, suite_launcher
    from grpolab.studies.suite.spec import SuiteSection

    assert set(get_args(SuiteSection.model_fields["launcher"].annotation)) == set(LAUNCHERS)
    alone = suite_launcher({})  # a manifest without a launcher: local, one run at a time
    assert isinstance(alone, LocalLauncher) and alone.devices is None
    assert alone.device_pool().free() == ["(one at a time)"]
    local = suite_launcher({"launcher": "local", "devices": ["0", "1"], "slurm": None})
    assert local.devices == ["0", "1"] and local.device_pool().free() == ["0", "1"]
    local.refuse_device_list()  # a device list is the local launcher's to place on
    slurm = suite_launcher({"launcher": "slurm", "devices": None, "slurm": {}})
    assert isinstance(slurm, SlurmLauncher) and slurm.devices is None and slurm.device_pool() is None
    with pytest.raises(ValueError, match="devices are placed by Slurm with the slurm launcher: leave out --devices$"):
        slurm.refuse_device_list()
