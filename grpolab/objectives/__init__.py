"""The math of the objectives, as pure functions and declarative specs: algorithm presets
(``algorithms``: each algorithm a frozen ``AlgorithmSpec``), group advantages (``advantages``; GDPO's per-term ones and the dispatch by spec: ``decoupled``), the
per-token weights, one registered module per family (``surrogates``), the loss around them and its exact
reduction (``losses``), and the statistics of evaluation and
reports (``stats``: pass@k, paired bootstrap, McNemar).

May import: ``grpolab.common`` only.
"""
