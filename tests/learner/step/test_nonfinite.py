"""A non-finite gradient skips the optimizer step (the weights stay finite, nothing is synced
from them), and a run that keeps getting them stops with an error that says what to change."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss.grpo import LossConfig
from learner.model.policy import PolicyLogprobs
from learner.step.optimizer import NonFiniteError, NonFiniteGuard
from learner.step.update import StepOptions, build_micro_batches, train_on
from tests.learner.rollout_data import random_rollouts


def test_a_nan_gradient_skips_the_step_and_keeps_the_weights(tiny_model_dir):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = PolicyLogprobs(model, chunk_size=5)
    opts = StepOptions(micro_batch_size=2)
    step = build_micro_batches(random_rollouts(4), opts, LossConfig(), pad_id=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    poison = model.model.norm.register_forward_hook(lambda m, i, out: out * float("nan"))
    m = train_on(Accelerator(cpu=True), policy, None, opt, LossConfig(), step, opts)
    assert math.isnan(m["grad_norm"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # the step was skipped
    assert all(p.grad is None for p in model.parameters())

    poison.remove()
    m = train_on(Accelerator(cpu=True), policy, None, opt, LossConfig(), step, opts)
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_guard_stops_after_steps_in_a_row(caplog):
    guard = NonFiniteGuard(limit=3)
    nan = {"grad_norm": float("nan"), "loss": float("nan")}
    guard.check(1, nan)
    guard.check(2, nan)
    guard.check(3, {"grad_norm": 1.0, "loss": 0.5})  # a finite step resets the count
    guard.check(4, nan)
    guard.check(5, {"grad_norm": float("inf"), "loss": 1.0})
    assert caplog.text.count("the optimizer step was skipped") == 4
    with pytest.raises(NonFiniteError, match=r"step 6: .*: 3 steps in a row .*Lower optim\.lr"):
        guard.check(6, nan)
