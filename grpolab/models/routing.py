"""Mixture-of-Experts routing: the routers of a transformers MoE model, what they chose in a forward, and
the router metrics of that choice.

The MoE families whose router layout is tested (``ROUTED_FAMILIES``: Qwen3-MoE, OLMoE, Mixtral) route through
one router module per layer whose forward takes the flattened hidden states [T, H] and returns
``(router_logits [T, E], routing weights [T, k], selected experts [T, k])``, the weights the softmax of the
logits at the top-k experts (renormalised where the router says so). ``RouterRecorder`` hooks those modules
and keeps what each returned; ``router_metrics`` summarises one layer's choice over the real (unpadded) tokens.
Other MoE families share the router's class-name suffix, not its layout (GraniteMoe returns ``(experts,
weights, logits)``, PhiMoE weighs by sparsemixer, Ernie-4.5 picks by bias-corrected probabilities):
``check_router_layout`` refuses them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = [
    "ROUTED_FAMILIES",
    "RouterRecorder",
    "RouterTally",
    "RoutingTable",
    "check_router_layout",
    "load_balancing_loss",
    "router_metrics",
    "router_sums",
    "routers",
]

# model_type -> its router class: the families whose router layout the metrics, the load-balancing loss and the
# routing replay are tested on (tests/test_moe.py)
ROUTED_FAMILIES = {"qwen3_moe": "Qwen3MoeTopKRouter", "olmoe": "OlmoeTopKRouter", "mixtral": "MixtralTopKRouter"}
# config fields by which a transformers family declares its experts
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's router modules, in layer order (empty for a dense model or an untested MoE family)."""
    names = set(ROUTED_FAMILIES.values())
    return [m for m in model.modules() if type(m).__name__ in names]


def check_router_layout(config, model: nn.Module | None = None) -> None:
    """Raise ValueError (one line) when a transformers ``config`` (and its ``model``, once loaded) is a
    Mixture-of-Experts family other than ``ROUTED_FAMILIES``: experts declared in the config, or a module whose
    class names a router or an MoE block. The config alone decides before any weight is read."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "")
    if model_type in ROUTED_FAMILIES:
        return
    declared = [f"{f} {v}" for f in EXPERT_FIELDS if isinstance(v := getattr(config, f, None), int) and v > 1]
    modules = sorted(
        {
            type(m).__name__
            for m in (model.modules() if model is not None else ())
            if "router" in type(m).__name__.lower() or "moe" in type(m).__name__.lower()
        }
    )
    if declared or modules:
        raise ValueError(
            f"{model_type}: a Mixture-of-Experts family whose router layout grpolab has not tested "
            f"({(declared or modules)[0]}); its router metrics, load-balancing loss and routing replay "
            f"would not be its own formula. Tested: {', '.join(ROUTED_FAMILIES)}"
        )


def router_sums(logits: Tensor, selected: Tensor, mask: Tensor, num_experts: int) -> Tensor:
    """What ``router_metrics`` needs of one layer's routing over the tokens where ``mask`` is set, as sums
    that add up over forwards: float64 [2E + 3] = (selections per expert [E], summed probability per expert
    [E], summed probability of the selected experts, summed entropy, tokens).

    logits: FloatTensor[T, E] the router's logits; selected: LongTensor[T, k] the experts it chose;
    mask: BoolTensor[T].
    """
    logits, selected = logits[mask].double(), selected[mask]
    probs = torch.softmax(logits, dim=-1)
    counts = torch.bincount(selected.reshape(-1), minlength=num_experts).double()
    confidence = probs.gather(1, selected).sum()
    entropy = -(probs * torch.log(probs.clamp_min(1e-300))).sum()
    return torch.cat([counts, probs.sum(0), torch.stack([confidence, entropy, probs.new_tensor(logits.shape[0])])])


def router_metrics(sums: Tensor) -> dict[str, float]:
    """One layer's router metrics from its ``router_sums`` (added over any number of forwards). With p =
    softmax(logits) over the E experts and f_e = the share of the selections that chose expert e:
      load_max_violation = max_e f_e / (1 / E) - 1 (0 when perfectly balanced);
      confidence = mean over tokens of the probability mass of the selected experts;
      entropy = mean over tokens of -sum_e p_e log p_e (nats);
      aux_loss = E * sum_e (c_e / T) * P_e, c_e = the selections of expert e, T = tokens, P_e = the mean of p_e
      (the Switch Transformer's load-balancing loss as transformers' ``load_balancing_loss_func`` computes it:
      k at perfect balance). Sums added over layers give that function's value over all layers.
    Also ``load``: the list of f_e. Empty when no token was routed."""
    num_experts = (sums.shape[0] - 3) // 2
    counts, prob_sum, (confidence, entropy, tokens) = sums[:num_experts], sums[num_experts:-3], sums[-3:]
    if tokens == 0:
        return {}
    load, mean_prob = counts / counts.sum(), prob_sum / tokens
    return {
        "load": load.tolist(),
        "load_max_violation": float(load.max() * num_experts - 1),
        "confidence": float(confidence / tokens),
        "entropy": float(entropy / tokens),
        "aux_loss": float(num_experts * (counts / tokens * mean_prob).sum()),
    }


def load_balancing_loss(logits: list[Tensor], selected: list[Tensor], masks: list[Tensor], num_experts: int) -> Tensor:
    """transformers' ``load_balancing_loss_func`` over the tokens where ``masks`` are set, differentiable in the
    logits: E * sum_e (c_e / R) * (sum of p_e / R) over every layer's rows R (R = layers x tokens), p = the
    float32 softmax of the logits, c_e = the selections of expert e (``selected``: those the layer used).
    logits: FloatTensor[T_i, E] per (layer, pass); selected: LongTensor[T_i, k] alike; masks: BoolTensor[T_i].
    Returns a 0-dim float32 tensor (0 when no token is masked in)."""
    counts = logits[0].new_zeros(num_experts, dtype=torch.float32)
    prob_sum, rows = torch.zeros_like(counts), counts.new_zeros(())
    for layer_logits, chosen, mask in zip(logits, selected, masks, strict=True):
        mask = mask.to(layer_logits.device)
        counts = counts + torch.bincount(chosen[mask].reshape(-1), minlength=num_experts).float()
        prob_sum = prob_sum + torch.softmax(layer_logits[mask], dim=-1, dtype=torch.float32).sum(0)
        rows = rows + mask.sum()
    rows = rows.clamp_min(1)  # no token: counts and probabilities are 0, so is the loss (read without a wait)
    return num_experts * (counts / rows * prob_sum / rows).sum()


@dataclass
class RouterRecorder:
    """Within ``record(model)``: each router's outputs of every forward, in call order per layer
    (``logits[layer]``, ``selected[layer]``: lists of [T, E] and [T, k] tensors; the logits detached unless
    ``with_grad``)."""

    logits: list[list[Tensor]] = field(default_factory=list)
    selected: list[list[Tensor]] = field(default_factory=list)
    with_grad: bool = False

    @contextlib.contextmanager
    def record(self, model: nn.Module):
        found = routers(model)
        self.logits, self.selected = [[] for _ in found], [[] for _ in found]

        def hook_for(layer: int):
            def hook(module, args, output):
                self.logits[layer].append(output[0] if self.with_grad else output[0].detach())
                self.selected[layer].append(output[2].detach())

            return hook

        handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(found)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


class RouterTally:
    """The router sums (``router_sums``) of every layer of ``model``, added over the forwards recorded with
    ``forward(masks)``: float64 [L, 2E + 3], kept on the model's device (read once, by ``metrics``). With
    ``balance``, each forward also leaves its load-balancing loss (``load_balancing_loss``, with its graph) times
    its counted tokens in ``balance_sum``."""

    def __init__(self, model: nn.Module, balance: bool = False):
        found = routers(model)
        self.model, self.num_experts, self.balance = model, int(found[0].num_experts), balance
        self.sums = torch.zeros(
            len(found), 2 * self.num_experts + 3, dtype=torch.float64, device=next(model.parameters()).device
        )
        self.balance_sum: Tensor | None = None

    @contextlib.contextmanager
    def forward(self, masks: list[Tensor]):
        """Record the forward run within it; the tokens where ``masks`` are set count (one BoolTensor per
        backbone pass, flattened as its routers see them, in pass order); its sums are added on leaving."""
        recorder = RouterRecorder(with_grad=self.balance)
        with recorder.record(self.model):
            yield
        for layer, (calls, chosen) in enumerate(zip(recorder.logits, recorder.selected)):
            for logits, selected, mask in zip(calls, chosen, masks, strict=True):
                self.sums[layer] += router_sums(logits.detach(), selected, mask.to(logits.device), self.num_experts).to(
                    self.sums.device
                )
        if self.balance:
            flat = lambda per_layer: [t for calls in per_layer for t in calls]  # noqa: E731
            tokens = sum(m.sum() for m in masks).to(self.sums.device)
            self.balance_sum = tokens * load_balancing_loss(
                flat(recorder.logits), flat(recorder.selected), masks * len(recorder.logits), self.num_experts
            )

    def metrics(self, total: Callable[[Tensor], Tensor] = lambda sums: sums) -> dict[str, float]:
        """``router/...`` step metrics from the sums, after ``total`` (e.g. a sum over the ranks): per layer the
        expert loads (a list, 6 decimals) and the worst expert-load violation, and over layers the worst
        violation, the mean confidence and entropy, and the load-balancing loss of all layers' rows (as the
        model's own ``load_balancing_loss_func``)."""
        per_layer = [router_metrics(s) for s in total(self.sums)]
        if not all(per_layer):  # no token routed
            return {}
        out = {f"router/layer{i}/load_max_violation": m["load_max_violation"] for i, m in enumerate(per_layer)}
        out |= {f"router/layer{i}/load": [round(f, 6) for f in m["load"]] for i, m in enumerate(per_layer)}
        out["router/load_max_violation"] = max(m["load_max_violation"] for m in per_layer)
        for key in ("confidence", "entropy"):
            out[f"router/{key}"] = sum(m[key] for m in per_layer) / len(per_layer)
        out["router/aux_loss"] = router_metrics(total(self.sums).sum(0))["aux_loss"]  # over all layers' rows
        return out


class RoutingTable:
    """The experts each router chose for each token of a batch [N, T] in the forward that computed its behaviour
    log-probs (Rollout Routing Replay's record), and what later forwards of that batch do with it.

    ``fill(routed)`` takes the engine's record, ``record(places)`` fills it from one forward; within
    ``attach(replay)`` every forward set up with ``at(places, counted)`` compares its live choices with the
    record (the routing mismatch, over the counted tokens) and, with ``replay``, routes each recorded token to
    its recorded experts: only the discrete choice is forced; the routing weights are the softmax of the live
    logits at those experts (renormalised where the router renormalises), so the router still gets its gradient.
    The hooks stay through the backward pass, so a recomputing (checkpointed) layer replays the same choice; only
    a forward's first pass over the layers counts.
    places: per backbone pass, (row, column, real) [tokens] (``UnitLayout.token_places``).
    """

    def __init__(self, model: nn.Module, shape: tuple[int, int]):
        self.routers = routers(model)
        device = next(model.parameters()).device
        self.top_k = int(self.routers[0].top_k)
        self.choices = torch.full((*shape, len(self.routers), self.top_k), -1, dtype=torch.long, device=device)
        self.differing = torch.zeros((), dtype=torch.float64, device=device)  # on the device: no wait per call
        self.compared = torch.zeros((), dtype=torch.float64, device=device)
        self._places: list[tuple[Tensor, Tensor, Tensor]] = []
        self._counted: list[Tensor] = []
        self._calls = [0] * len(self.routers)

    def _hooks(self, hook_for) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for layer, router in enumerate(self.routers):
            stack.callback(router.register_forward_hook(hook_for(layer)).remove)
        return stack

    def fill(self, routed: list[Tensor]) -> None:
        """The record made where the rows were generated: row i's tokens took the experts ``routed[i]`` [n_i, L, k]
        (-1: no record; ``Completion.routed_experts``)."""
        for row, experts in enumerate(routed):
            self.choices[row, : len(experts)] = experts.to(self.choices.device, torch.long)

    @contextlib.contextmanager
    def record(self, places: list[tuple[Tensor, Tensor, Tensor]]):
        """Within it, one forward whose backbone passes are ``places``: its choices at real tokens are kept."""
        calls = [0] * len(self.routers)

        def hook_for(layer: int):
            def hook(module, args, output):
                rows, cols, real = places[calls[layer]]
                calls[layer] += 1
                self.choices[rows[real], cols[real], layer] = output[2][real]

            return hook

        with self._hooks(hook_for):
            yield

    def at(self, places: list[tuple[Tensor, Tensor, Tensor]], counted: list[Tensor]) -> None:
        """The next forward's backbone passes, and the tokens of each whose mismatch counts."""
        self._places, self._counted, self._calls = places, counted, [0] * len(self.routers)

    @contextlib.contextmanager
    def attach(self, replay: bool):
        def hook_for(layer: int):
            def hook(module, args, output):
                logits, scores, live = output
                call = self._calls[layer]
                self._calls[layer] += 1
                rows, cols, real = self._places[call % len(self._places)]
                recorded = self.choices[rows, cols, layer]
                known = real & (recorded >= 0).all(-1)
                if call < len(self._places):  # the forward itself, not a checkpointed layer's recomputation
                    with torch.no_grad():
                        counted = known & self._counted[call].to(known.device)
                        differs = (live.sort(-1).values != recorded.sort(-1).values).any(-1) & counted
                        self.differing += differs.sum().to(self.differing.device)
                        self.compared += counted.sum().to(self.compared.device)
                if not replay:
                    return None
                forced = torch.where(known.unsqueeze(1), recorded, live)
                # the routers' softmax is float32 (float64 for a float64 model: its finite differences are exact)
                weights = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
                weights = weights.gather(1, forced)
                if getattr(module, "norm_topk_prob", True):  # Mixtral's router always renormalises
                    weights = weights / weights.sum(-1, keepdim=True)
                return logits, weights.to(torch.promote_types(scores.dtype, logits.dtype)), forced

            return hook

        with self._hooks(hook_for):
            yield self
