"""grpolab: online RL post-training (GRPO and its family) of language models on tasks with verifiable rewards.

From Python (docs/python.md)::

    import grpolab

    result = grpolab.train(model="HuggingFaceTB/SmolLM2-135M-Instruct", dataset=rows, rewards=[my_reward], steps=20)
    result.final["val/accuracy"], result.run_dir
    grpolab.resume(result.run_dir, steps=40)

``train`` takes the settings of the TOML files (a file, a dict, a ``RunConfig`` or keyword arguments), reward
functions as Python callables, rows as a list of dicts or a ``datasets.Dataset`` and a model as a hub id, a
folder or a loaded transformers model. The names below load on first use, so ``import grpolab`` (and the
``grpolab`` command's help) imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from grpolab.common.version import VERSION as __version__

_EXPORTS = {
    "train": "grpolab.commands.api",
    "resume": "grpolab.commands.api",
    "Result": "grpolab.commands.api",
    "RunConfig": "grpolab.config",
    "ConfigError": "grpolab.config",
    "load_config": "grpolab.config",
}
__all__ = ["ConfigError", "Result", "RunConfig", "__version__", "load_config", "resume", "train"]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them on first use
    from grpolab.commands.api import Result, resume, train
    from grpolab.config import ConfigError, RunConfig, load_config


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpolab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
