"""The routers of a Hugging Face mixture-of-experts model, found by their shape.

transformers (5.x) gives Qwen2/3-MoE, OLMoE and Mixtral one router form: a module with a
``weight`` of ``[num_experts, hidden]`` and ``top_k``, whose forward maps hidden states to
``(router_logits, top-k weights, top-k expert indices)``. The rollout server records the indices
its routers choose; the learner replays them. Both find the routers here, in layer order.
"""

from __future__ import annotations

from typing import Any


def is_router(module: Any) -> bool:
    return (
        type(module).__name__.endswith("TopKRouter")
        and hasattr(module, "top_k")
        and hasattr(module, "num_experts")
        and getattr(module, "weight", None) is not None
    )


def find_routers(model: Any) -> list[Any]:
    """The model's MoE routers in layer order (``named_modules`` order); [] for a dense model."""
    return [m for _, m in model.named_modules() if is_router(m)]
