"""What an MoE policy's routers chose while the hf engine generated: Rollout Routing Replay's record, made where
the behaviour log-probs are computed.

Every forward of a generation batch (the shared prefill's, the prefill's, each decoding step's) is announced with
``at(members, places)``: which batch rows each of its rows stands for (a shared prefix or a distinct prompt is
computed once for several rows) and the place of each of its tokens in its row's sequence (prompt then
completion; -1 on padding). The routers' hooks then write each token's chosen experts at those places.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from grpolab.models.routing import routers

__all__ = ["RoutingCapture"]


class RoutingCapture:
    """The experts each router chose for each token of a generation batch: ``choices`` int16 [B, S, L, k]
    (S = the longest prompt plus the new tokens; -1 where no forward computed the token, e.g. a row's last
    sampled token, which is never fed back)."""

    def __init__(self, model: nn.Module, rows: int, length: int, device: torch.device):
        self.routers = routers(model)
        top_k = int(self.routers[0].top_k)
        self.choices = torch.full((rows, length, len(self.routers), top_k), -1, dtype=torch.int16, device=device)
        self._targets: tuple[Tensor, Tensor, Tensor] | None = None

    def at(self, members: list[list[int]], places: Tensor) -> None:
        """The next forward: its row a stands for the batch rows ``members[a]``; ``places`` [A, C] (-1: padding)."""
        width, device = places.shape[1], places.device
        call_rows = torch.tensor([a for a, rows in enumerate(members) for _ in rows], dtype=torch.long, device=device)
        batch_rows = torch.tensor([r for rows in members for r in rows], dtype=torch.long, device=device)
        cols = places[call_rows]  # [M, C]
        real = cols >= 0
        tokens = call_rows[:, None] * width + torch.arange(width, device=device)  # index in the forward's [A * C]
        self._targets = (batch_rows[:, None].expand_as(cols)[real], cols[real], tokens[real])

    @contextlib.contextmanager
    def attach(self):
        """Within it, every router call writes its choices at the announced places."""

        def hook_for(layer: int):
            def hook(module, args, output):
                if self._targets is not None:
                    rows, cols, tokens = self._targets
                    self.choices[rows, cols, layer] = output[2][tokens].to(torch.int16)

            return hook

        with contextlib.ExitStack() as stack:
            for layer, router in enumerate(self.routers):
                stack.callback(router.register_forward_hook(hook_for(layer)).remove)
            yield self
