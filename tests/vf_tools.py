"""A tool verifiers 0.4 environment in verifiers' own API (``task.environment = "vf_tools"``): the model may call
an ``add`` tool (an MCP ``Toolset`` served per rollout) before answering. Reward: ``correct`` (1.0).

Run as a module, it serves the toolset (verifiers starts its tool servers as ``python -m MODULE``).
"""

from __future__ import annotations

import verifiers.v1 as vf

SYSTEM = "Use the add tool, then answer with the number."


class AddConfig(vf.ToolsetConfig):
    pass


class Calc(vf.Toolset[AddConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(AddConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: AddData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)


class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self):
        for i in range(6):
            a, b = 10 + i, 20 + 2 * i
            yield AddTask(AddData(id=f"add-{i}", prompt=f"What is {a} + {b}?", answer=str(a + b), system_prompt=SYSTEM))


__all__ = ["AddTaskset"]

if __name__ == "__main__":
    Calc.run()
