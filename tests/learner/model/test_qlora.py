"""QLoRA (issue 7): 4-bit bitsandbytes base weights under LoRA adapters, on CPU.

bitsandbytes runs its 4-bit kernels on CPU too, so the real quantized layers are exercised here:
only the adapters train, the reference is the quantized base, the servers get dequantized merged
weights under the base checkpoint's names, and checkpoints hold the adapter alone.
"""

from __future__ import annotations

import sys

import pytest
import torch

from learner.config import load_config
from learner.model.policy import PolicyLogprobs
from learner.model.setup import build_models
from learner.step.batch import collate
from learner.step.update import policy_forward
from learner.sync.tensors import merged_lora_weights, sync_specs

pytest.importorskip("bitsandbytes")  # in the dev extra: CI runs these

from tests.learner.model.policy_checks import assert_only_adapters_train, policy_loss
from tests.learner.rollout_data import random_rollouts

QLORA = ['data.path="x.jsonl"', 'rewards=[{name="length"}]', "model.lora.r=4"]


def _qlora(tiny_model_dir, *extra: str) -> PolicyLogprobs:
    cfg = load_config(None, [*QLORA, 'model.lora.quantization="nf4"', *extra])
    torch.manual_seed(0)
    policy, ref = build_models(cfg, str(tiny_model_dir))
    assert ref is None
    return policy


def test_qlora_trains_only_adapters_over_a_4bit_base(tiny_model_dir):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from learner.model.setup import bnb_4bit

    policy = _qlora(tiny_model_dir, "grpo.beta=0.1", "model.gradient_checkpointing=true")
    base = policy.model.get_base_model()
    linears = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 7 * base.config.num_hidden_layers  # q k v o gate up down
    batch = collate(random_rollouts(seed=2), pad_id=0)

    # The reference is the same quantized weights with the adapters off: no second model.
    plain = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=bnb_4bit("nf4", "float32"), dtype=torch.float32
    ).train()  # on CPU, bitsandbytes repacks 4-bit weights for its eval-mode kernel (bf16)
    with torch.no_grad():
        ref_lp = policy_forward(policy, batch, reference=True)[0]
        plain_lp = policy_forward(PolicyLogprobs(plain), batch)[0]
    torch.testing.assert_close(ref_lp, plain_lp, atol=1e-5, rtol=1e-5)

    assert all(p.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)
    assert_only_adapters_train(policy, batch)
    with torch.no_grad():
        assert not torch.allclose(policy_forward(policy, batch)[0], ref_lp)  # the adapters act


def test_qlora_sync_sends_dequantized_merged_weights_under_the_base_names(tiny_model_dir):
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM

    policy = _qlora(tiny_model_dir)
    with torch.no_grad():  # non-zero B, so every merge really adds a delta
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    originals = dict(full.named_parameters())
    merged = dict(merged_lora_weights(policy.model))
    assert list(merged) == [n for n, _ in full.named_parameters()]

    layer = policy.model.get_base_model().model.layers[1].self_attn.q_proj
    w = layer.base_layer.weight
    expected = F.dequantize_4bit(w.data, w.quant_state) + layer.get_delta_weight("default")
    torch.testing.assert_close(merged["model.layers.1.self_attn.q_proj.weight"], expected)
    layers = dict(policy.model.get_base_model().named_modules())
    for name, t in merged.items():  # less the delta, 4-bit: close to the checkpoint, not equal
        ref = originals[name].detach()
        assert t.shape == ref.shape and t.dtype == torch.float32 and not t.requires_grad, name
        owner = layers.get(name.removesuffix(".weight"))
        if hasattr(owner, "get_delta_weight"):
            t = t - owner.get_delta_weight("default").detach()
        err = float((t - ref).norm() / ref.norm())
        assert err < (0.15 if name.endswith("proj.weight") else 1e-6), (name, err)

    specs = sync_specs(policy.model, None)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [
        (n, "float32", list(t.shape)) for n, t in merged.items()
    ]
    assert {s.dtype for s in sync_specs(policy.model, "bfloat16")} == {"bfloat16"}


def test_adapter_only_checkpoint_round_trip(tmp_path, tiny_model_dir):
    from accelerate import Accelerator

    from learner.run.checkpoint import ADAPTER_DIR, adapter_only_checkpoints

    accelerator = Accelerator(cpu=True)
    policy = _qlora(tiny_model_dir)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    policy, opt = accelerator.prepare(policy, opt)
    assert adapter_only_checkpoints(accelerator, policy)
    batch = collate(random_rollouts(seed=4), pad_id=0)
    for _ in range(2):
        policy_loss(policy, batch).backward()
        opt.step()
        opt.zero_grad()
    saved = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    accelerator.save_state(str(tmp_path / "ckpt"), safe_serialization=True)

    files = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in files), files
    assert (tmp_path / "ckpt" / ADAPTER_DIR / "adapter_config.json").is_file()

    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(1.0)
    accelerator.load_state(str(tmp_path / "ckpt"))
    for n, p in policy.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), saved[n], atol=0, rtol=0, msg=n)

    # A checkpoint of another adapter shape is refused by name, not half-loaded.
    other = Accelerator(cpu=True)
    wrong = _qlora(tiny_model_dir, "model.lora.r=8")
    wrong_opt = torch.optim.AdamW([p for p in wrong.parameters() if p.requires_grad], lr=1e-2)
    wrong, wrong_opt = other.prepare(wrong, wrong_opt)
    adapter_only_checkpoints(other, wrong)
    with pytest.raises(Exception, match=r"size mismatch|does not fit"):
        other.load_state(str(tmp_path / "ckpt"))


def test_qlora_without_bitsandbytes_says_what_to_install(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'grpo-service\[qlora\]'"):
        _qlora(tiny_model_dir)


def test_qlora_quantization_is_checked_by_the_config():
    with pytest.raises(ValueError, match="quantization"):
        load_config(None, [*QLORA, 'model.lora.quantization="int3"'])
