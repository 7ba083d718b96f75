"""Tools for multi-turn rollouts: the call protocol and its tools (``protocol``), the safe calculator
(``calculator``) and the multi-turn engine over any rollout engine with the tool metrics
(``multiturn``, which imports torch: tasks import this package and stay light)."""

from grpolab.tools.protocol import TOOLS, Tool, ToolCall, ToolError, Toolset

__all__ = ["TOOLS", "Tool", "ToolCall", "ToolError", "Toolset"]
