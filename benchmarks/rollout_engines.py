"""Rollout engines side by side in one run: `grpolab bench rollout`, then `grpolab bench step`.

    python benchmarks/rollout_engines.py                                  # demo settings, every engine here
    python benchmarks/rollout_engines.py --vllm-python .venv-vllm/bin/python --threads 1
    python benchmarks/rollout_engines.py --model DIR --config configs/gsm8k_qwen3_0.6b.toml

Any `grpolab` option or dotted override is passed on to both. Targets (issue 5): the vLLM engine's
rollout tokens/s at least 3x the hf engine's; a weight sync at most 5% of an RL step.
"""

import sys

from grpolab.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "rollout", *sys.argv[1:]]) or main(["bench", "step", *sys.argv[1:]]))
