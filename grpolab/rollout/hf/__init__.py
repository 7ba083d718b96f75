"""The ``hf`` engine: generation on the training model itself (``engine``), with its own decoding loop
(``decode``: rows leave the batch as they end, inverse-CDF sampling), the shared prompt prefix prefilled
once (``prefill``), a KV cache written in place (``kv_cache``), grouped key/value heads attended as they
are (``grpolab.models.grouped_attention``, which training in bf16 uses too) and prepacked linear weights on a CPU
(``packed_linear``).
"""
