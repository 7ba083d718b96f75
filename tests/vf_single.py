"""A single-turn verifiers 0.4 environment written in verifiers' own API (``task.environment = "vf_single"``).

Sums of two digits: the model answers in ``<answer>...</answer>``; two weighted rewards (``correct`` 1.0,
``formatted`` 0.25), and a ``faulty`` reward (weight 0) that raises on questions whose first digit is 7.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

SYSTEM = "Answer with the sum inside <answer></answer>."
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)


class SumData(vf.TaskData):
    answer: str


class SumConfig(vf.TasksetConfig):
    size: int = 12
    offset: int = 0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply)
        return float(found is not None and found.group(1) == task.answer)

    @vf.reward(weight=0.25)
    async def formatted(self, trace: vf.Trace) -> float:
        return float(ANSWER.search(trace.last_reply) is not None)

    @vf.reward(weight=0.0)
    async def faulty(self, task: SumData) -> float:
        if task.prompt_text.startswith("7"):
            raise ValueError("faulty reward: a 7")
        return 1.0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.offset, self.config.offset + self.config.size):
            a, b = (i * 7) % 10, (i * 3 + 1) % 10
            yield SumTask(
                SumData(id=f"sum-{i}", prompt=f"{a} + {b}", answer=str(a + b), system_prompt=SYSTEM),
                self.config.task,
            )


__all__ = ["SumTaskset"]
