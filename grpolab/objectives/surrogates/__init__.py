"""Surrogate weights: each token's policy-gradient term, one registered function per ``algorithm.weight``.

``registry.py`` holds them (``SURROGATES``, ``get_surrogate``) and what each declares: its formula, the fields it
reads, its checks. Each module here registers a family of weights; importing this package registers them all, in
the order below (that of ``algorithm.weight``'s choices and help). A new weight: a module here with its
``@register``ed function, imported below (docs/architecture.md, "Where a new objective goes").
"""

# isort: off
from grpolab.objectives.surrogates import policy_gradient  # none, noclip
from grpolab.objectives.surrogates import ppo_clip  # clip, gspo
from grpolab.objectives.surrogates import cispo  # cispo
from grpolab.objectives.surrogates import soft_weights  # sapo, vespo
from grpolab.objectives.surrogates import trust_region  # gmpo, dppo

# isort: on
from grpolab.objectives.surrogates.registry import (
    CLIP_RANGE,
    SURROGATES,
    Surrogate,
    SurrogateInput,
    SurrogateOutput,
    get_surrogate,
    readers_of,
    unread_parameter,
    weights_that,
)

__all__ = [
    "CLIP_RANGE",
    "SURROGATES",
    "Surrogate",
    "SurrogateInput",
    "SurrogateOutput",
    "get_surrogate",
    "readers_of",
    "unread_parameter",
    "weights_that",
    "cispo",
    "policy_gradient",
    "ppo_clip",
    "soft_weights",
    "trust_region",
]
