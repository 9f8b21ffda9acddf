"""Build the trainable policy (optionally PEFT LoRA or QLoRA, with gradient checkpointing) and its
reference.

With ``model.compile`` every decoder layer is compiled in place (``compile_decoder_layers``).

The KL reference is, in order of preference: none (beta = 0); the same model with its LoRA
adapters disabled (no second copy of the weights); a frozen copy of the initial model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from learner.config import LearnerConfig
from learner.model.policy import PolicyLogprobs


def build_models(
    cfg: LearnerConfig,
    model_path: str,
    *,
    gradient_checkpointing: bool | None = None,
    compile: bool | None = None,
) -> tuple[PolicyLogprobs, PolicyLogprobs | None]:
    """The policy and its KL reference. ``gradient_checkpointing``, ``compile``: the planned
    choices (``learner.model.layout``); None: the config's, where ``"auto"`` means recompute on
    (no plan was made: the choice that fits) and no compilation."""
    from transformers import AutoModelForCausalLM

    if gradient_checkpointing is None:
        gradient_checkpointing = cfg.model.gradient_checkpointing is not False
    if compile is None:
        compile = cfg.model.compile is True
    if cfg.model.routing_replay != "off":
        if gradient_checkpointing:
            raise ValueError(
                "model.routing_replay: the planned layout recomputes activations, and the "
                "backward's recompute would route the tokens anew; set "
                "model.gradient_checkpointing = false (with memory for it: a smaller "
                'grpo.micro_batch_size or more GPUs) or model.routing_replay = "off"'
            )
        compile = False  # the replay swaps the routers' forwards, which compiled layers fix

    kwargs: dict[str, Any] = {}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    lora = cfg.model.lora
    if lora is not None and lora.quantization != "none":
        kwargs["quantization_config"] = bnb_4bit(lora.quantization, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        dtype=getattr(torch, cfg.model.dtype),
        trust_remote_code=cfg.model.trust_remote_code,
        **kwargs,
    )
    model.config.use_cache = False
    # from_pretrained returns eval mode; HF's checkpointed layers (and dropout) only act in
    # train mode, so without this gradient checkpointing would silently never recompute.
    model.train()
    ref = None
    if cfg.grpo.beta > 0 and cfg.model.lora is None:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if cfg.model.lora is not None:
        from peft import LoraConfig, get_peft_model

        lc = cfg.model.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lc.r,
                lora_alpha=lc.alpha,
                lora_dropout=lc.dropout,
                target_modules=lc.target_modules,
                task_type="CAUSAL_LM",
            ),
            autocast_adapter_dtype=lc.adapter_dtype == "float32",
        )
        if gradient_checkpointing:
            model.enable_input_require_grads()
    if compile:
        compile_decoder_layers(model)
        if ref is not None:
            compile_decoder_layers(ref)
    chunk = cfg.grpo.logprob_chunk_size
    temperature = cfg.sampling.temperature
    policy = PolicyLogprobs(
        model, temperature=temperature, chunk_size=chunk, fused_chunk_size=cfg.grpo.fused_chunk_size
    )
    ref_policy = (
        PolicyLogprobs(ref, temperature=temperature, chunk_size=chunk) if ref is not None else None
    )
    return policy, ref_policy


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` each decoder layer of a transformers model in place; returns how many.

    The layers are the modules whose class the model names in ``_no_split_modules`` (what
    accelerate and FSDP wrap, e.g. ``Qwen3DecoderLayer``); under PEFT the base model says.
    ``Module.compile`` keeps each module and its parameter names (checkpoints and weight syncs
    see the same state dict), and the layers share one compiled graph (their parameters are
    inputs to it), compiled with dynamic shapes once: the first step pays it, ~25 s on two CPU
    cores for the tiny model. A checkpointed layer recomputes through the compiled graph.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"model.compile: {type(model).__name__} names no decoder layer class in "
            "_no_split_modules, so there is nothing to compile by layer; set model.compile = false"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def bnb_4bit(quant_type: str, dtype: str) -> Any:
    """QLoRA's base-weight format: 4-bit ``quant_type`` blocks with double-quantized scales,
    matmuls computed in the model's dtype."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"model.lora.quantization={quant_type!r} needs bitsandbytes: "
            "pip install 'grpo-service[qlora]', or set model.lora.quantization = \"none\""
        ) from e
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=getattr(torch, dtype),
    )
