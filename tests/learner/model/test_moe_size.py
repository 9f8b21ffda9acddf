"""Mixture-of-experts parameter counts from configs, against the models transformers builds."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from learner.model.plan import ModelSize
from rollout_server.tiny_moe import QWEN3_30B_A3B_SHAPE

SMALL = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_experts_per_tok": 2}  # fmt: skip

CASES = {
    "qwen3-30b-a3b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_30B_A3B_SHAPE),
    "qwen3-moe dense layers": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {
            **SMALL,
            "num_experts": 6,
            "moe_intermediate_size": 24,
            "intermediate_size": 96,
            "head_dim": 16,
            "mlp_only_layers": [0],
            "decoder_sparse_step": 2,
        },
    ),
    "olmoe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        {**SMALL, "num_experts": 8, "intermediate_size": 32, "tie_word_embeddings": True},
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        {**SMALL, "num_local_experts": 4, "intermediate_size": 48},
    ),
    "qwen2-moe shared expert": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {
            **SMALL,
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "intermediate_size": 80,
            "shared_expert_intermediate_size": 40,
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_parameters_counted_from_the_config_equal_the_model_s(case: str) -> None:
    config_class, model_class, fields = CASES[case]
    config = config_class(**fields)
    with torch.device("meta"):
        model = model_class(config)
    counted = sum(p.numel() for p in model.parameters())
    assert ModelSize.of(config).params == counted
    assert ModelSize.of(config.to_dict()).params == counted


def test_a_token_s_activations_are_sized_by_the_experts_it_runs() -> None:
    size = ModelSize.of(Qwen3MoeConfig(**QWEN3_30B_A3B_SHAPE))
    assert size.intermediate == 8 * 768  # top-8 experts of 768, not the dense 6144
    assert 30.0e9 < size.params < 31.0e9  # Qwen3-30B-A3B: 30.5B
