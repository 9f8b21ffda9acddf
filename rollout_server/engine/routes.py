"""Recording the experts a mixture-of-experts model routes each token through, while it decodes.

Forward hooks on the model's routers (``grpo_common.moe.find_routers``) keep the top-k expert
indices of every forward; the decode loop says which rows each forward ran (the prefill: each
distinct prompt, left-padded; a step: the active rows' last tokens), and ``RouteLog`` appends
them to those rows. A row's routes are then those of its prompt tokens and of every completion
token but the last: the tokens the learner's forward must route alike to score the completion.

The hooks live only while a batch with a row that asked for routes decodes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from grpo_common.moe import find_routers
from rollout_server.protocol.routes import RoutedExperts


class RouteLog:
    """The routes of the rows of one decode batch (``wanted[i]``: row i asked for them)."""

    def __init__(self, routers: list[Any], wanted: list[bool]) -> None:
        self.routers = routers
        self.num_experts = int(routers[0].num_experts)
        self.wanted = wanted
        self._layer: list[torch.Tensor | None] = [None] * len(routers)
        self._rows: list[list[torch.Tensor]] = [[] for _ in wanted]  # [tokens, layers, k] parts

    @contextlib.contextmanager
    def hooked(self) -> Iterator[RouteLog]:
        def keep(layer: int):
            def hook(module: Any, args: Any, output: Any) -> None:
                self._layer[layer] = output[2]  # [tokens, k] expert indices

            return hook

        handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _taken(self) -> torch.Tensor:
        """The last forward's indices, ``[tokens, layers, k]`` int16 on the CPU."""
        if any(t is None for t in self._layer):
            raise RuntimeError("a router did not run in the last forward")
        routes = torch.stack([t for t in self._layer if t is not None], dim=1)
        self._layer = [None] * len(self.routers)
        return routes.to("cpu", torch.int16)

    def prefill(self, row_prompt: list[int], prompt_lens: list[int], width: int) -> None:
        """After the prefill of the distinct prompts (left-padded to ``width``); row i's prompt
        is ``row_prompt[i]``."""
        routes = self._taken().reshape(len(prompt_lens), width, len(self.routers), -1)
        for i, u in enumerate(row_prompt):
            if self.wanted[i]:
                self._rows[i].append(routes[u, width - prompt_lens[u] :])

    def step(self, active: list[int]) -> None:
        """After a decode step that fed one token of each row in ``active``."""
        routes = self._taken()  # [A, layers, k]
        for j, i in enumerate(active):
            if self.wanted[i]:
                self._rows[i].append(routes[j : j + 1])

    def of(self, i: int) -> RoutedExperts | None:
        """Row i's ``[tokens, layers, k]`` routes, encoded; None if it did not ask for them."""
        if not self.wanted[i]:
            return None
        return RoutedExperts.encode(torch.cat(self._rows[i]).numpy(), self.num_experts)


def route_log(model: Any, wanted: list[bool]) -> RouteLog | None:
    """A log for a batch whose rows ``wanted`` routes; None when none did."""
    if not any(wanted):
        return None
    routers = find_routers(model)
    if not routers:
        raise ValueError(
            "return_routed_experts: the served model has no mixture-of-experts routers"
        )
    return RouteLog(routers, wanted)
