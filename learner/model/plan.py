"""How the learner lays out training on its GPUs: the ZeRO stage and gradient checkpointing,
chosen from the model's size, the largest micro-batch and the GPU's memory.

Both trade speed for memory. ZeRO-3 gathers every layer's parameters in the forward and again in
the backward; ZeRO-2 keeps a whole bf16 copy on each GPU and gathers nothing. Gradient
checkpointing runs each layer's forward twice. Where the memory is there, neither pays, so
``"auto"`` takes the cheapest layout whose estimated peak fits the budget, in this order:
ZeRO-2 without recompute, ZeRO-3 without, ZeRO-2 with, ZeRO-3 with.

The estimates are deliberately plain (bytes per parameter of each stage, bytes per token of
each layer's saved activations) and were checked against measured peaks (docs/options.md); the
learner logs what it chose and the numbers behind it, and every choice can be set by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from learner.model.moe_size import moe_layers, num_experts

GIB = 1024**3


@dataclass(frozen=True)
class ModelSize:
    """What the memory estimates need of a decoder-only transformer's config."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # kv heads x head_dim

    @classmethod
    def of(cls, config: Any) -> ModelSize:
        """From a transformers config (object or ``config.json`` dict)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        h, layers, inter = get("hidden_size"), get("num_hidden_layers"), get("intermediate_size")
        if not (h and layers and inter):
            raise ValueError(
                "the model config lacks hidden_size, num_hidden_layers or intermediate_size"
            )
        heads = get("num_attention_heads") or 1
        hd = get("head_dim") or h // heads
        q, kv = heads * hd, (get("num_key_value_heads") or heads) * hd
        vocab = get("vocab_size") or 0
        # attention and MLP projections, the two layer norms and (Qwen3) the q/k norms
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h + 2 * hd
        embeddings = vocab * h * (1 if get("tie_word_embeddings", False) else 2)
        if num_experts(get):  # mixture of experts: every expert held, top-k run a token
            moe = moe_layers(get, h, q, kv, hd)
            return cls(moe.params + embeddings + h, layers, h, moe.active_intermediate, q, kv)
        return cls(layers * per_layer + embeddings + h, layers, h, inter, q, kv)

    def activation_bytes_per_token(self, recompute: bool) -> float:
        """bf16 activations a trained token keeps for the backward, all layers. Without
        recompute each layer keeps its norms' inputs and outputs, q/k/v (before and after the
        rotary embedding and q/k norms), the attention output, and the MLP's gate, up, activation
        and product: ~(8h + 4q + 4kv + 4i) elements, +10 % for what the allocator cannot reuse
        (measured: 171 KB a token a layer for the Qwen3-4B shape on an H200 against 160 KB
        estimated). With recompute only each layer's input stays, plus one layer in full while
        it is recomputed."""
        full = (
            2 * 1.1 * (8 * self.hidden + 4 * self.q_dim + 4 * self.kv_dim + 4 * self.intermediate)
        )
        if not recompute:
            return self.layers * full
        return self.layers * 2 * self.hidden + full


def state_bytes(params: int, stage: int | None, world: int) -> float:
    """Parameters, gradients and AdamW states per GPU. DeepSpeed in bf16 keeps bf16 parameters
    and gradients and an fp32 master copy with two fp32 moments (12 bytes a parameter), split as
    its stage says; ``stage`` None: no DeepSpeed, the model's own dtype throughout (bf16: 8
    bytes a parameter with fused AdamW)."""
    p = float(params)
    if stage is None:
        return 8 * p
    if stage == 3:
        return 16 * p / world
    if stage == 2:
        return 2 * p + 14 * p / world
    return 4 * p + 12 * p / world  # stage 1 (and 0: counted alike)


OVERHEAD_BYTES = 4 * GIB  # CUDA context, the chunked loss's logits, the allocator's slack


@dataclass
class Plan:
    """The layout chosen and why: ``zero_stage`` None = not DeepSpeed (the launch's)."""

    zero_stage: int | None
    gradient_checkpointing: bool
    peak_bytes: float  # the estimated peak of the chosen layout
    budget_bytes: float | None
    reasons: list[str] = field(default_factory=list)
    compile: bool = False  # decoder layers compiled (``learner.model.layout.compile_layers``)

    def describe(self) -> str:
        stage = f"ZeRO-{self.zero_stage}" if self.zero_stage is not None else "no ZeRO"
        gc = "on" if self.gradient_checkpointing else "off"
        gc += ", layers compiled" if self.compile else ""
        budget = f"{self.budget_bytes / GIB:.0f} GiB" if self.budget_bytes else "unknown"
        return (
            f"{stage}, gradient checkpointing {gc}: estimated peak "
            f"{self.peak_bytes / GIB:.1f} GiB a GPU of {budget} ({'; '.join(self.reasons)})"
        )


def plan_training(
    size: ModelSize,
    *,
    tokens_per_micro_batch: int,
    world: int,
    launch_stage: int | None,
    budget_bytes: float | None,
    want_stage: str | int = "auto",
    want_checkpointing: bool | str = "auto",
    offload: bool = False,
) -> Plan:
    """The cheapest layout that fits ``budget_bytes`` (None: no GPU, nothing to fit: no
    recompute). ``launch_stage``: the accelerate config's ZeRO stage (None: no DeepSpeed);
    ``want_stage``/``want_checkpointing``: the config's settings ("auto" or a choice)."""

    def peak(stage: int | None, gc: bool) -> float:
        acts = size.activation_bytes_per_token(gc) * tokens_per_micro_batch
        return state_bytes(size.params, stage, world) + acts + OVERHEAD_BYTES

    if launch_stage is None or want_stage == "launch" or offload:
        stages = [launch_stage]
        why = "the launch's stage" if not offload else "offload needs the launch's ZeRO-3"
    elif want_stage == "auto":
        stages = [2, 3] if launch_stage == 3 else [launch_stage]
        why = "auto"
    else:
        stages = [int(want_stage)]
        why = "deepspeed.zero_stage"
    gcs = [False, True] if want_checkpointing == "auto" else [bool(want_checkpointing)]
    order = [(s, g) for g in gcs for s in stages]  # recompute costs more than gathering
    reasons = [f"stage: {why}"]
    if budget_bytes is None:
        stage, gc = order[0]
        return Plan(stage, gc, peak(stage, gc), None, [*reasons, "no GPU memory to fit"])
    for stage, gc in order:
        if peak(stage, gc) <= budget_bytes:
            return Plan(stage, gc, peak(stage, gc), budget_bytes, [*reasons, "fits"])
    stage, gc = order[-1]
    return Plan(
        stage,
        gc,
        peak(stage, gc),
        budget_bytes,
        [*reasons, "nothing fits the budget: the leanest layout; lower grpo.micro_batch_size "
         "(or grpo.max_tokens_per_micro_batch with packing) if it runs out of memory"],
    )  # fmt: skip
