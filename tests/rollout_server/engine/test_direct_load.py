"""Direct weight copies into vLLM-shaped parameters (``rollout_server.engine.direct_load``).

The parameters here have vLLM's Qwen3 layout (fused ``qkv_proj`` and ``gate_up_proj``, the tied
``lm_head`` folded into ``embed_tokens``) built from a real tiny Qwen3's checkpoint tensors. The
GPU test ``tests/gpu/test_nccl_sync.py`` checks the same plan against vLLM's own loader.
"""

from __future__ import annotations

import pytest
import torch

from rollout_server.engine.direct_load import copy_in, plan_copies, verify
from rollout_server.tiny import tiny_qwen3_config
from rollout_server.weight_digest import COMMON_PACKED

PACKED = COMMON_PACKED
STACKED = [(f, p) for f, parts in PACKED.items() for p in parts]


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=300))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def vllm_params(ckpt: dict[str, torch.Tensor], pad_vocab_to: int = 0) -> dict[str, torch.Tensor]:
    """Zeroed parameters named and shaped as vLLM's Qwen3 (the loader's target)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in ckpt.items():
        if name == "lm_head.weight":
            continue  # tied: vLLM's lm_head is embed_tokens
        for fused, part in STACKED:
            if f".{part}." in name:
                fused_name = name.replace(f".{part}.", f".{fused}.")
                parts = [ckpt[name.replace(f".{part}.", f".{p}.")] for p in PACKED[fused]]
                out[fused_name] = torch.zeros(sum(p.shape[0] for p in parts), *t.shape[1:])
                break
        else:
            rows = max(t.shape[0], pad_vocab_to) if "embed_tokens" in name else t.shape[0]
            out[name] = torch.zeros(rows, *t.shape[1:]) if t.dim() else torch.zeros(())
    return out


def reference_load(params: dict[str, torch.Tensor], ckpt: dict[str, torch.Tensor]) -> None:
    """What vLLM's Qwen3 ``load_weights`` does at TP=1: parts into their rows, in order."""
    for name, t in ckpt.items():
        for fused, part in STACKED:
            if f".{part}." in name:
                parts = PACKED[fused]
                start = sum(
                    ckpt[name.replace(f".{part}.", f".{p}.")].shape[0]
                    for p in parts[: parts.index(part)]
                )
                params[name.replace(f".{part}.", f".{fused}.")][start : start + len(t)] = t
                break
        else:
            if name in params:
                params[name][: t.shape[0]] = t


def layout(ckpt: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(n, tuple(t.shape), t.dtype) for n, t in ckpt.items()]


@pytest.mark.parametrize("pad", [0, 320])
def test_plan_copies_like_vllms_loader(checkpoint, pad):
    ckpt = {n: t + 1.0 for n, t in checkpoint.items()}  # no row equals a zeroed one
    ckpt["lm_head.weight"] = ckpt["model.embed_tokens.weight"]
    params = vllm_params(ckpt, pad_vocab_to=pad)
    plan = plan_copies(params, layout(ckpt), PACKED, skip=frozenset({"lm_head.weight"}))
    assert not isinstance(plan, str), plan
    expected = vllm_params(ckpt, pad_vocab_to=pad)
    reference_load(expected, ckpt)
    copy_in(plan, list(ckpt.values()))
    for name, want in expected.items():
        assert torch.equal(params[name], want), name
    # and vLLM's loader having done the same, the plan verifies
    assert verify(plan, list(ckpt.values())) is None


def test_verify_refuses_a_plan_that_disagrees_with_the_loader(checkpoint):
    ckpt = dict(checkpoint)
    params = vllm_params(ckpt)
    # a model whose loader puts v before k: the same shapes, a different layout
    swapped = {"qkv_proj": ["q_proj", "v_proj", "k_proj"], "gate_up_proj": PACKED["gate_up_proj"]}
    plan = plan_copies(params, layout(ckpt), swapped, skip=frozenset({"lm_head.weight"}))
    assert not isinstance(plan, str)
    reference_load(params, ckpt)
    problem = verify(plan, list(ckpt.values()))
    assert problem is not None and "not where the plan puts it" in problem


def test_verify_refuses_a_loader_that_kept_the_tensor_itself(checkpoint):
    ckpt = {"model.norm.weight": checkpoint["model.norm.weight"].clone()}
    params = {"model.norm.weight": ckpt["model.norm.weight"]}  # aliased, not copied
    plan = plan_copies(params, layout(ckpt), PACKED)
    assert not isinstance(plan, str)
    assert "no copy" in (verify(plan, list(ckpt.values())) or "")


def test_no_plan_names_the_tensor_that_cannot_be_placed(checkpoint):
    ckpt = dict(checkpoint)
    params = vllm_params(ckpt)
    skip = frozenset({"lm_head.weight"})
    tied = [*layout(ckpt), ("lm_head.weight", tuple(ckpt["model.embed_tokens.weight"].shape),
                            torch.float32)]  # fmt: skip
    assert "lm_head.weight" in plan_copies(params, tied, PACKED)  # not skipped as tied

    k = "model.layers.0.self_attn.k_proj.weight"
    no_sibling = [x for x in layout(ckpt) if x[0] != k]
    reason = plan_copies(params, no_sibling, PACKED, skip=skip)
    assert isinstance(reason, str) and k in reason

    wrong_shape = [(n, (s[0] + 1, *s[1:]) if "o_proj" in n else s, d) for n, s, d in layout(ckpt)]
    reason = plan_copies(params, wrong_shape, PACKED, skip=skip)
    assert isinstance(reason, str) and "o_proj" in reason and "shape" in reason

    as_half = [(n, s, torch.float16) for n, s, _ in layout(ckpt)]
    reason = plan_copies(params, as_half, PACKED, skip=skip)
    assert isinstance(reason, str) and "float16" in reason

    twice = [*layout(ckpt), ("model.norm.weight", tuple(ckpt["model.norm.weight"].shape),
                             torch.float32)]  # fmt: skip
    reason = plan_copies(params, twice, PACKED, skip=skip)
    assert isinstance(reason, str) and "overlap" in reason

    partial = [x for x in layout(ckpt) if x[0] != "model.norm.weight"]
    reason = plan_copies(params, partial, PACKED, skip=skip)
    assert isinstance(reason, str) and "leaves out 1" in reason and "model.norm.weight" in reason

    unknown = [*layout(ckpt), ("model.extra.weight", (4,), torch.float32)]
    reason = plan_copies(params, unknown, PACKED, skip=skip)
    assert isinstance(reason, str) and "model.extra.weight" in reason
