"""The training layout's plan: model sizes counted from configs, the choices it makes for
model, batch and GPU, and its application to accelerate's DeepSpeed plugin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from learner.config import load_config
from learner.config.deepspeed import DeepSpeedConfig
from learner.model.layout import tokens_per_micro_batch
from learner.model.plan import GIB, ModelSize, plan_training, state_bytes
from rollout_server.tiny import QWEN3_0_6B_SHAPE, QWEN3_4B_SHAPE

DEMO = Path(__file__).parents[3] / "learner/configs/demo.toml"
H200 = 0.9 * 141 * GIB  # the default budget of an H200: 90 % of its memory


@pytest.mark.parametrize("shape", [QWEN3_0_6B_SHAPE, QWEN3_4B_SHAPE])
def test_parameters_counted_from_the_config_equal_the_model_s(shape: dict) -> None:
    config = Qwen3Config(**shape)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    counted = sum(p.numel() for p in model.parameters())  # tied head counted once
    assert ModelSize.of(config).params == counted
    assert ModelSize.of(config.to_dict()).params == counted


def test_state_bytes_per_stage() -> None:
    # 1e9 parameters on 4 GPUs: ZeRO-3 splits all 16 bytes, ZeRO-2 keeps the bf16 weights whole
    assert state_bytes(10**9, 3, 4) == 4e9
    assert state_bytes(10**9, 2, 4) == 2e9 + 3.5e9
    assert state_bytes(10**9, None, 1) == 8e9


def test_a_4b_model_on_four_h200s_trains_under_zero2_without_recompute() -> None:
    size = ModelSize.of(Qwen3Config(**QWEN3_4B_SHAPE))
    plan = plan_training(
        size, tokens_per_micro_batch=32 * 288, world=4, launch_stage=3, budget_bytes=H200
    )
    assert (plan.zero_stage, plan.gradient_checkpointing) == (2, False)
    # the estimate against the peak measured for this workload without recompute: 84 GiB for
    # plain bf16 weights and gradients (16 GB) and the activations; ours adds the sharded
    # fp32 states of ZeRO-2 (14 bytes x 4e9 / 4 = 14 GB) and 4 GiB of overhead
    acts = size.activation_bytes_per_token(False) * 32 * 288 / GIB
    assert 50 < acts < 65, acts


def test_longer_batches_turn_recompute_on_then_zero3() -> None:
    size = ModelSize.of(Qwen3Config(**QWEN3_4B_SHAPE))

    def plan(tokens: int, world: int = 4):
        p = plan_training(
            size, tokens_per_micro_batch=tokens, world=world, launch_stage=3, budget_bytes=H200
        )
        return p.zero_stage, p.gradient_checkpointing

    assert plan(32 * 288) == (2, False)
    assert plan(32 * 1024) == (2, True)  # 200+ GiB of activations: recompute
    # a 32B model's states under ZeRO-2 over 4 GPUs (2P + 14P/4 = 176 GB) do not fit: ZeRO-3
    big = ModelSize(params=32 * 10**9, layers=64, hidden=5120, intermediate=25600,
                    q_dim=8192, kv_dim=1024)  # fmt: skip
    p = plan_training(big, tokens_per_micro_batch=4096, world=4, launch_stage=3, budget_bytes=H200)
    assert p.zero_stage == 3
    # a 14B model's (28 + 49 GB) do
    mid = ModelSize(params=14 * 10**9, layers=40, hidden=5120, intermediate=17408,
                    q_dim=5120, kv_dim=1024)  # fmt: skip
    p = plan_training(mid, tokens_per_micro_batch=4096, world=4, launch_stage=3, budget_bytes=H200)
    assert p.zero_stage == 2


def test_settings_by_hand_and_the_launch_win() -> None:
    size = ModelSize.of(Qwen3Config(**QWEN3_4B_SHAPE))
    kw = {"tokens_per_micro_batch": 32 * 288, "world": 4, "budget_bytes": H200}
    assert plan_training(size, launch_stage=3, want_stage="launch", **kw).zero_stage == 3
    assert plan_training(size, launch_stage=3, want_stage=3, **kw).zero_stage == 3
    assert plan_training(size, launch_stage=3, offload=True, **kw).zero_stage == 3
    assert plan_training(size, launch_stage=None, **kw).zero_stage is None
    assert plan_training(size, launch_stage=3, want_checkpointing=True, **kw).gradient_checkpointing
    # no GPU (the CPU): nothing to fit, no recompute
    cpu = plan_training(size, launch_stage=None, tokens_per_micro_batch=10**6, world=1,
                        budget_bytes=None)  # fmt: skip
    assert cpu.gradient_checkpointing is False
    # nothing fits: the leanest layout, and the message says what to lower
    tight = plan_training(size, launch_stage=3, tokens_per_micro_batch=10**6, world=4,
                          budget_bytes=10 * GIB)  # fmt: skip
    assert (tight.zero_stage, tight.gradient_checkpointing) == (3, True)
    assert "grpo.micro_batch_size" in tight.describe()


def test_tokens_per_micro_batch_follow_the_batch_settings() -> None:
    cfg = load_config(DEMO, ["grpo.micro_batch_size=8", "sampling.max_tokens=256",
                             "grpo.max_prompt_tokens=64"])  # fmt: skip
    assert tokens_per_micro_batch(cfg) == 8 * (64 + 256)
    packed = load_config(DEMO, ["grpo.packing=true", "grpo.max_tokens_per_micro_batch=8192"])
    assert tokens_per_micro_batch(packed) == 8192


def test_apply_zero_lowers_zero3_for_transformers_too() -> None:
    pytest.importorskip("deepspeed", reason="the deepspeed extra (run where it is installed)")
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from learner.model.layout import apply_zero

    ds = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    try:
        ds.set_deepspeed_weakref()
        assert is_deepspeed_zero3_enabled()
        apply_zero(ds, 3, DeepSpeedConfig())  # stays 3: the bucket sizes set
        zero = ds.deepspeed_config["zero_optimization"]
        assert zero["stage3_prefetch_bucket_size"] == DeepSpeedConfig().prefetch_bucket_size
        apply_zero(ds, 2, DeepSpeedConfig())
        assert ds.zero_stage == 2 and zero["stage"] == 2 and not ds.zero3_init_flag
        assert not is_deepspeed_zero3_enabled()  # from_pretrained builds the whole model
    finally:
        unset_hf_deepspeed_config()


def test_compiled_layers_where_the_layout_allows_them() -> None:
    from types import SimpleNamespace

    from learner.model.layout import compile_layers
    from learner.model.plan import Plan

    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    cpu = SimpleNamespace(device=torch.device("cpu"))

    def decide(acc: SimpleNamespace, stage: int | None, *sets: str) -> bool:
        return compile_layers(acc, load_config(DEMO, list(sets)), Plan(stage, False, 0.0, None))

    assert decide(gpu, 2) and decide(gpu, None)  # ZeRO-2, or no DeepSpeed
    assert not decide(gpu, 3)  # ZeRO-3's gather hooks
    assert not decide(cpu, None)  # the CPU: compilation costs more than it saves
    assert not decide(gpu, 2, "model.lora.quantization=nf4")  # QLoRA's 4-bit base
    assert not decide(gpu, 2, "model.compile=false")
    assert decide(cpu, None, "model.compile=true")  # asked for: always
