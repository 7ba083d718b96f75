"""A notebook user's run, in a real Jupyter kernel (nbclient + ipykernel): a reward function defined in a cell,
rows in a list, ``grpolab.train`` in the next cell; its progress arrives as time-stamped lines in the cell's
output, and the run's rewards are the cell's function."""

from __future__ import annotations

import json

import pytest
from test_api import ROWS, SETTINGS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    """import grpolab

def closeness(completion, answer, extracted=None, **info):
    return 0.0 if not extracted else (1.0 if extracted.strip() == answer else 0.5)

rows = {rows!r}""",
    """result = grpolab.train(
    model={model!r}, dataset=rows[:60], eval_dataset=rows[60:76], rewards=[closeness], output_dir={out!r},
    **{settings!r}
)
print("accuracy", result.final["val/accuracy"])""",
]


def test_a_notebook_trains_with_a_cells_reward_and_shows_progress_lines(warm_model_dir, tmp_path):
    out = tmp_path / "run"
    values = {"rows": ROWS, "model": str(warm_model_dir), "out": str(out), "settings": SETTINGS}
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.format(**values)) for c in CELLS])
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = notebook.cells[1]["outputs"]
    assert not [o for o in outputs if o["output_type"] == "error"], outputs
    text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)
    for line in ("grpo on dataset, 2 steps", "eval step 0: done", "step 2/2", "checkpoint step 2: done", "accuracy "):
        assert line in text, (line, text[-2000:])
    assert "\x1b[?25l" not in text  # no terminal cursor codes: lines, not a live bar that a notebook cannot redraw
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    assert all(r["reward/closeness_failed"] == 0 for r in steps) and any(r["reward/closeness"] > 0 for r in steps)
