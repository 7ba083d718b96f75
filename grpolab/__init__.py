"""grpolab: online RL post-training of small language models on verifiable-reward tasks."""

__version__ = "0.1.0"
