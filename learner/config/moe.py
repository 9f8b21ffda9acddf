"""What ``model.routing_replay`` cannot run with, checked when the config loads."""

from __future__ import annotations

from typing import Any

ROUTING_REPLAY = (
    "mixture-of-experts models: 'r3' routes each sampled sequence through the experts the "
    "rollout server chose for it (the server returns them), with the gate weights from the "
    "learner's router, so routing noise leaves the importance ratio; needs the transformers "
    "engine, single-turn rollouts, no recompute. 'r2': the learner's later passes "
    "(grpo.num_iterations > 1) route as its old-policy pass did (docs/options.md)"
)


def routing_replay_refusal(cfg: Any) -> str | None:
    """Why ``cfg`` (a ``LearnerConfig``) cannot replay routes as it asks; None: it can. r3's
    routes come from the transformers engine's server, one generation per sequence; r2's from
    the learner's old-policy pass, for later passes; both replay in the forward itself, not in
    a recompute or a compiled graph."""
    mode = cfg.model.routing_replay
    if mode == "off":
        return None
    r, why = cfg.rollout, None
    if mode == "r3" and cfg.environment is not None:
        why = "[environment] episodes span several generations, each routed apart"
    elif mode == "r3" and (
        r.server_api == "vllm" or (not r.external and r.embedded.engine == "vllm")
    ):
        why = "routing replay needs the transformers engine here (its server records routes)"
    elif mode == "r2" and cfg.grpo.num_iterations == 1:
        why = "r2 replays the old-policy pass's routes in later passes: it needs "
        why += "grpo.num_iterations > 1 (with one pass there is no later one)"
    elif cfg.model.gradient_checkpointing is True:
        why = "gradient checkpointing recomputes the forward in the backward, unreplayed"
    elif cfg.model.compile is True:
        why = "compiled decoder layers would not see the replayed routers"
    if why is None:
        return None
    fix = 'set model.routing_replay = "off" or change that setting'
    return f"model.routing_replay = {mode!r}: {why}; {fix}"
