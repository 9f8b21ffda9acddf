"""A full weight update into a LoRA-enabled vLLM model (``--enable-lora``).

vLLM's LoRA support replaces every layer an adapter may target by a wrapper that holds the layer
as ``base_layer``, so ``gate_up_proj.weight`` becomes ``gate_up_proj.base_layer.weight``; the
model's own ``load_weights`` looks parameters up by checkpoint names and failed with
``KeyError: 'layers.0.mlp.gate_up_proj.weight'`` (seen on an H100 in
``tests/gpu/test_vllm_lora_adapter.py``). Here the same layout in plain torch modules: a wrapped
layer, a plain one, and a ``load_weights`` that looks names up as vLLM's models do.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollout_server.engine.worker_loader import (
    checkpoint_name,
    checkpoint_names,
    checkpoint_parameters,
)


class WithLoRA(nn.Module):
    """The shape of vLLM's ``BaseLayerWithLoRA``: the layer as ``base_layer``, adapters beside."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_a_stacked = torch.zeros(1, 2, 4)  # a plain tensor, as in vLLM


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = WithLoRA(nn.Linear(4, 8, bias=False))
        self.norm = nn.LayerNorm(4)  # not a LoRA target: not wrapped

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return {name for name, _ in weights}


def test_a_full_update_loads_into_the_wrapped_layers_base() -> None:
    block = Block()
    update = [("gate_up_proj.weight", torch.ones(8, 4)), ("norm.weight", torch.full((4,), 2.0))]
    with pytest.raises(KeyError, match=r"gate_up_proj\.weight"):
        block.load_weights(update)  # what the server did before
    with torch.no_grad(), checkpoint_names(block):
        block.load_weights(update)
    assert torch.equal(block.gate_up_proj.base_layer.weight, torch.ones(8, 4))
    assert torch.equal(block.norm.weight, torch.full((4,), 2.0))
    # only for the load: the model lists its own names again afterwards
    assert "gate_up_proj.base_layer.weight" in dict(block.named_parameters())
    assert not any("named_parameters" in m.__dict__ for m in block.modules())


def test_checkpoint_names_of_a_model_without_lora_are_its_own() -> None:
    plain = nn.Sequential(nn.Linear(2, 2))
    with checkpoint_names(plain):
        assert not any("named_parameters" in m.__dict__ for m in plain.modules())
    assert checkpoint_name("layers.0.self_attn.qkv_proj.base_layer.weight") == (
        "layers.0.self_attn.qkv_proj.weight"
    )
    assert checkpoint_name("base_layer.weight") == "weight"
    assert checkpoint_name("layers.0.my_base_layer.weight") == "layers.0.my_base_layer.weight"
    params = checkpoint_parameters(Block())
    assert set(params) == {"gate_up_proj.weight", "norm.weight", "norm.bias"}
