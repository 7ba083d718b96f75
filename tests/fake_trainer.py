"""A stand-in for ``grpolab train`` that a suite's run processes become, for testing the suite scheduler in
seconds: it writes what a run writes (config.json, manifest.json with its sessions, metrics.jsonl, verified
checkpoints with checkpoint.json), holds the run directory's lock, stops after its step with a checkpoint on
SIGTERM / SIGINT (exit 130), fails with an ``error:`` line when told to, and resumes with ``--resume``.

Its numbers are a hash chain: each step's state is the SHA-256 of the previous one, starting from the run's
config (seed, algorithm, ...) and its start model's weights file, so a lost, repeated or wrongly resumed
step changes every later number and the final checkpoint's weights.

It is installed by ``install`` as a ``sitecustomize`` module on PYTHONPATH: every Python process whose
command line is ``... -m grpolab.commands.cli train --config FILE`` or ``... train --resume DIR`` (directly
or under ``torch.distributed.run``) runs this instead and exits. Nothing else of the runner is relied on.

Settings from the environment, read by the run process:
  GRPOLAB_FAKE_START_SECONDS seconds before it touches its run directory or takes the lock (the real
                             trainer's imports and model load; default 0)
  GRPOLAB_FAKE_STEP_SECONDS  seconds a step takes (default 0.05)
  GRPOLAB_FAKE_SLOW          NAME=SECONDS,...: a slower step for the runs whose directory is named NAME
  GRPOLAB_FAKE_FAIL          NAME:STEP,...: run NAME fails in step STEP (its records and checkpoint unwritten)
  GRPOLAB_FAKE_ACCURACY      ARM=P,...: the runs named ARM or ARM.sSEED (a decision suite's) write per-item
                             records of their last evaluation, FAKE_ITEMS items each right with chance P (drawn
                             from the hash chain: the seed moves them)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

FAIL_LINE = "error: non-finite loss (nan) or ratio in the policy update"
FAKE_ITEMS = 200
STOP: list[int] = []  # the signals asking this run to stop after its step (with a checkpoint)
SITECUSTOMIZE = """
import sys as _sys
from pathlib import Path as _Path
_args = [a.decode(errors="replace") for a in _Path("/proc/self/cmdline").read_bytes().split(b"\\0") if a]
if "grpolab.commands.cli" in _args and "train" in _args:
{extra}
    import importlib.util as _util
    _spec = _util.spec_from_file_location("fake_trainer", {path!r})
    _fake = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_fake)
    _fake.run_and_exit(_args)
"""


def install(folder: Path, extra: str = "") -> Path:
    """Write ``folder``/sitecustomize.py that turns a run process into this fake (``extra``: code the run
    process runs first, e.g. an atexit hook); put ``folder`` on PYTHONPATH to use it."""
    folder.mkdir(parents=True, exist_ok=True)
    indented = "\n".join("    " + line for line in extra.splitlines()) or "    pass"
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(extra=indented, path=str(Path(__file__).resolve())))
    return folder


def sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def named(setting: str, name: str) -> str | None:
    """``NAME=VALUE`` / ``NAME:VALUE`` items of an environment setting: the value for ``name``."""
    for item in filter(None, os.environ.get(setting, "").split(",")):
        key, _, value = item.replace("=", ":", 1).partition(":")
        if key == name:
            return value
    return None


class FakeRun:
    """One run process of the fake: the run of ``config`` (a run's config.json as a dict), ``world_size`` the
    processes it stands for (torchrun's ``--nproc_per_node``)."""

    def __init__(self, config: dict, world_size: int):
        self.config, self.world_size = config, world_size
        self.run_dir = Path(config["output_dir"])
        self.steps, self.name = int(config["steps"]), self.run_dir.name
        self.step_seconds = float(
            named("GRPOLAB_FAKE_SLOW", self.name) or os.environ.get("GRPOLAB_FAKE_STEP_SECONDS", "0.05")
        )
        fail = named("GRPOLAB_FAKE_FAIL", self.name)
        self.fail_at = int(fail) if fail else None
        accuracy = named("GRPOLAB_FAKE_ACCURACY", self.name.rpartition(".s")[0] or self.name)
        self.accuracy = float(accuracy) if accuracy else None

    def initial_state(self) -> str:
        """The run's settings (paths aside) and its start model's weights."""
        settings = {k: v for k, v in self.config.items() if k not in ("output_dir", "model", "task")}
        settings["model"] = {k: v for k, v in self.config.get("model", {}).items() if k != "path"}
        start = Path(str(self.config.get("model", {}).get("path")))
        weights = start / "model.safetensors"
        start_weights = sha(weights.read_bytes()) if weights.is_file() else str(start)
        return sha(json.dumps(settings, sort_keys=True) + start_weights)

    def where(self) -> dict:
        return {
            "host": socket.gethostname(),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "world_size": self.world_size,
        }

    def save_manifest(self, manifest: dict) -> None:
        write_atomically(self.run_dir / "manifest.json", json.dumps(manifest, indent=1))

    def checkpoint(self, step: int, state: str) -> None:
        """checkpoints/step_NNNNNN as the trainer writes one: its files, then checkpoint.json listing them, in a
        temp folder renamed into place."""
        final = self.run_dir / "checkpoints" / f"step_{step:06d}"
        tmp = final.parent / f".step_{step:06d}-{os.getpid()}"
        tmp.mkdir(parents=True)
        files = {
            "config.json": b"{}",
            "model.safetensors": state.encode(),
            "trainer_state.pt": json.dumps({"step": step, "state": state}).encode(),
        }
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        listing = {name: {"bytes": len(data), "sha256": sha(data)} for name, data in files.items()}
        (tmp / "checkpoint.json").write_text(json.dumps({"step": step, "files": listing}))
        tmp.rename(final)

    def write_eval_records(self, step: int, state: str) -> float:
        """eval/step_NNNNNN.jsonl as the trainer writes it: one record per item, right with chance
        ``self.accuracy``; the accuracy."""
        records = [
            {
                "id": f"item{k}",
                "prompt_sha256": sha(f"item{k}"),
                "correct": int(sha(f"{state} {k}")[:8], 16) / 2**32 < self.accuracy,
            }
            for k in range(FAKE_ITEMS)
        ]
        (self.run_dir / "eval").mkdir(exist_ok=True)
        write_atomically(
            self.run_dir / "eval" / f"step_{step:06d}.jsonl", "".join(json.dumps(r) + "\n" for r in records)
        )
        return sum(r["correct"] for r in records) / FAKE_ITEMS

    def newest_checkpoint(self) -> tuple[int, str | None]:
        """The newest checkpoint whose files match its checkpoint.json: (its step, its state); (0, None) if none."""
        for folder in sorted((self.run_dir / "checkpoints").glob("step_*"), reverse=True):
            try:
                listing = json.loads((folder / "checkpoint.json").read_text())["files"]
                if all(sha((folder / n).read_bytes()) == e["sha256"] for n, e in listing.items()):
                    state = json.loads((folder / "trainer_state.pt").read_text())["state"]
                    return int(folder.name.removeprefix("step_")), state
            except (OSError, ValueError, KeyError):
                continue
        return 0, None

    def train(self, resume: bool) -> int:
        from grpolab.run.lock import RunLock, RunLocked  # the trainer's own lock: the runner reads it

        time.sleep(float(os.environ.get("GRPOLAB_FAKE_START_SECONDS") or 0))
        if not resume and self.run_dir.exists() and any(self.run_dir.iterdir()):
            print(f"error: run directory {self.run_dir} is not empty", flush=True)
            return 2
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            RunLock(self.run_dir).acquire()
        except RunLocked as err:
            print(f"error: {err}", flush=True)
            return 2
        metrics = self.run_dir / "metrics.jsonl"
        if resume:
            manifest = json.loads((self.run_dir / "manifest.json").read_text())
            start, state = self.newest_checkpoint()
            records = (
                [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
                if metrics.exists()
                else []
            )
            kept = [r for r in records if r["step"] <= start]
            with (self.run_dir / "metrics.discarded.jsonl").open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records if r["step"] > start)
            write_atomically(metrics, "".join(json.dumps(r) + "\n" for r in kept))
            manifest.setdefault("resumes", []).append({"step": start, "from_checkpoint": start or None})
        else:
            write_atomically(self.run_dir / "config.json", json.dumps(self.config, indent=1))
            manifest, start, state = {"config": self.config, "sessions": []}, 0, None
        state = state or self.initial_state()
        manifest["sessions"].append({"from_step": start, "to_step": start, "where": self.where()})
        self.save_manifest(manifest)
        every, eval_every = self.config["checkpoint"]["every"], self.config["eval"]["every"]
        for step in range(start + 1, self.steps + 1):
            time.sleep(self.step_seconds)
            if step == self.fail_at:
                print(FAIL_LINE, flush=True)
                return 2
            state = sha(f"{state} {step}")
            record = {"step": step, "reward_mean": int(state[:8], 16) / 2**32, "fake/state": state}
            if step % eval_every == 0 or step == self.steps:
                record["val/accuracy"] = int(state[8:16], 16) / 2**32
            if step == self.steps and self.accuracy is not None:
                record["val/accuracy"] = self.write_eval_records(step, state)
            with metrics.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if step % every == 0 or step == self.steps or STOP:
                self.checkpoint(step, state)
            manifest["sessions"][-1]["to_step"] = step
            self.save_manifest(manifest)
            print(f"step {step}/{self.steps}", flush=True)
            if STOP and step < self.steps:
                print(
                    f"stopped after step {step} with a checkpoint; continue with: grpolab train --resume "
                    f"{self.run_dir}",
                    flush=True,
                )
                return 130
        return 0


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run_and_exit(args: list[str]) -> None:
    """Run the fake for this process's command line and exit with its code (atexit hooks run first)."""
    import atexit

    for sig in (signal.SIGTERM, signal.SIGINT):  # first: a stop asked while starting is honoured too
        signal.signal(sig, lambda signum, _: STOP.append(signum))
    train = args[args.index("train") + 1 :]
    world = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--nproc_per_node=")), 1)
    if train[0] == "--resume":
        config, resume = json.loads((Path(train[1]) / "config.json").read_text()), True
    else:
        config, resume = json.loads(Path(train[1]).read_text()), False
    code = FakeRun(config, world).train(resume)
    sys.stdout.flush()
    atexit._run_exitfuncs()
    os._exit(code)
