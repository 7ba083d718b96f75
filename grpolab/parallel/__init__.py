"""Past one process: who this rank is, what the ranks agree on, DDP (``ranks``), and FSDP2 sharding
(``fsdp``).

May import: ``grpolab.common`` only.
"""
