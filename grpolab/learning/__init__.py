"""Learning from a rollout batch: right-padded training tensors (``batching``), which sequences go
through the forward together (``packing``), the training forward with each prompt computed once
(``shared_prefix``), the learner that forms advantages and frozen log-probs and runs the update
(``learner``), and the update schedule of epochs, optimizer steps and micro-batches (``update``).

May import: ``grpolab.rollout`` and every layer below it (docs/architecture.md).
"""
