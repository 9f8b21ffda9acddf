"""The tiny random mixture-of-experts models: built offline, loaded like hub models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_server.tiny import save_tiny_model


@pytest.mark.parametrize(("family", "arch"), [("qwen3_moe", "Qwen3MoeForCausalLM"),
                                              ("olmoe", "OlmoeForCausalLM")])  # fmt: skip
def test_a_tiny_moe_loads_and_routes_each_token_to_top_k_of_its_experts(
    tmp_path: Path, family: str, arch: str
) -> None:
    path = save_tiny_model(tmp_path / family, moe=family, experts=4, experts_per_token=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == arch
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("hello")])
    out = model(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == model.config.num_hidden_layers
    assert out.router_logits[0].shape == (ids.shape[1], 4)
    assert torch.isfinite(out.logits).all()


def test_the_cli_builds_a_moe(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    cmd = [sys.executable, "-m", "rollout_server.tiny", str(out), "--moe", "qwen3_moe",
           "--experts", "6", "--experts-per-token", "3"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts_per_tok"] == 3
    assert config.get("num_experts", config.get("num_local_experts")) == 6


def test_more_experts_per_token_than_experts_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="experts_per_token=3 exceeds experts=2"):
        save_tiny_model(tmp_path, moe="olmoe", experts=2, experts_per_token=3)
