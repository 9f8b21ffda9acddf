"""Parameter counts of mixture-of-experts decoders from their configs (Qwen3-MoE, Qwen2-MoE,
OLMoE, Mixtral), for the layout plan's memory estimates.

A sparse layer holds ``num_experts`` expert MLPs (gate, up and down projections of
``moe_intermediate_size``, or ``intermediate_size`` where the family has no separate width), a
router (``num_experts`` x hidden) and, in Qwen2-MoE, a shared expert with its sigmoid gate.
Qwen2/3-MoE keep dense MLPs (``intermediate_size``) in the layers ``mlp_only_layers`` names and
those ``decoder_sparse_step`` skips. A token runs ``num_experts_per_tok`` experts (plus the
shared one): that width, not the experts', sizes its activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeLayers:
    params: int  # all decoder layers: attention, norms, MLPs, experts and routers
    active_intermediate: int  # the MLP width a token runs through in a sparse layer


def num_experts(get: Callable[..., Any]) -> int:
    """The experts a sparse layer holds; 0 for a dense model."""
    return int(get("num_experts") or get("num_local_experts") or 0)


def moe_layers(get: Callable[..., Any], h: int, q: int, kv: int, hd: int) -> MoeLayers:
    """The decoder layers of the MoE config behind ``get`` (``num_experts(get) > 0``)."""
    experts = num_experts(get)
    top_k = int(get("num_experts_per_tok") or 1)
    family = get("model_type") or ""
    layers = int(get("num_hidden_layers"))
    dense_inter = int(get("intermediate_size"))
    expert_inter = int(get("moe_intermediate_size") or dense_inter)
    shared = int(get("shared_expert_intermediate_size") or 0)

    attention = 2 * h * q + 2 * h * kv
    if get("qkv_bias"):
        attention += q + 2 * kv
    if family == "olmoe":  # q/k norms over the whole projections
        attention += q + kv
    elif family.startswith("qwen3"):  # per-head q/k norms
        attention += 2 * hd
    sparse_mlp = experts * (3 * h * expert_inter + h) + (3 * h * shared + h if shared else 0)
    dense_mlp = 3 * h * dense_inter

    only_dense = set(get("mlp_only_layers") or [])
    step = int(get("decoder_sparse_step") or 1)
    total = 0
    for i in range(layers):
        sparse = i not in only_dense and (i + 1) % step == 0
        total += attention + 2 * h + (sparse_mlp if sparse else dense_mlp)
    return MoeLayers(total, top_k * expert_inter + shared)
