"""The policy as a Hugging Face model: loading it and its frozen reference (``loading``), the demo's
tiny model and its warm start (``tinymodel``), ``like:`` shapes (``like``) and ``gguf:`` files
(``gguf``), cached folders (``cached_folder``), what the training forward reproduces of a family's own
forward (``fidelity``), memory-lean per-token log-probs (``logprobs``), prompt token ids
(``prompt_tokens``), training precision (``precision``) and attention over grouped key/value heads on a CPU
(``grouped_attention``: the hf engine's decoding, and training in bf16). What a run config holds of them (the precision's
name, the warm start's settings, the teacher's) is in ``settings``, which imports no torch.

May import: ``grpolab.tasks``, ``grpolab.tools``, ``grpolab.objectives``, ``grpolab.parallel``,
``grpolab.common``.
"""
