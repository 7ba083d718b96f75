"""One run: its parts assembled (``parts``), one RL step over them (``step``), the loop with evaluation and
checkpoints (``trainer``), and what makes a run resumable and auditable: run state (``state``), the run
directory (``rundir``), its journal (``journal``), lock (``lock``), checkpoints (``checkpoints``), resume
checks (``resume``) and graceful stops (``stop``); the trackers a run also logs to (``trackers``).

May import: ``grpolab.config`` and every layer below it.
"""
