"""log.trackers: TensorBoard, W&B (offline) and Trackio (its local database) receive what metrics.jsonl receives,
tables of completions, and a resume continues the same tracker runs without sending a step twice. Read back with
each tracker's own reader: W&B's protobuf records of its .wandb files, Trackio's SQLite storage, TensorBoard's
EventAccumulator. The runs are real `grpolab train` processes (W&B and Trackio keep process-wide state)."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import TASK, train_until
from rich.console import Console

from grpolab.config import load_config, load_run_config
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer, train

# Trackio reads its folder once, when imported: this module's runs go to a database of its own (set while the
# test modules are collected, before any test runs; no other test module imports trackio)
assert "trackio" not in sys.modules, "trackio was imported before its folder was set"
# (created by Trackio when a test here logs, removed after them: a collection alone leaves nothing behind)
TRACKIO_DIR = os.environ["TRACKIO_DIR"] = str(Path(tempfile.gettempdir()) / f"grpolab-test-trackio-{os.getpid()}")

ROOT = Path(__file__).resolve().parents[1]
WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc32c, length, type) framed chunks


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file (W&B's own ``Record`` message), in order."""
    from wandb.proto import wandb_internal_pb2

    data, records, pos, pending = path.read_bytes(), [], WANDB_HEADER, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(path: Path) -> dict[int, dict]:
    """{step: {key: value}} of a .wandb file's history rows (W&B's own keys, ``_step`` and the like, left out); a
    table is a dict of its fields (W&B writes them as nested keys)."""
    rows = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row: dict = {}
            for item in record.history.item:
                value, path = json.loads(item.value_json), [item.key] if item.key else list(item.nested_key)
                if len(path) == 1:
                    row[path[0]] = value
                else:
                    row.setdefault("/".join(path[:-1]), {})[path[-1]] = value
            rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def wandb_exit_code(path: Path) -> int | None:
    codes = [r.exit.exit_code for r in wandb_records(path) if r.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None


def numeric(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def untimed(values: dict) -> dict:
    return {k: v for k, v in values.items() if not k.startswith("time/") and k != "tokens_per_s"}


def by_step(records: list[dict]) -> dict[int, dict]:
    """{step: all the numbers of that step} (a training record and an evaluation at one step merge)."""
    out: dict[int, dict] = {}
    for record in records:
        out.setdefault(record["step"], {}).update(numeric(record))
    return out


@pytest.fixture(scope="module", autouse=True)
def _trackio_folder():
    yield
    shutil.rmtree(TRACKIO_DIR, ignore_errors=True)


def train_overrides(model_dir: Path, run: Path) -> dict:
    return {
        "model.path": str(model_dir),
        "output_dir": str(run),
        "threads": 1,
        "steps": 3,
        **{f"task.{k}": v for k, v in TASK.items()},
        "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 40,
        "optim.micro_batch_size": 16,
        "optim.lr": 1e-3,
        "eval.every": 2,
        "checkpoint.every": 2,
        "log.trackers": "wandb,trackio,tensorboard",
        "log.completions_every": 2,
        "log.completions_max": 8,
    }


@pytest.fixture(scope="module")
def tracked(warm_model_dir, tmp_path_factory):
    """A 3-step run into the three trackers; then its step-3 checkpoint damaged and the run resumed to step 4,
    which redoes step 3 (already sent) from the step-2 checkpoint. W&B is not set up (no key, mode or login:
    the run goes offline by itself); Trackio writes to this module's database (``TRACKIO_DIR`` above)."""
    tmp = tmp_path_factory.mktemp("trackers")
    run = tmp / "run"
    with pytest.MonkeyPatch.context() as patch:
        for name in [k for k in os.environ if k.startswith("WANDB_")]:
            patch.delenv(name)
        patch.setenv("NETRC", str(tmp / "no-netrc"))
        first = io.StringIO()
        train(load_config(None, train_overrides(warm_model_dir, run)), Console(file=first, width=400))
        first_records = read_metrics(run / "metrics.jsonl")
        with (run / "checkpoints" / "step_000003" / "trainer_state.pt").open("ab") as f:
            f.write(b"damage")
        second = io.StringIO()
        train(load_run_config(run, {"steps": 4}), Console(file=second, width=400), resume=True)
    return {"run": run, "first": first.getvalue(), "second": second.getvalue(), "first_records": first_records}


def wandb_files(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_offline_by_default_holds_the_metrics_of_each_session_once(tracked):
    run = tracked["run"]
    manifest = json.loads((run / "manifest.json").read_text())
    run_id = manifest["trackers"]["wandb"]["id"]
    assert manifest["trackers"]["wandb"]["name"] == run.name
    assert [s["trackers"]["wandb"] for s in manifest["sessions"]] == ["offline", "offline"]
    assert "wandb offline (no WANDB_API_KEY, WANDB_MODE or wandb login)" in tracked["first"]
    files = wandb_files(run)
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # one W&B run, continued by the resume
    first, second = (wandb_history(f) for f in files)
    # the first session: exactly its metrics.jsonl, key for key (steps 0-3; evaluations at 0, 2 and 3)
    expected = by_step(tracked["first_records"])
    assert sorted(first) == [0, 1, 2, 3]
    for step, values in expected.items():
        assert {k: v for k, v in first[step].items() if not isinstance(v, dict)} == pytest.approx(values, rel=1e-6)
    # the resume redid step 3 (its checkpoint was damaged): W&B already held it and gets only step 4
    final = by_step(read_metrics(run / "metrics.jsonl"))
    assert sorted(second) == [4]
    assert {k: v for k, v in second[4].items() if not isinstance(v, dict)} == pytest.approx(final[4], rel=1e-6)
    redone = untimed(final[3])  # exact resume: the redone step's numbers are those W&B holds
    assert redone == pytest.approx({k: expected[3][k] for k in redone}, rel=1e-6)
    # completion tables every 2 steps and at the last (`steps`: 3, then 4), evaluation tables at every evaluation
    assert [s for s in first if "completions" in first[s]] == [2, 3]
    assert [s for s in first if "val/completions" in first[s]] == [0, 2, 3]
    assert first[2]["completions"]["_type"] == "table-file" and first[2]["completions"]["nrows"] == 8
    assert second[4]["completions"]["nrows"] == 8 and second[4]["val/completions"]["nrows"] == 8  # log.completions_max
    table = json.loads((files[0].parent / "files" / first[2]["completions"]["path"]).read_text())
    assert table["columns"][:5] == ["group", "prompt", "completion", "reward", "advantage"]
    assert len(table["data"]) == 8 and all(isinstance(row[2], str) for row in table["data"])
    assert [wandb_exit_code(f) for f in files] == [0, 0]  # each session marked finished


def test_trackio_continues_its_run_without_a_step_twice(tracked):
    from trackio.sqlite_storage import SQLiteStorage
    from trackio.utils import TRACKIO_DIR as used

    assert str(used) == TRACKIO_DIR
    found = {"runs": SQLiteStorage.get_runs("grpolab"), "logs": SQLiteStorage.get_logs("grpolab", tracked["run"].name)}
    assert found["runs"] == [tracked["run"].name]  # one Trackio run, continued
    logs = found["logs"]
    metric_rows = [r for r in logs if not any(isinstance(v, dict) for v in r.values())]
    steps = [r["step"] for r in metric_rows]
    first = tracked["first_records"]
    final = read_metrics(tracked["run"] / "metrics.jsonl")
    sent = first + [r for r in final if r["step"] == 4]  # step 3 is not sent again
    assert steps == [r["step"] for r in sent]
    for row, record in zip(metric_rows, sent):
        assert {k: row[k] for k in numeric(record)} == pytest.approx(numeric(record), rel=1e-6)
    tables = {(r["step"], k): v for r in logs for k, v in r.items() if isinstance(v, dict)}
    # every 2 steps and the last (3, then 4; step 3 once: its redo is not sent), every evaluation
    assert sorted(tables) == sorted(
        [(s, "completions") for s in (2, 3, 4)] + [(s, "val/completions") for s in (0, 2, 3, 4)]
    )
    rows = tables[(2, "completions")]["_value"]
    assert len(rows) == 8 and {"prompt", "completion", "reward", "advantage"} <= set(rows[0])


def test_tensorboard_shows_each_step_once_with_the_resumed_values(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tracked["run"]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    final = by_step(read_metrics(run / "metrics.jsonl"))
    for key in ("reward_mean", "val/accuracy", "grad_norm"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in logged] == sorted(s for s in final if key in final[s])
        assert dict(logged) == pytest.approx({s: v[key] for s, v in final.items() if key in v}, rel=1e-6)
    assert {"completions/text_summary", "val/completions/text_summary"} <= set(events.Tags()["tensors"])
    table = events.Tensors("completions/text_summary")
    assert [e.step for e in table] == [2, 3, 4]  # the redone step 3 once: TensorBoard rewrites from the purge step
    assert b"| group | prompt | completion | reward | advantage |" in table[0].tensor_proto.string_val[0]


@pytest.mark.parametrize("blocked", ["wandb", "trackio", "tensorboard"])
def test_a_missing_tracker_package_is_one_line_before_anything_moves(
    blocked, warm_model_dir, tmp_path, monkeypatch, capsys
):
    from grpolab.commands.cli import main

    monkeypatch.setitem(sys.modules, blocked, None)  # as if not installed: importing it raises ImportError
    run = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in train_overrides(warm_model_dir, run).items()]
    assert main(["train", *args]) == 2
    out = capsys.readouterr().out
    assert out.count("error:") == 1
    assert f"log.trackers {blocked} needs the {blocked} package: pip install 'grpolab[trackers]'" in " ".join(
        out.split()
    )
    assert not run.exists()


def wandb_only(model_dir: Path, run: Path, tmp: Path, patch: pytest.MonkeyPatch):
    """A 2-step run logging to W&B alone, offline (its files under ``tmp``)."""
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_DIR", str(tmp))
    overrides = {**train_overrides(model_dir, run), "steps": 2, "log.trackers": ["wandb"]}
    return load_config(None, overrides)


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(warm_model_dir, tmp_path, monkeypatch):
    run, out = tmp_path / "run", io.StringIO()
    cfg = wandb_only(warm_model_dir, run, tmp_path, monkeypatch)
    original = Trainer.train_step

    def wandb_run_ends_at_step_2(self, step, *args):
        if step == 2:  # the W&B run ends under the trainer (as when its service process dies)
            self.log.trackers.open[0].run.finish()
        return original(self, step, *args)

    monkeypatch.setattr(Trainer, "train_step", wandb_run_ends_at_step_2)
    summary = train(cfg, Console(file=out, width=400))
    warnings = [line for line in out.getvalue().splitlines() if "warning: log.trackers wandb failed" in line]
    assert len(warnings) == 1 and "is finished" in warnings[0] and "metrics.jsonl stays complete" in warnings[0]
    assert summary["steps"] == 2
    assert sorted({r["step"] for r in read_metrics(run / "metrics.jsonl")}) == [0, 1, 2]  # nothing lost
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert sorted(wandb_history(wandb_file)) == [0, 1]  # what it got before it failed


def test_an_interrupted_run_leaves_its_wandb_run_resumable(warm_model_dir, tmp_path, monkeypatch):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    run = tmp_path / "run"
    wandb_only(warm_model_dir, run, tmp_path, monkeypatch)
    # another run of the same name in the same Trackio project: a new grpolab run does not add to its curves
    other = trackio.init(project="again", name="run", embed=False)
    other.log({"reward_mean": 0.5}, step=0)
    trackio.finish()
    overrides = {**train_overrides(warm_model_dir, run), "steps": 2, "log.project": "again"}
    cfg = load_config(None, {**overrides, "log.trackers": ["wandb", "trackio"]})
    train_until(cfg, 2, Console(file=io.StringIO()))  # Ctrl-C as step 2 begins
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    kinds = [r.WhichOneof("record_type") for r in wandb_records(wandb_file)]
    assert "preempting" in kinds and wandb_exit_code(wandb_file) == 1  # marked preempted, not finished
    assert sorted(wandb_history(wandb_file)) == [0, 1]
    runs = SQLiteStorage.get_run_records("again")
    assert [r["name"] for r in runs] == ["run", "run"] and runs[0]["id"] != runs[1]["id"]
    assert [r["step"] for r in SQLiteStorage.get_logs("again", run_id=runs[0]["id"])] == [0]  # untouched


def test_log_tensorboard_true_is_still_read_as_the_tensorboard_tracker(tmp_path):
    from grpolab.config import ConfigError

    assert load_config(None, {"log.tensorboard": True}).log.trackers == ["tensorboard"]
    assert load_config(None, {"log.tensorboard": False}).log.trackers == []
    both = load_config(None, {"log.trackers": "wandb, trackio", "log.tensorboard": True}).log.trackers
    assert both == ["wandb", "trackio", "tensorboard"]
    assert "tensorboard" not in load_config(None, {"log.tensorboard": True}).model_dump()["log"]  # new spelling
    # a run directory of an earlier version: its config.json holds the old spelling, and its resume reads it
    data = load_config(None, {"output_dir": str(tmp_path)}).model_dump(mode="json")
    data["log"] = {"tensorboard": True}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load_run_config(tmp_path).log.trackers == ["tensorboard"]
    for bad, message in (({"log.tensorboard": "yes"}, "must be true or false"), ({"log.trackers": "mlflow"}, "wandb")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad)


def test_wandb_goes_online_only_when_set_up(tmp_path):
    from grpolab.run.trackers.wandb_tracker import choose_mode

    netrc = tmp_path / "netrc"
    none = {"NETRC": str(netrc)}
    assert choose_mode(none) == ("offline", "no WANDB_API_KEY, WANDB_MODE or wandb login")
    assert choose_mode({**none, "WANDB_MODE": "disabled"}) == ("disabled", "WANDB_MODE")
    assert choose_mode({**none, "WANDB_API_KEY": "x" * 40}) == (None, "WANDB_API_KEY")  # W&B's own choice: online
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")  # what wandb login writes
    assert choose_mode(none) == (None, "wandb login")
    assert choose_mode({**none, "WANDB_BASE_URL": "https://wandb.example.org"})[0] == "offline"  # another host


def test_an_unwritable_trackio_directory_is_one_line_before_anything_moves(warm_model_dir, tmp_path):
    """Trackio only warns that it failed to flush and the run would end 0 with every Trackio metric lost: the
    directory (``TRACKIO_DIR``, read by Trackio when imported: a process of its own) is checked first. Under a
    regular file, so that no user (root included) can write it."""
    import subprocess

    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "trackio"
    run = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in {**train_overrides(warm_model_dir, run), "log.trackers": "trackio"}.items()]
    done = subprocess.run(
        [sys.executable, "-m", "grpolab.commands.cli", "train", *args],
        env={**os.environ, "TRACKIO_DIR": str(folder), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert out.count("error:") == 1 and "Traceback" not in out, out
    assert f"log.trackers trackio: its directory {folder} cannot be written" in " ".join(out.split()), out
    assert not run.exists()
