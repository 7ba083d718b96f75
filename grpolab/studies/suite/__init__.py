"""Suites: a queue of runs executed one at a time, each in its own process, from a snapshot of the code
and data, with a manifest that records every state change (``grpolab suite run|resume|status``)."""
