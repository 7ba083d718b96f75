"""What a run's checkpoints will take on disk, said at its start: the size of one (weights as saved, the
trainer state with the optimizer's), how many this session writes, how many can be on disk at once, and a
warning when the run directory's file system has less free space than they need."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from grpolab.common.progress import format_bytes

STATE_OVERHEAD = 64 * 1024  # the trainer state besides the optimizer's (step, RNGs, data position), and the tokenizer


def checkpoints_written(first: int, steps: int, every: int) -> int:
    """Checkpoints a session writes from step ``first`` to ``steps``: every ``every`` steps and the last."""
    if first > steps:
        return 0
    return steps // every - (first - 1) // every + (steps % every != 0)


@dataclass(frozen=True)
class CheckpointPlan:
    """``weights``, ``state``: bytes of one checkpoint's weights (the model's, or a LoRA run's adapter) and
    trainer state (the optimizer's moments and the rest); ``count``: checkpoints this session writes;
    ``keep_last``: the config's (None: all kept); ``free``: free bytes where the run directory lives."""

    weights: int
    state: int
    count: int
    keep_last: int | None
    free: int
    where: Path

    @property
    def each(self) -> int:
        return self.weights + self.state

    @property
    def at_once(self) -> int:
        """Most new checkpoints on disk at once: all, or keep_last and the newest until it verifies."""
        return self.count if self.keep_last is None else min(self.count, self.keep_last + 1)

    @property
    def needed(self) -> int:
        return self.each * self.at_once

    def line(self) -> str:
        kept = (
            f"all kept: {format_bytes(self.needed)}"
            if self.keep_last is None
            else f"at most {self.at_once} on disk at once (keep_last {self.keep_last}): {format_bytes(self.needed)}"
        )
        return (
            f"checkpoints: {self.count} x ~{format_bytes(self.each)} (weights {format_bytes(self.weights)}, "
            f"optimizer and trainer state {format_bytes(self.state)}), {kept}; "
            f"{format_bytes(self.free)} free on the run directory's disk"
        )

    def warning(self) -> str | None:
        """One line when the disk cannot hold the checkpoints, saying what to change; None when it can."""
        if self.needed <= self.free:
            return None
        return (
            f"the checkpoints need ~{format_bytes(self.needed)} but {self.where}'s disk has "
            f"{format_bytes(self.free)} free: set checkpoint.keep_last, raise checkpoint.every, or free space "
            "(a full disk ends the run at a checkpoint write; --resume continues from the last complete one)"
        )


def checkpoint_plan(
    weights: int,
    optimizer_state: int,
    first: int,
    steps: int,
    every: int,
    keep_last: int | None,
    run_dir: Path,
) -> CheckpointPlan:
    """The plan of a session from step ``first``: ``weights`` bytes saved per checkpoint, ``optimizer_state``
    bytes of the optimizer's state in each; free space of ``run_dir``'s file system, measured now."""
    return CheckpointPlan(
        weights=weights,
        state=optimizer_state + STATE_OVERHEAD,
        count=checkpoints_written(first, steps, every),
        keep_last=keep_last,
        free=shutil.disk_usage(run_dir).free,
        where=Path(run_dir),
    )
