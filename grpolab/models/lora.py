"""LoRA adapters on the policy (peft): injected in place, the reference for free, merged weights exact.

``add_adapter`` wraps the policy in peft's LoRA and hands back an ``Adapter``. The policy stays the same
Hugging Face model object (peft swaps its target linear layers for LoRA layers in place), so the
training forward, the hf engine and every check see one model with the adapter active. Only the
adapter's weights train; the base never changes, so:

* the frozen reference is the policy with its adapter switched off (``Adapter.disabled``), with no
  second copy of the weights;
* the merged weights an engine of its own loads (``MergedWeights``) are computed each time from the
  unmodified base, ``W + (alpha / r) B A`` in float32, never by merging into and unmerging from the
  training weights;
* an engine with LoRA of its own (vLLM's ``adapter`` sync) is handed only the adapter (``AdapterWeights``);
* a checkpoint holds the adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``),
  and ``export_merged`` writes a plain Hugging Face model from it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpolab.common.atomic import atomic_folder
from grpolab.common.extras import require
from grpolab.models.routing import routers
from grpolab.models.weights import PolicyWeights
from grpolab.parallel.fsdp import whole
from grpolab.tasks.folder_hash import model_sha256

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
BASE_RECORD = "base_model.json"  # beside the adapter: the base it was trained on, its folder and SHA-256
# what makes an adapter the policy it is, beyond its weights: peft's adapter_config.json fields
SETTINGS = (
    "r",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "target_modules",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "bias",
)


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_base(folder: Path) -> Path:
    """The base model folder a LoRA checkpoint's adapter was trained on."""
    return Path(json.loads((Path(folder) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


def _setting(value: Any) -> Any:
    """A peft setting as JSON holds it, lists (peft keeps target modules as a set) in sorted order."""
    if isinstance(value, (set, list, tuple)):
        return sorted(value) or None
    if isinstance(value, float) and value.is_integer():
        return int(value)  # alpha 32 and 32.0 are one scale
    return None if value in (None, False, {}, "") else value  # unset, off and empty read alike


def settings_mismatch(config: dict[str, Any], folder: Path) -> str | None:
    """The first of ``SETTINGS`` in which peft's adapter ``config`` (a ``to_dict()``, or adapter_config.json)
    differs from the adapter saved in ``folder``, as 'FIELD X (the checkpoint's: Y)'; None when all agree."""
    saved = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    for field in SETTINGS:
        ours, theirs = _setting(config.get(field)), _setting(saved.get(field))
        if ours != theirs:
            return f"{field} {ours} (the checkpoint's: {theirs})"
    return None


def base_mismatch(folder: Path, base_sha256: str | None = None) -> str | None:
    """Why the base model a LoRA checkpoint in ``folder`` names is not the one its adapter was trained on
    (its SHA-256, ``base_sha256`` when known, against the one the checkpoint recorded); None when it is, or
    when the checkpoint recorded none (written before the record existed)."""
    record_path = Path(folder) / BASE_RECORD
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    base = adapter_base(folder)
    if not (base / "config.json").is_file():
        return f"its base model {base} is not a model folder any more"
    found = base_sha256 or model_sha256(base)
    if found != record["sha256"]:
        return (
            f"its base model {base} changed since the adapter was trained on it (SHA-256 {found[:12]}, "
            f"recorded {record['sha256'][:12]})"
        )
    return None


def linear_module_names(model: nn.Module) -> list[str]:
    """The leaf names of ``model``'s linear layers that LoRA may target (the output layer excluded)."""
    head = model.get_output_embeddings()
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    )


def _target_modules(model: nn.Module, targets: list[str] | str) -> list[str] | str:
    """``targets`` checked against the model's linear layers: one line naming the ones it has."""
    if targets == "all-linear":
        return targets
    names = linear_module_names(model)
    unknown = [t for t in targets if t not in names and t != "lm_head"]
    if unknown:
        moe = (
            (
                " (a Mixture-of-Experts model's experts are fused 3-D parameters and its routers plain weights, "
                'not linear layers: target_modules = "all-linear" adapts them too, peft wrapping the parameters)'
            )
            if routers(model)
            else ""
        )
        raise ValueError(
            f"model.lora.target_modules: {', '.join(unknown)} not a linear layer of "
            f"{type(model).__name__}; its linear layers: {', '.join(names)}{moe}"
        )
    return list(targets)


def trains_tied_head(model: nn.Module) -> bool:
    """``model``'s config ties its output layer to its input embedding, yet LoRA trains the output layer in full
    beside the adapter (``modules_to_save = ["lm_head"]``: peft's trainable copy of it): the policy's head is
    then no longer its embedding, and what serves the policy must hold the two apart."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return False
    from peft.utils import ModulesToSaveWrapper

    return isinstance(model.get_output_embeddings(), ModulesToSaveWrapper)


class Adapter:
    """The policy's LoRA adapter: peft's model around the policy, and what the run does with it."""

    def __init__(self, peft_model, base_dir: Path | None = None):
        self.peft_model = peft_model
        self.base_dir = base_dir
        self._base_sha256: str | None = None

    @property
    def base_sha256(self) -> str:
        """SHA-256 of the base model's folder (``grpolab.tasks.folder_hash.model_sha256``), computed once."""
        if self._base_sha256 is None:
            self._base_sha256 = model_sha256(Path(self.base_dir))
        return self._base_sha256

    def save_pretrained(self, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """peft's files of the adapter and ``base_model.json``: the base it adapts, by folder and SHA-256 (a
        load verifies it: an adapter applied to another base is another policy)."""
        self.peft_model.save_pretrained(folder, state_dict=state_dict)
        (Path(folder) / BASE_RECORD).write_text(json.dumps({"path": str(self.base_dir), "sha256": self.base_sha256}))

    @property
    def model(self) -> nn.Module:
        """The policy: the Hugging Face model, its target layers now LoRA layers."""
        return self.peft_model.get_base_model()

    def disabled(self) -> contextlib.AbstractContextManager:
        """Within it, the policy computes as the base model (the frozen start policy)."""
        return self.peft_model.disable_adapter()

    def peft_state(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The policy's ``weights`` (e.g. gathered from its shards) keyed as peft's model names its own, the
        ``state_dict`` its ``save_pretrained`` takes."""
        return {f"base_model.model.{name}": tensor for name, tensor in weights.items()}

    def load(self, folder: Path) -> None:
        """The adapter weights of a checkpoint folder, into this adapter; refused in one line unless the
        checkpoint's settings are this adapter's (rank, alpha, rsLoRA, DoRA, targets, saved modules) and its
        base is the one this adapter's weights came from."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        mismatch = settings_mismatch(self.peft_model.peft_config["default"].to_dict(), folder)
        if mismatch:
            raise ValueError(
                f"{folder}: a LoRA checkpoint loads only with its own settings, and [model.lora] gives {mismatch}"
            )
        mismatch = base_mismatch(folder, self.base_sha256)
        if mismatch:
            raise ValueError(f"{folder}: {mismatch}; not loaded")
        result = set_peft_model_state_dict(self.peft_model, load_file(Path(folder) / ADAPTER_WEIGHTS))
        missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{folder}: the adapter does not fit model.lora's settings (missing "
                f"{missing[:3]}, unexpected {result.unexpected_keys[:3]})"
            )


def add_adapter(model: nn.Module, settings, seed: int, base_dir: Path) -> Adapter:
    """Inject LoRA (``settings``: a ``LoraSettings``) into ``model`` in place, its initial A seeded from
    ``seed`` (B starts at zero: the policy starts as the base). Returns the adapter."""
    require("model.lora", "peft")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
        lora_dropout=settings.dropout,
        target_modules=_target_modules(model, settings.target_modules),
        modules_to_save=settings.modules_to_save or None,
        bias="none",
        base_model_name_or_path=str(base_dir),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    return Adapter(peft_model, Path(base_dir))


def lora_delta(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What LoRA ``layer`` adds to the weight it adapts, from its factors A ``a`` [r', in] and B ``b`` [out, r']
    (float32 in, float32 out), as peft's ``get_delta_weight`` computes it: (alpha / r) B A, transposed where the
    layer stores its weight fan-in first; for a wrapper of fused experts' [E, ...] parameter, the factors hold
    E blocks of rank r and the delta is each expert's B_e A_e, laid out as the parameter is."""
    scale, experts = layer.scaling["default"], getattr(layer, "num_experts", 1)
    if experts == 1:
        delta = (b @ a) * scale
        return delta.T if getattr(layer, "fan_in_fan_out", False) else delta
    a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
    pattern = "ore,eri->eoi" if layer._did_swap_in_out_features else "ore,eri->eio"
    return torch.einsum(pattern, b, a) * scale


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> LoRA layer (one with ``lora_A``/``lora_B`` and a ``base_layer``)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


class MergedWeights(PolicyWeights):
    """The policy's weights as a plain model has them (kind ``merged``: its parameter names, base + scaled
    adapter product ``(alpha / r) B A``, each computed in float32 from the unmodified base and cast to the
    base's dtype), seen the way an engine's weight sync reads a model: ``named_parameters()`` (tied weights
    once) and ``parameters()``; ``model``: the model they are of. A sharded policy's weights are gathered whole
    first: every rank builds it."""

    kind = "merged"

    def __init__(self, model: nn.Module, version: int = 0):
        self.model, self.version = model, version
        layers = _lora_layers(model)
        with torch.no_grad():
            params = {name: whole(p).detach() for name, p in model.named_parameters()}
        factors = {owner: tuple(params[f"{owner}.lora_{ab}.default.weight"].float() for ab in "AB") for owner in layers}

        def plain(name: str) -> str:
            return re.sub(r"(\.base_layer)+\.", ".", name).replace(".modules_to_save.default.", ".")

        # peft's wrappers of a parameter (an MoE's fused experts, its routers): the plain name of what they wrap
        wrapped = {
            plain(f"{owner}.{layer.parameter_name}"): owner
            for owner, layer in layers.items()
            if hasattr(layer, "parameter_name")
        }
        weights: dict[str, torch.Tensor] = {}
        for name, param in params.items():
            if ".lora_" in name or ".original_module." in name:
                continue
            owner = wrapped.get(plain(name)) or name.removesuffix(".base_layer.weight")
            if owner in layers:
                param = (param.float() + lora_delta(layers[owner], *factors[owner])).to(param.dtype)
            weights[plain(name)] = param
        self.weights = weights

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights.items())

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.weights.values())


class AdapterWeights(PolicyWeights):
    """The policy's adapter as an engine with LoRA of its own loads it (kind ``adapter``): peft's files,
    written on demand (``save``) in the given dtype. What a LoRA run's weight sync hands such an engine instead
    of the weights. A sharded adapter is gathered whole: every rank builds it."""

    kind = "adapter"

    def __init__(self, adapter: Adapter, version: int = 0):
        from peft import get_peft_model_state_dict

        self.model, self.version = adapter.model, version
        self.config = adapter.peft_model.peft_config["default"]
        with torch.no_grad():
            self.state = {k: whole(v).detach() for k, v in get_peft_model_state_dict(adapter.peft_model).items()}

    def save(self, folder: Path, dtype: str | None = None) -> Path:
        """``folder`` (created) with ``adapter_config.json`` and ``adapter_model.safetensors``, the tensors
        cast to ``dtype`` when given; returns ``folder``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cast = getattr(torch, dtype) if dtype else None
        save_file(
            {k: v.to("cpu", dtype=cast).contiguous() for k, v in self.state.items()}, str(folder / ADAPTER_WEIGHTS)
        )
        self.config.save_pretrained(str(folder))
        return folder


def export_merged(checkpoint: Path, out: Path) -> dict[str, Any]:
    """A Hugging Face model folder at ``out`` (new or empty, float32) with the adapter of ``checkpoint``
    merged into its base (the folder its ``adapter_config.json`` names), loadable without peft. Returns what
    was done."""
    require("exporting a LoRA checkpoint", "peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not is_adapter_folder(checkpoint):
        raise ValueError(
            f"{checkpoint}: not a LoRA checkpoint (no {ADAPTER_CONFIG}); a full-weight checkpoint "
            "is a Hugging Face model already"
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; not overwritten")
    base = adapter_base(checkpoint)
    mismatch = base_mismatch(checkpoint)
    if mismatch or not (base / "config.json").is_file():
        raise ValueError(f"{checkpoint}: {mismatch or f'its base model {base} is not a model folder any more'}")
    # a throwaway float32 copy: peft's own merge is the same W + (alpha / r) B A as ``MergedWeights``
    plain = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), checkpoint
    ).merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out) as tmp:  # whole or absent: a killed export leaves nothing in ``out``
        plain.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(tmp)
    return {"checkpoint": str(checkpoint), "base": str(base), "out": str(out)}
