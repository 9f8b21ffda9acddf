"""The off-policy metrics of a whole step: k3 and the rejected fractions from `train_on` (over
several micro-batches) against an offline computation from the same log-probs, and the tokens
per version lag."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator

from learner.loss.grpo import LossConfig
from learner.model.policy import PolicyLogprobs
from learner.step.batch import Rollout
from learner.step.update import StepOptions, build_micro_batches, train_on, version_lag_metrics
from tests.learner.rollout_data import random_rollouts


def _completion_logprobs(model: torch.nn.Module, r: Rollout) -> list[float]:
    """log p(completion token | everything before it), one rollout alone (not the learner's
    code path: no padding, no chunks)."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].double()  # [C, V]
    target = torch.tensor(r.completion_ids)[:, None]
    return logits.log_softmax(-1).gather(-1, target).squeeze(-1).tolist()


def test_a_steps_k3_and_rejections_equal_an_offline_computation(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rollouts = random_rollouts(7)
    # The servers' log-probs: the learner's plus a per-token offset; rollouts 0, 2, 4, 6 sit
    # 0.5 above (geometric-mean ratio exp(-0.5) = 0.61, outside the band [0.8, 1.25]: rejected),
    # the others within ±0.05 (ratio ~1: kept).
    offline_k3, tokens, rejected_tokens = [], 0, 0
    for i, r in enumerate(rollouts):
        lp = _completion_logprobs(model, r)
        shift = [0.5 if i % 2 == 0 else 0.05 * math.sin(i + t) for t in range(len(lp))]
        r.sampling_logprobs = [a + s for a, s in zip(lp, shift, strict=True)]
        for t, keep in enumerate(r.completion_mask):
            if keep:
                d = lp[t] - r.sampling_logprobs[t]  # log π_old - log μ (μ = 1: π_old = π)
                offline_k3.append(math.exp(d) - d - 1)
                tokens += 1
                rejected_tokens += i % 2 == 0
    cfg = LossConfig(loss_type="dapo", tis_cap=2.0, reject_low=0.8, reject_high=1.25)
    opts = StepOptions(micro_batch_size=2)
    step = build_micro_batches(rollouts, opts, cfg, pad_id=0)
    assert len(step.batches) == 4  # the means run over several micro-batches
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    policy = PolicyLogprobs(model, chunk_size=5)
    m = train_on(Accelerator(cpu=True), policy, None, opt, cfg, step, opts)
    assert m["off_policy/k3"] == pytest.approx(sum(offline_k3) / tokens, rel=1e-4)
    assert m["off_policy/rejected"] == pytest.approx(rejected_tokens / tokens, rel=1e-6)
    assert m["off_policy/seq_rejected"] == pytest.approx(4 / 7, rel=1e-6)  # a sequence mean


def test_tokens_per_version_lag_of_a_step():
    # learner at version 7, staleness bound 2: rollouts from versions 7, 6, 6, 5 with 3, 1, 2
    # and 4 loss tokens (random_rollouts' masks: counted, not assumed)
    rollouts = random_rollouts(4)
    for r, v in zip(rollouts, [7, 6, 6, 5], strict=True):
        r.weight_version = v
    n = [sum(r.completion_mask) for r in rollouts]
    m = version_lag_metrics(Accelerator(cpu=True), rollouts, 7, max_lag=2)
    assert m == {
        "off_policy/tokens_lag_0": n[0],
        "off_policy/tokens_lag_1": n[1] + n[2],
        "off_policy/tokens_lag_2": n[3],
        "off_policy/version_lag_mean": pytest.approx((n[1] + n[2] + 2 * n[3]) / sum(n)),
    }
    # older than the bound: counted apart, so the keys stay the same on every rank
    # (learner at 8: lags 1, 2, 2, 3 with the bound 1)
    m = version_lag_metrics(Accelerator(cpu=True), rollouts, 8, max_lag=1)
    assert m["off_policy/tokens_lag_beyond"] == sum(n[1:])
    assert m["off_policy/tokens_lag_0"] == 0 and m["off_policy/tokens_lag_1"] == n[0]
