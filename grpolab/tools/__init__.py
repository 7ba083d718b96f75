"""Tools for multi-turn rollouts: the call protocol and its tools (``protocol``), the safe calculator
(``calculator``) and the multi-turn engine over any rollout engine (``multiturn``)."""

from grpolab.tools.multiturn import MultiTurnEngine, tool_metrics
from grpolab.tools.protocol import TOOLS, Tool, ToolCall, ToolError, Toolset

__all__ = ["TOOLS", "MultiTurnEngine", "Tool", "ToolCall", "ToolError", "Toolset", "tool_metrics"]
