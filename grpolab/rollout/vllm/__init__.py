"""The ``vllm`` engine: vLLM in this process (``engine``), or under another interpreter behind a small
server (``server``); ``worker`` runs inside vLLM's workers (weight reloads, the CUDA-IPC sender).
"""
