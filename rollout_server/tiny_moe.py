"""Tiny random-weight mixture-of-experts configs: Qwen3-MoE and OLMoE, for ``rollout_server.tiny``.

Both families route each token through ``num_experts_per_tok`` of ``num_experts`` expert MLPs
(each ``moe_intermediate_size`` wide for Qwen3-MoE, ``intermediate_size`` for OLMoE), chosen by
a linear router per layer; neither has shared experts. The defaults keep the dense tiny model's
attention (hidden 64, 2 layers) and give each layer 8 experts, 2 per token.

    python -m rollout_server.tiny /tmp/tiny-moe --moe qwen3_moe
    python -m rollout_server.tiny /tmp/tiny-olmoe --moe olmoe --experts 4
"""

from __future__ import annotations

from typing import Any

MOE_FAMILIES = ("qwen3_moe", "olmoe")

# Qwen3-30B-A3B's shape: 48 layers, 128 experts of 768, 8 per token (30.5B parameters, 3.3B
# active); ``--layers`` cuts it to what a GPU holds
QWEN3_30B_A3B_SHAPE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


def tiny_moe_config(
    family: str,
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    experts: int = 8,
    experts_per_token: int = 2,
    expert_intermediate: int = 32,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
    **overrides: Any,
) -> Any:
    """A transformers config of ``family`` (one of ``MOE_FAMILIES``). ``intermediate``: Qwen3-MoE's
    dense MLP width (layers ``mlp_only_layers`` names; none by default); ``expert_intermediate``:
    each expert's width (OLMoE's experts take ``intermediate_size``, so it is that there)."""
    from transformers import OlmoeConfig, Qwen3MoeConfig

    if experts_per_token > experts:
        raise ValueError(f"experts_per_token={experts_per_token} exceeds experts={experts}")
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "num_experts": experts,
        "num_experts_per_tok": experts_per_token,
    }
    if family == "qwen3_moe":
        fields |= {
            "head_dim": head_dim,
            "intermediate_size": intermediate,
            "moe_intermediate_size": expert_intermediate,
            "norm_topk_prob": True,
        }
        fields.update(overrides)
        return Qwen3MoeConfig(**fields)
    if family == "olmoe":
        fields |= {"intermediate_size": expert_intermediate, "norm_topk_prob": False}
        fields.update(overrides)
        return OlmoeConfig(**fields)
    raise ValueError(f"unknown MoE family {family!r}: choose one of {', '.join(MOE_FAMILIES)}")


def moe_model_class(family: str) -> Any:
    from transformers import OlmoeForCausalLM, Qwen3MoeForCausalLM

    return {"qwen3_moe": Qwen3MoeForCausalLM, "olmoe": OlmoeForCausalLM}[family]
