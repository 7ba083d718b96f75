"""The registry of surrogate weights: what each token's policy-gradient term is, by name (``algorithm.weight``).

A weight registers, in the module that computes it (``@register``): its per-token function, the one line of its
formula (``grpolab algorithms``, ``AlgorithmSpec.formula``), a few words for the field's help, the
``AlgorithmSpec`` fields it reads (handed to its function and its check as keyword arguments, so that a weight
never sees the spec) and what else the objective around it must know: whether its ratio is one per sequence, and
which rollout correction it folds into its own weight.

Nothing here imports torch: listing the algorithms and checking a config load none (the weights import it
inside their functions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

# The clip range: read by several weights and by Clip-Cov's token selection, and set by presets and suites beside
# any weight, so it is never refused as unread (``unread_parameter``)
CLIP_RANGE = ("eps_low", "eps_high")


@dataclass(frozen=True)
class SurrogateInput:
    """What a weight's function reads of one (micro-)batch. N sequences, T token positions.

    logprobs:            [N, T] current policy, with gradient (garbage at masked positions)
    old_logprobs:        [N, T] the policy that sampled, frozen
    masked_logprobs:     [N, T] logprobs, 0 where ``mask`` is 0
    mask:                [N, T] 1 on policy-generated tokens, else 0
    advantages:          [N, 1] each sequence's advantage, or [N, T] each token's (on-policy distillation),
                         in the dtype of ``logprobs``
    sequence_advantages: [N]    each sequence's advantage as the batch gives it (its sign picks a side)
    ratio:               [N, T] w = exp(logp - logp_old) per token (1 where masked), or, for a weight whose
                         ``ratio`` is "sequence", s = exp(mean_t(logp - logp_old)) on each of its tokens
    folded_correction:   [N, T] log of the rollout correction's weight, for a weight that folds it in
                         (``Surrogate.folds_correction``); None without one
    """

    logprobs: Tensor
    old_logprobs: Tensor
    masked_logprobs: Tensor
    mask: Tensor
    advantages: Tensor
    sequence_advantages: Tensor
    ratio: Tensor
    folded_correction: Tensor | None = None


class SurrogateOutput(NamedTuple):
    """A weight's per-token loss [N, T] (to be minimised), the ratio it reports [N, T], and the bool [N, T] tokens
    whose gradient its clip cut below and above 1 (None: it cuts none; a smooth weight marks none)."""

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor | None = None
    clipped_high: Tensor | None = None


SurrogateFunction = Callable[..., SurrogateOutput]
"""``function(x: SurrogateInput, **fields) -> SurrogateOutput``, ``fields`` the ones the weight ``reads``."""


@dataclass(frozen=True)
class Surrogate:
    """One registered weight (see the module's docstring)."""

    name: str
    function: SurrogateFunction
    formula: str | Callable[..., str]
    summary: str
    reads: tuple[str, ...] = ()
    check: Callable[..., None] | None = None
    ratio: Literal["token", "sequence"] = "token"
    folds_correction: str | None = None
    clip_cov: bool = False

    def parameters(self, settings: object) -> dict[str, Any]:
        """The values of the fields this weight reads, taken from ``settings`` (an ``AlgorithmSpec``)."""
        return {name: getattr(settings, name) for name in self.reads}

    def formula_line(self, settings: object | None = None) -> str:
        """The weight's formula, as ``settings``' values of the fields it reads write it; without settings, with
        every such field at its default."""
        if not callable(self.formula):
            return self.formula
        return self.formula(**self.parameters(settings)) if settings is not None else self.formula()

    @property
    def reads_clip_range(self) -> bool:
        """Whether the weight reads ``eps_low`` or ``eps_high`` (``grpolab algorithms`` shows them beside it)."""
        return any(name in self.reads for name in CLIP_RANGE)


SURROGATES: dict[str, Surrogate] = {}
"""Every registered weight by name, in the order registered (``grpolab.objectives.surrogates`` imports them)."""


def register(
    name: str,
    *,
    formula: str | Callable[..., str],
    summary: str,
    reads: tuple[str, ...] = (),
    check: Callable[..., None] | None = None,
    ratio: Literal["token", "sequence"] = "token",
    folds_correction: str | None = None,
    clip_cov: bool = False,
) -> Callable[[SurrogateFunction], SurrogateFunction]:
    """Register the decorated ``function(x: SurrogateInput, **fields)`` as weight ``name``.

    formula: the loss per token in one line (w the token ratio, s the sequence ratio, A the advantage), or a
        function that writes it from the fields the weight reads (keyword arguments, each defaulting to its field's
        default) where a setting changes it
    summary: a few words for ``algorithm.weight``'s help
    reads: the ``AlgorithmSpec`` fields the function and ``check`` take as keyword arguments; any of them other
        than the clip range set away from its default under another weight is refused (``unread_parameter``)
    check: ``check(**fields)`` raises a one-line ValueError for values of those fields that cannot work together
    ratio: "sequence" when the weight has one ratio per sequence (``SurrogateInput.ratio``): token selection by
        covariance cannot pick its tokens
    folds_correction: the rollout correction the weight folds into its own weight (``SurrogateInput
        .folded_correction``) instead of having the loss multiplied by it; any other correction is refused
    clip_cov: Clip-Cov can detach its tokens (the weight is PPO's per-token clip)
    """

    def add(function: SurrogateFunction) -> SurrogateFunction:
        if name in SURROGATES:
            raise ValueError(f"weight {name!r} is registered twice")
        SURROGATES[name] = Surrogate(name, function, formula, summary, reads, check, ratio, folds_correction, clip_cov)
        return function

    return add


def get_surrogate(name: str) -> Surrogate:
    """The weight registered as ``name``; a ValueError naming the registered ones otherwise."""
    try:
        return SURROGATES[name]
    except KeyError:
        raise ValueError(f"unknown weight {name!r}; choose one of: {', '.join(SURROGATES)}") from None


def weights_that(can: Callable[[Surrogate], bool]) -> list[str]:
    """The names of the registered weights for which ``can`` holds, in registration order."""
    return [s.name for s in SURROGATES.values() if can(s)]


def readers_of(field: str) -> list[str]:
    """The registered weights that read the spec field ``field``, in registration order."""
    return weights_that(lambda s: field in s.reads)


def unread_parameter(weight: str, changed: Mapping[str, Any]) -> str | None:
    """The one-line refusal of a field set away from its default (``changed``: such fields and their values) that
    some weight reads and ``weight`` does not (the clip range aside: ``CLIP_RANGE``); None when there is none."""
    reads = get_surrogate(weight).reads
    for field, value in changed.items():
        readers = readers_of(field)
        if not readers or field in reads or field in CLIP_RANGE:
            continue
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return (
            f"{field} {shown} is read by weight {' or '.join(readers)} only; weight {weight} does not read it: "
            f"unset {field} or use weight {readers[0]}"
        )
    return None
