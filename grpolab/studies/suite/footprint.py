"""The expected disk footprint of a run's checkpoints, from its model's shapes (nothing is loaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpolab.config import RunConfig
from grpolab.models.hub import cached_folder, is_hub_id
from grpolab.models.settings import WarmStartSettings
from grpolab.models.tinymodel import settings_config

OPTIMIZER_BYTES = 8  # AdamW's two float32 moments per parameter


def parameter_count(cfg: RunConfig, configs: dict[str, RunConfig]) -> int | None:
    """Parameters of the run's model, built on the meta device; None when unknown (a like: model, a hub id
    not in the Hugging Face cache yet, or a start checkpoint that another run has not written yet and no run
    of ``configs`` explains)."""
    path = cfg.model.path
    if path is None:
        config = settings_config(WarmStartSettings(**cfg.model.warm_start))
    elif path.startswith("like:"):
        return None
    elif is_hub_id(path):
        folder = cached_folder(path, cfg.model.revision)
        if folder is None or not (folder / "config.json").is_file():
            return None
        config = AutoConfig.from_pretrained(folder)
    else:
        source = next((c for c in configs.values() if c.output_dir and path.startswith(c.output_dir + "/")), None)
        if source is not None:
            return parameter_count(source, configs)
        if not (Path(path) / "config.json").is_file():
            return None
        config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def checkpoint_bytes(cfg: RunConfig, configs: dict[str, RunConfig]) -> int | None:
    """All checkpoints of a run: weights in the storage dtype plus AdamW state, per checkpoint."""
    params = parameter_count(cfg, configs)
    if params is None:
        return None
    weight = 2 if cfg.model.dtype == "bfloat16" and cfg.optim.precision != "fp32_master" else 4
    count = cfg.steps // cfg.checkpoint.every + (cfg.steps % cfg.checkpoint.every != 0)
    return params * (weight + OPTIMIZER_BYTES) * count
