"""Where a run ran and on what code, for its manifest and its report: the git commit of grpolab's checkout and
the CPU's model and vector extensions (a figure without them cannot be compared with another)."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

from grpolab.common.version import PACKAGE_DIR

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what changes this project's CPU speed and rounding
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # either one: the CPU multiplies bf16 natively


def code_commit(source: Path | None = None) -> str | None:
    """The commit (12 hex digits) of the git checkout holding ``source`` (default: grpolab's own folder),
    with ``+dirty`` when tracked files differ from it; None outside a git checkout (an installed wheel, a
    suite's snapshot of the code) or without git."""
    folder = str(source or PACKAGE_DIR)

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None

    head = git("rev-parse", "--short=12", "HEAD")
    if head is None or head.returncode != 0:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = status is not None and status.returncode == 0 and status.stdout.strip() != ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """{"model": the CPU's model name, "isa": the ``ISA_FLAGS`` it has, "native_bf16": ``native_bf16``}; from
    /proc/cpuinfo on Linux, else what ``platform`` knows (no flags)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        isa: list[str] = []
        return {
            "model": platform.processor() or platform.machine() or None,
            "isa": isa,
            "native_bf16": native_bf16(isa),
        }
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in text.split("\n\n", 1)[0].splitlines())
    )
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ISA_FLAGS if f in flags]
    return {
        "model": fields.get("model name") or platform.machine() or None,
        "isa": isa,
        "native_bf16": native_bf16(isa),
    }


@functools.cache
def _this_cpu_isa() -> list[str]:
    return list(cpu_description()["isa"])  # type: ignore[arg-type]


def native_bf16(isa: list[str] | None = None) -> bool:
    """Whether this CPU computes in bf16 natively: it has AVX512-BF16 or AMX-BF16 (``isa``: its ``ISA_FLAGS``,
    default read from /proc/cpuinfo) and torch's oneDNN runs bf16 on it. Without them bf16 matmuls are
    emulated, slower than float32."""
    if isa is None:
        isa = _this_cpu_isa()
    if not any(flag in isa for flag in BF16_FLAGS):
        return False
    import torch

    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def describe_cpu(cpu: dict[str, object] | None) -> str:
    """'AMD EPYC (avx2, avx512f, avx512_bf16)', or '-' when unknown."""
    if not cpu or not cpu.get("model"):
        return "-"
    isa = cpu.get("isa") or []
    return f"{cpu['model']} ({', '.join(isa)})" if isa else str(cpu["model"])
