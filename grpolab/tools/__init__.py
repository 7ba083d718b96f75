"""Tools a policy may call in multi-turn rollouts: the call protocol, the registry of tools and the
``[task.tools]`` settings (``protocol``), the safe calculator (``calculator``), and the Python tool
(``python_tool``) with the bubblewrap sandbox its code runs in (``code_sandbox``). The multi-turn engine
that runs them lives with the engines (``grpolab.rollout.multiturn``).

May import: ``grpolab.common`` only (tasks import this package and stay light).
"""

from grpolab.tools.protocol import TOOLS, Tool, ToolCall, ToolError, ToolsConfig, Toolset

__all__ = ["TOOLS", "Tool", "ToolCall", "ToolError", "ToolsConfig", "Toolset"]
