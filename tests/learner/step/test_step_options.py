"""The step's options come from the validated config, each read by name from its section, with
the config's defaults: a StepOptions built by hand is a default config's."""

from __future__ import annotations

from dataclasses import fields

from learner.config import load_config
from learner.step.update import StepOptions
from tests.learner.demo_runs import DEMO


def test_the_options_are_the_configs_fields_and_defaults():
    from learner.config import ModelConfig
    from learner.config.step import GRPOConfig, OptimConfig

    defaults = {"grpo": GRPOConfig(), "optim": OptimConfig(), "model": ModelConfig()}
    from_config = [f for f in fields(StepOptions) if "section" in f.metadata]
    assert {f.metadata["section"] for f in from_config} == set(defaults)
    for f in from_config:
        assert f.default == getattr(defaults[f.metadata["section"]], f.name), f.name
    cfg = load_config(DEMO, [
        "grpo.micro_batch_size=3", "grpo.num_iterations=2", "optim.max_grad_norm=0.5",
        "grpo.packing=true", "grpo.max_tokens_per_micro_batch=512", "grpo.pad_to_multiple_of=8",
        "grpo.skip_zero_advantage=false", "grpo.beta=0.04",
        "model.activation_offloading=true",
    ])  # fmt: skip
    assert StepOptions.of(cfg) == StepOptions(
        micro_batch_size=3, num_iterations=2, max_grad_norm=0.5, packing=True,
        max_tokens_per_micro_batch=512, pad_to_multiple_of=8, skip_zero_advantage=False,
        need_reference=True, activation_offloading=True,
    )  # fmt: skip
    counted = load_config(DEMO, ["grpo.count_zero_advantage=false", "grpo.beta=0"])
    opts = StepOptions.of(counted)
    assert opts.count_zero_advantage is False and opts.need_reference is False
