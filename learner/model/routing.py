"""Routing replay: the learner's forward routes each token through the experts the rollout server
chose for it when it sampled (``model.routing_replay = "r3"``).

A mixture-of-experts layer's router scores every expert (``logits = h @ W_router.T``) and keeps
the top k. Two engines computing the same weights in different kernels, batches or padding can
pick different experts where two scores nearly tie, and a token routed elsewhere has another
log-prob: the importance ratio then measures the routing, not the policy. ``replay_routes``
replaces, for the duration of one forward, each router's top-k *selection* by the recorded
experts, while the *gate weights* are still computed from the learner's own router logits (the
softmax probabilities at the recorded experts, renormalised over them where the model
normalises its top-k), so the router keeps its gradient.

Positions whose routes are ``-1`` (padding, the last token of a sequence, rows that came without
routes) route as the model would.

The routes come from the rollout server (``"r3"``: rollout routing replay, the experts that
sampled each token) or from the learner's own old-policy pass (``"r2"``: ``record_routes`` in
``learner.step.update.prepare_step``, replayed in the step's later passes).

The routers' load-balancing loss is not added (the learner never adds it: ``router_aux_loss_coef``
is unused in RL fine-tuning here); under replay it could not describe the routing anyway, as the
experts a token runs are the server's choice, not the learner's top-k.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from grpo_common.moe import find_routers

NO_ROUTE = -1


def _replayed_forward(router: Any, routes: torch.Tensor) -> Any:
    """A forward for ``router`` taking its top-k from ``routes`` (``[tokens, k]``, -1: own)."""
    normalise = getattr(router, "norm_topk_prob", True)  # Mixtral always normalises
    cast = hasattr(router, "norm_topk_prob")  # Qwen/OLMoE return weights in the logits' dtype

    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = hidden_states.reshape(-1, self.weight.shape[1])
        logits = F.linear(hidden, self.weight)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if routes.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"routing replay: the forward routes {hidden.shape[0]} tokens, the replayed "
                f"routes cover {routes.shape[0]}"
            )
        own = torch.topk(probs, self.top_k, dim=-1).indices  # [N, k]
        recorded = routes.to(own.device, torch.long)
        index = torch.where(recorded[:, :1] >= 0, recorded, own)
        weights = probs.gather(-1, index)
        if normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if cast:
            weights = weights.to(logits.dtype)
        return logits, weights, index

    return types.MethodType(forward, router)


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``model``'s routers take their top-k from ``routes``: ``[B, T, layers,
    k]`` expert indices aligned with the forward's ``input_ids`` ``[B, T]`` (-1: route as the
    model would). None: nothing is replayed."""
    if routes is None:
        yield
        return
    routers = find_routers(model)
    if len(routers) != routes.shape[2]:
        raise ValueError(
            f"routing replay: the routes have {routes.shape[2]} MoE layers, the model "
            f"{len(routers)} routers (routes from another model?)"
        )
    flat = routes.reshape(-1, routes.shape[2], routes.shape[3])  # [B*T, layers, k]
    for layer, router in enumerate(routers):
        if routes.shape[3] != router.top_k:
            raise ValueError(
                f"routing replay: the routes have k={routes.shape[3]}, the model routes "
                f"top-{router.top_k}"
            )
        router.forward = _replayed_forward(router, flat[:, layer])
    try:
        yield
    finally:
        for router in routers:
            del router.forward  # the class's forward again


def route_rows(
    rows: list[tuple[np.ndarray | None, int]], length: int, offsets: list[int] | None = None
) -> torch.Tensor | None:
    """The ``[B, T, layers, k]`` int16 routes of a micro-batch: ``rows`` holds each sequence's
    recorded routes (``[tokens, layers, k]``, covering its first tokens) and its length;
    ``offsets`` None: sequence i is row i (padded to ``length``); else every sequence sits in
    one packed row at ``offsets[i]``. None when no sequence has routes."""
    first = next((r for r, _ in rows if r is not None), None)
    if first is None:
        return None
    _, layers, k = first.shape
    num_rows = len(rows) if offsets is None else 1
    out = torch.full((num_rows, length, layers, k), NO_ROUTE, dtype=torch.int16)
    for i, (r, n) in enumerate(rows):
        if r is None:
            continue
        if r.shape[1:] != (layers, k) or r.shape[0] > n:
            raise ValueError(
                f"routing replay: a rollout's routes have shape {tuple(r.shape)} for a "
                f"sequence of {n} tokens ([<= tokens, {layers}, {k}] expected)"
            )
        row, start = (i, 0) if offsets is None else (0, offsets[i])
        out[row, start : start + r.shape[0]] = torch.from_numpy(r.astype(np.int16))
    return out


class RecordedRoutes:
    """The experts each router chose in the forwards run under ``record_routes``."""

    def __init__(self) -> None:
        self.layers: dict[int, torch.Tensor] = {}

    def routes(self, shape: torch.Size) -> torch.Tensor:
        """``[B, T, layers, k]`` int16 for a forward over ``input_ids`` of ``shape`` ``[B, T]``."""
        if not self.layers:
            raise ValueError("routing replay: no MoE router ran in the recorded forward")
        stacked = torch.stack([self.layers[i] for i in sorted(self.layers)], dim=1)
        return stacked.to(torch.int16).reshape(*shape, len(self.layers), -1)


@contextlib.contextmanager
def record_routes(model: torch.nn.Module) -> Iterator[RecordedRoutes]:
    """Within the block, keep the top-k experts every MoE router of ``model`` chooses (the
    last forward's, per layer)."""
    recorded = RecordedRoutes()

    def keep(layer: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            recorded.layers[layer] = output[2].detach()

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(find_routers(model))]
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()
