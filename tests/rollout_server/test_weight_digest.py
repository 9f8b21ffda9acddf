"""The weights' digest (``GET /weights/checksum``, the sync checksums) sees weights in the wrong
place: two layers' same-shape tensors swapped, or a tensor's elements permuted, change it; the
same weights give the same bits; vLLM's fused layout gives the learner's number; and a real
server reports the digest the learner computes for the weights it pushed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout_server.client import RolloutClient
from rollout_server.settings import ServerSettings
from rollout_server.weight_digest import named_checksum, params_checksum

UP0 = "model.layers.0.mlp.up_proj.weight"
UP1 = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _swapped(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(named)
    out[UP0], out[UP1] = named[UP1], named[UP0]
    return out


def test_swapping_two_layers_same_shape_tensors_changes_it(hf_model) -> None:
    named = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    assert named[UP0].shape == named[UP1].shape and not torch.equal(named[UP0], named[UP1])
    assert named_checksum(_swapped(named).items()) != pytest.approx(
        named_checksum(named.items()), rel=1e-9
    )


def test_permuting_a_tensors_elements_changes_it(hf_model) -> None:
    named = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    before = named_checksum(named.items())
    for permuted in (named[UP0].flip(0), named[UP0].t().contiguous().reshape(named[UP0].shape)):
        assert named_checksum({**named, UP0: permuted}.items()) != pytest.approx(before, rel=1e-9)
    row_swapped = named[UP0].clone()
    row_swapped[[0, 1]] = row_swapped[[1, 0]]
    assert named_checksum({**named, UP0: row_swapped}.items()) != pytest.approx(before, rel=1e-9)


def test_the_same_weights_give_the_same_bits(hf_model, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert params_checksum(again) == params_checksum(hf_model)
    named = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    assert named_checksum(reversed(list(named.items()))) == params_checksum(hf_model)


def test_vllms_fused_layout_gives_the_learners_number(hf_model) -> None:
    """q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, the vocabulary padded
    with zero rows: what vLLM's ``named_parameters`` look like. A fused parameter with its
    parts in the wrong order is seen."""
    named = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    fused: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if ".q_proj." in name:
            parts = [
                named[name.replace(".q_proj.", f".{p}.")] for p in ("q_proj", "k_proj", "v_proj")
            ]
            fused[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(parts)
        elif ".gate_proj." in name:
            parts = [named[name.replace(".gate_proj.", f".{p}.")] for p in ("gate_proj", "up_proj")]
            fused[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(parts)
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            fused[name] = t
    embed = "model.embed_tokens.weight"
    fused[embed] = torch.cat([named[embed], torch.zeros(64, named[embed].shape[1])])
    assert len(fused) < len(named)
    learner = params_checksum(hf_model)
    assert named_checksum(fused.items()) == pytest.approx(learner, rel=1e-12)
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    gate, up = fused[gate_up].chunk(2)
    wrong = {**fused, gate_up: torch.cat([up, gate])}
    assert named_checksum(wrong.items()) != pytest.approx(learner, rel=1e-9)


async def test_a_server_reports_the_digest_of_the_weights_pushed(
    start_server, tiny_model_dir, hf_model
) -> None:
    """Push the checkpoint with two layers' ``up_proj`` swapped: the served digest is the
    learner's digest of the swapped weights, not of the checkpoint it started from."""
    state = load_file(tiny_model_dir / "model.safetensors")
    swapped = _swapped(state)
    learner_model = type(hf_model)(hf_model.config).eval()
    learner_model.load_state_dict(swapped, strict=False)
    learner_model.tie_weights()
    want = params_checksum(learner_model)
    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        async with RolloutClient(server.url, max_retries=0) as client:
            (before,) = await client.weights_checksum()
            assert before.checksum == pytest.approx(params_checksum(hf_model), rel=1e-9)
            (resp,) = await client.update_weights(swapped.items(), bucket_bytes=64 * 1024)
            (after,) = await client.weights_checksum()
    assert after.weight_version == resp.weight_version
    assert after.checksum == pytest.approx(want, rel=1e-9)
    assert after.checksum != pytest.approx(before.checksum, rel=1e-9)
