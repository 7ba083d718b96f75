"""Shared utilities with no RL in them: progress lines and bars (``progress``), how many CPU threads
to use (``threads``), pydantic errors as one line per field (``validation``).

May import: nothing of grpolab (the bottom layer; docs/architecture.md).
"""
