"""``[deepspeed]``: which ZeRO stage the learner runs and how ZeRO-3 moves its parameters.

The launch's accelerate config picks DeepSpeed and a stage (``deploy/accelerate/zero3.yaml``);
these settings refine it without another file: ``zero_stage = "auto"`` lowers ZeRO-3 to ZeRO-2
when the model's states fit each GPU whole (``learner.model.plan``), and the ZeRO-3 bucket sizes
replace DeepSpeed's defaults, which prefetch less than one layer of a 4B model ahead.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from learner.config.base import Section


class DeepSpeedConfig(Section):
    zero_stage: Literal["auto", "launch", 2, 3] = Field(
        "auto",
        description="'auto': the launch's stage, but ZeRO-3 becomes ZeRO-2 where parameters, "
        "gradients, optimizer states and activations fit each GPU (no parameter gathers; "
        "never with parameter or optimizer offload); 'launch': the accelerate config's stage "
        "as it is; 2 or 3: that stage",
    )
    prefetch_bucket_size: int | None = Field(
        200_000_000,
        ge=1,
        description="ZeRO-3: parameters (elements) gathered ahead of the layer that needs them "
        "(DeepSpeed's stage3_prefetch_bucket_size); none: DeepSpeed's default (5e7)",
    )
    max_live_parameters: int | None = Field(
        2_000_000_000,
        ge=1,
        description="ZeRO-3: gathered parameters (elements) kept at once (stage3_max_live_"
        "parameters); none: DeepSpeed's default (1e9)",
    )
    param_persistence_threshold: int | None = Field(
        1_000_000,
        ge=0,
        description="ZeRO-3: parameters of at most this many elements are never partitioned "
        "(norms, biases: gathering them costs more than it saves); none: DeepSpeed's (1e5)",
    )
    reduce_bucket_size: int | None = Field(
        500_000_000,
        ge=1,
        description="gradients (elements) reduced at once, ZeRO-2 and -3 (reduce_bucket_size); "
        "none: DeepSpeed's default",
    )
