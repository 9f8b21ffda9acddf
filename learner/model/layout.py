"""The run's training layout applied before its model is built: ``learner.model.plan`` chooses
the ZeRO stage and gradient checkpointing, this module reads what the plan needs (the model's
config, the launch, the GPU) and applies the choice to the launch's DeepSpeed config.

The stage must be settled before the model loads: under ZeRO-3 ``from_pretrained`` builds the
model already partitioned (``zero3_init_flag``), which transformers learns from the DeepSpeed
config accelerate registers with it; so that registration is redone for the chosen stage.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from learner.config import LearnerConfig
from learner.config.deepspeed import DeepSpeedConfig
from learner.model.plan import GIB, ModelSize, Plan, plan_training

log = logging.getLogger(__name__)

ASSUMED_PROMPT_TOKENS = 512  # without grpo.max_prompt_tokens: the prompt length planned for


def tokens_per_micro_batch(cfg: LearnerConfig) -> int:
    """The most tokens one micro-batch may hold: its activations set the step's peak."""
    g = cfg.grpo
    longest = (g.max_prompt_tokens or ASSUMED_PROMPT_TOKENS) + cfg.sampling.max_tokens
    if g.packing:
        return max(g.max_tokens_per_micro_batch, longest)
    return g.micro_batch_size * longest


def budget_bytes(acc: Accelerator, cfg: LearnerConfig) -> float | None:
    """GPU memory the plan may fill: ``model.memory_budget_gb``, else 90 % of the GPU."""
    if acc.device.type != "cuda":
        return None
    if cfg.model.memory_budget_gb is not None:
        return cfg.model.memory_budget_gb * GIB
    return 0.9 * torch.cuda.get_device_properties(acc.device).total_memory


def model_config(model_path: str) -> dict[str, Any]:
    """The model's ``config.json`` (its text model's, for a multimodal one)."""
    local = Path(model_path) / "config.json"
    if local.is_file():
        config = json.loads(local.read_text())
    else:  # a hub id: the copy from_pretrained reads
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path).to_dict()
    return config.get("text_config") or config


def _offloads(ds: Any) -> bool:
    devices = (ds.offload_optimizer_device, ds.offload_param_device)
    return any(d not in (None, "none") for d in devices)


def plan_layout(acc: Accelerator, cfg: LearnerConfig, model_path: str) -> Plan:
    """Choose the layout for this run (logged), and set the DeepSpeed config to it."""
    ds = acc.state.deepspeed_plugin
    try:
        size = ModelSize.of(model_config(model_path))
    except ValueError as e:  # an architecture the estimates do not know: the safe choices
        stage = ds.zero_stage if ds is not None else None
        gc = cfg.model.gradient_checkpointing is not False
        log.warning("training layout not planned (%s): the launch's stage, recompute %s", e, gc)
        return Plan(stage, gc, 0.0, None, ["not planned"])
    plan = plan_training(
        size,
        tokens_per_micro_batch=tokens_per_micro_batch(cfg),
        world=acc.num_processes,
        launch_stage=ds.zero_stage if ds is not None else None,
        budget_bytes=budget_bytes(acc, cfg),
        want_stage=cfg.deepspeed.zero_stage,
        want_checkpointing=cfg.model.gradient_checkpointing,
        offload=ds is not None and _offloads(ds),
    )
    if cfg.model.compile is True and plan.zero_stage == 3:
        raise ValueError(
            "model.compile is not supported under ZeRO-3 (it gathers each layer's parameters "
            "through module hooks, which compiled layers do not run): set model.compile = "
            "false, or deepspeed.zero_stage = 2 where the model's states fit each GPU"
        )
    plan.compile = compile_layers(acc, cfg, plan)
    if ds is not None and plan.zero_stage is not None:
        apply_zero(ds, plan.zero_stage, cfg.deepspeed)
    if acc.is_main_process:
        log.info("training layout: %s", plan.describe())
        if plan.zero_stage == 3:
            log.info(
                "ZeRO-3 gathers every layer once per micro-batch (and again for checkpointed "
                "recompute): take the largest grpo.micro_batch_size that fits"
            )
        if plan.zero_stage == 3 and acc.num_processes == 1:
            log.warning(
                "DeepSpeed ZeRO-3 with one process partitions nothing but still gathers every "
                "layer: measured 10 %% slower than ZeRO-2 for the Qwen3-4B shape on an H200 "
                "(docs/benchmarks.md). With one learner GPU, launch with "
                "deploy/accelerate/single_gpu.yaml (or plain python -m learner) unless the "
                "model needs ZeRO-3's CPU offload"
            )
    return plan


def compile_layers(acc: Accelerator, cfg: LearnerConfig, plan: Plan) -> bool:
    """``model.compile``, with ``"auto"`` decided: on a GPU, unless the plan keeps ZeRO-3 (its
    gather hooks) or the base weights are 4-bit (QLoRA). Measured on an H200, compiled layers
    took the Qwen3-4B-shape step from 750 to 547 ms (docs/benchmarks.md, "The training
    phase"): the norms, activations and rotary embeddings fused."""
    if cfg.model.compile != "auto":
        return bool(cfg.model.compile)
    lora = cfg.model.lora
    quantized = lora is not None and lora.quantization != "none"
    return acc.device.type == "cuda" and plan.zero_stage != 3 and not quantized


def apply_zero(ds: Any, stage: int, opts: DeepSpeedConfig) -> None:
    """Set accelerate's DeepSpeed plugin ``ds`` to ZeRO ``stage`` with ``opts``' bucket sizes
    (those the launch's config leaves unset or "auto": a DeepSpeed config file's own values
    stay), and register the result with transformers (whether ``from_pretrained`` partitions)."""
    zero = ds.deepspeed_config.setdefault("zero_optimization", {})
    sizes = {"reduce_bucket_size": opts.reduce_bucket_size}
    if stage == 3:
        sizes |= {
            "stage3_prefetch_bucket_size": opts.prefetch_bucket_size,
            "stage3_max_live_parameters": opts.max_live_parameters,
            "stage3_param_persistence_threshold": opts.param_persistence_threshold,
        }
    for key, value in sizes.items():
        if value is not None and zero.get(key, "auto") == "auto":
            zero[key] = value
    if stage == ds.zero_stage:
        return
    zero["stage"] = stage
    ds.zero_stage = stage
    ds.zero3_init_flag = stage == 3
    ds.hf_ds_config.set_stage_and_offload()
    ds.set_deepspeed_weakref()
