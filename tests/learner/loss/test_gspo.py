"""GSPO's sequence-level ratio (`grpo.importance_sampling_level = "sequence"`): by hand, equal to
the token level on-policy, and refused where the loss must be separable (the fused loss)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from learner.config import ConfigError, load_config
from learner.loss.grpo import LossConfig, LossInputs, grpo_loss
from learner.loss.token import GRPOTokenLoss
from learner.model.policy import PolicyLogprobs
from learner.step.batch import Rollout
from learner.step.update import StepOptions, build_micro_batches, train_on
from tests.learner.rollout_data import random_rollouts

ROOT = Path(__file__).resolve().parents[3]


def _inputs(old: list[list[float]]) -> LossInputs:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -1.5, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    old_t = torch.tensor(old, dtype=torch.float64)
    return LossInputs(logp.requires_grad_(), old_t, adv, mask)


def test_sequence_ratio_by_hand():
    # seq 0: log-ratios 0.1, 0, 0.2 -> mean 0.1, s = exp(0.1) = 1.10517 (inside [1-0.2, 1+0.28]);
    # seq 1: log-ratios 0, -0.5 (the third is masked) -> mean -0.25, s = exp(-0.25) = 0.7788,
    # A = -1: clipped to 0.8, so -min(-0.7788, -0.8) = 0.8 with no gradient.
    # grpo reduction: each completion's constant per-token loss averages to itself;
    # loss = (-1.10517 + 0.8) / 2.
    inputs = _inputs([[-1.1, -2.0, -0.7], [-0.5, -1.0, 9.0]])
    cfg = LossConfig(loss_type="grpo", importance_sampling_level="sequence")
    loss, metrics = grpo_loss(inputs, cfg)
    s0 = math.exp(0.1)
    assert loss.item() == pytest.approx((-s0 + 0.8) / 2, rel=1e-12)
    loss.backward()
    grad = inputs.logprobs.grad
    # d/dlogp_t of -s0/2 = -(s0/2)·(1/3) for each of seq 0's three tokens; seq 1 clipped: 0
    torch.testing.assert_close(grad[0], torch.full((3,), -s0 / 6, dtype=torch.float64))
    assert grad[1].abs().max() == 0
    assert metrics["clip_low"].item() == pytest.approx(2 / 5)  # seq 1's two tokens, of five


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_on_policy_the_sequence_level_gradient_is_the_token_levels(loss_type):
    grads = []
    for level in ("token", "sequence"):
        inputs = _inputs([[-1.0, -2.0, -0.5], [-0.5, -1.5, -3.0]])  # old = current: r = 1
        inputs.num_items_in_batch = 5.0 if loss_type == "dapo" else None
        cfg = LossConfig(loss_type=loss_type, importance_sampling_level=level)
        loss, _ = grpo_loss(inputs, cfg)
        loss.backward()
        grads.append(inputs.logprobs.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_off_policy_the_levels_differ():
    out = []
    for level in ("token", "sequence"):
        inputs = _inputs([[-1.3, -2.0, -0.1], [-0.5, -1.6, 9.0]])
        loss, _ = grpo_loss(inputs, LossConfig(importance_sampling_level=level))
        out.append(loss.item())
    assert out[0] != pytest.approx(out[1], rel=1e-3)


def test_the_fused_loss_refuses_a_sequence_ratio():
    cfg = LossConfig(importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="separable"):
        GRPOTokenLoss(cfg, torch.zeros(3, dtype=torch.long), torch.ones(1))
    with pytest.raises(ConfigError, match="fused_loss = false"):
        load_config(
            ROOT / "learner/configs/demo.toml",
            ['grpo.importance_sampling_level="sequence"', "grpo.fused_loss=true"],
        )
    with pytest.raises(ConfigError, match=r"grpo\.importance_sampling_level: Input should be"):
        load_config(ROOT / "learner/configs/demo.toml", ['grpo.importance_sampling_level="seq"'])


def _completion_logprobs(model: torch.nn.Module, r: Rollout) -> torch.Tensor:
    """``[C]``: log p(completion token | everything before it), one rollout alone (no
    packing, no padding, no chunks: not the learner's code path)."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].double()  # [C, V]
    target = torch.tensor(r.completion_ids)[:, None]
    return logits.log_softmax(-1).gather(-1, target).squeeze(-1)


def _gspo_objective(
    model: torch.nn.Module, rollouts: list[Rollout], olds: list[torch.Tensor], cfg: LossConfig
) -> torch.Tensor:
    """GSPO's loss written from its definition: per completion the sequence ratio
    s = exp(mean over its sampled tokens of log p - log p_old), the clipped objective
    -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) on every token, times the truncated
    importance weight min(exp(log p_old - log p_sampling), tis_cap); each completion's token
    mean, then the mean over completions (the "grpo" reduction)."""
    per_seq = []
    for r, old in zip(rollouts, olds, strict=True):
        keep = torch.tensor(r.completion_mask, dtype=torch.bool)
        logp = _completion_logprobs(model, r)[keep]
        s = torch.exp((logp - old[keep]).mean())
        a = r.advantage
        objective = -torch.min(s * a, s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a)
        sampling = torch.tensor(r.sampling_logprobs, dtype=torch.float64)[keep]
        assert cfg.tis_cap is not None
        weight = torch.exp(old[keep] - sampling).clamp(max=cfg.tis_cap)
        per_seq.append((objective * weight).mean())
    return torch.stack(per_seq).mean()


def _independent_two_passes(
    model: torch.nn.Module, rollouts: list[Rollout], cfg: LossConfig, lr: float, max_norm: float
) -> tuple[float, float]:
    """The two passes' losses of a μ = 2 GSPO step with plain SGD, computed by hand on a copy
    of the model: old log-probs before the step, pass 1 (on-policy), clip the gradient, step,
    pass 2 (off-policy: its sequence ratios move away from 1)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        olds = [_completion_logprobs(model, r) for r in rollouts]
    first = _gspo_objective(model, rollouts, olds, cfg)
    first.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    with torch.no_grad():
        second = _gspo_objective(model, rollouts, olds, cfg)
    return first.item(), second.item()


def _train_two_passes(model: torch.nn.Module, cfg: LossConfig, lr: float) -> dict[str, float]:
    policy = PolicyLogprobs(model, chunk_size=5)
    opts = StepOptions(micro_batch_size=3, num_iterations=2)
    step = build_micro_batches(random_rollouts(6), opts, cfg, pad_id=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return train_on(Accelerator(cpu=True), policy, None, opt, cfg, step, opts)


def test_two_passes_of_a_gspo_step_train(tiny_model_dir):
    """μ = 2 on a real tiny Qwen3: the second pass is off-policy, so its ratios differ from 1;
    the step runs, changes the weights, reports clipping metrics, and its loss is the GSPO
    objective computed by hand over both passes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    cfg = LossConfig(
        loss_type="grpo", importance_sampling_level="sequence", eps_low=3e-4, eps_high=4e-4
    )
    first, second = _independent_two_passes(model, random_rollouts(6), cfg, 0.5, 1.0)
    metrics = _train_two_passes(model, cfg, lr=0.5)
    assert math.isfinite(metrics["loss"]) and "clip_region" in metrics
    assert any(not torch.equal(p, before[k]) for k, p in model.named_parameters())
    assert metrics["loss"] == pytest.approx((first + second) / 2, rel=1e-5)


def test_a_gspo_steps_loss_is_the_sequence_objective(tiny_model_dir):
    """With clip ranges the second pass's ratios stay inside (0.2 / 0.28) and a step large
    enough to move them, the reported loss is the GSPO objective by hand, and far enough from
    the token-level loss (ratios per token) that the wrong level would show."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LossConfig(loss_type="grpo", importance_sampling_level="sequence")
    first, second = _independent_two_passes(model, random_rollouts(6), cfg, 5.0, 1.0)
    assert second != pytest.approx(first, rel=0.1)  # the second pass is off-policy
    want = (first + second) / 2
    assert _train_two_passes(model, cfg, lr=5.0)["loss"] == pytest.approx(want, rel=1e-5)
    token = LossConfig(loss_type="grpo", importance_sampling_level="token")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert _train_two_passes(fresh, token, lr=5.0)["loss"] != pytest.approx(want, rel=1e-3)
