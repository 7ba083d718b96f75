"""Many runs and what they show: suites of runs from a snapshot with a manifest (``suite``), the suite
manifest both sides read (``manifest``), and reports with paired confidence intervals (``report``).

May import: ``grpolab.run`` and every layer below it.
"""
