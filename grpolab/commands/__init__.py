"""The ``grpolab`` command (``cli``) and the sub-commands that are more than a call into a lower layer:
``demo`` (the plan and estimate it prints), ``probe`` (will this config fit) and ``bench`` (engines
timed side by side).

May import: everything (the top layer).
"""
