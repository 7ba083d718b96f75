"""A tool verifiers 0.4 environment in verifiers' own API (``task.environment = "vf_tools"``): the model may call
an ``add`` tool (an MCP ``Toolset`` served per rollout) before answering; with ``followups`` the env asks again
after each answer (tool calls within the env's turns). Reward: ``correct`` (1.0).

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


class AddEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    followups: int = 0  # user turns after the first answer ("again, please"), each answered with the tool again


class AddEnv(vf.Env[AddEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.followups):
                if segment.terminated:
                    break
                segment = await chat.turn("again, please")


__all__ = ["AddEnv", "AddTaskset"]

if __name__ == "__main__":
    Calc.run()
