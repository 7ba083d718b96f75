"""Provenance of a run: grpolab's git commit (dirty or not; none outside a checkout) and the CPU's model and
vector extensions, as the manifest records them for the report's "where and when" table."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from grpolab.common.provenance import code_commit, cpu_description, describe_cpu, native_bf16


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
    onednn_bf16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu == {"model": "AMD EPYC 9R14", "isa": ["avx2", "avx512f", "avx512_bf16"], "native_bf16": onednn_bf16}
    assert describe_cpu(cpu) == "AMD EPYC 9R14 (avx2, avx512f, avx512_bf16)"
    assert describe_cpu({"model": "Apple M2", "isa": []}) == "Apple M2"
    assert describe_cpu(None) == "-"
    assert cpu_description(tmp_path / "absent")["isa"] == []


def test_native_bf16_needs_the_cpus_bf16_instructions(tmp_path):
    """AVX-512 alone is not native bf16 (oneDNN emulates it, slower than float32), even where torch's own check
    passes; AVX512-BF16 or AMX-BF16 is."""
    onednn_bf16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert native_bf16(["avx2", "avx512f"]) is False
    assert native_bf16([]) is False
    assert native_bf16(["avx2", "amx_bf16"]) == native_bf16(["avx512_bf16"]) == onednn_bf16
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_description(cpuinfo)["native_bf16"] is False
    assert cpu_description(tmp_path / "absent")["native_bf16"] is False


def test_auto_dtype_on_a_cpu_is_bf16_only_when_switched_on_and_native(monkeypatch):
    from grpolab.models import loading

    cpu = torch.device("cpu")
    assert loading.CPU_BF16_BY_DEFAULT is False  # off until learning parity is measured
    assert loading.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(loading, "CPU_BF16_BY_DEFAULT", True)
    assert loading.resolve_dtype("auto", cpu) == (torch.bfloat16 if native_bf16() else torch.float32)
    monkeypatch.setattr(loading, "native_bf16", lambda: False)  # a CPU without bf16 instructions
    assert loading.resolve_dtype("auto", cpu) == torch.float32
    assert loading.resolve_dtype("bfloat16", cpu) == torch.bfloat16  # an explicit dtype is taken as given
