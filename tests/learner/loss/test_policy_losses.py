"""CISPO, SAPO and GMPO (`grpo.policy_loss`): values and gradients by hand, and the config's
checks of them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.config import ConfigError, load_config
from learner.loss.grpo import LossConfig, LossInputs, grpo_loss

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "learner/configs/demo.toml"


def _inputs() -> LossInputs:
    # log-ratios logp - old: [[0.1, 0], [0, -0.5]]
    # ratios: [[exp(0.1), 1], [1, exp(-0.5)]] = [[1.105171, 1], [1, 0.606531]]
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.0], [-0.5, -1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return LossInputs(logp, old, adv, torch.ones(2, 2, dtype=torch.float64))


R0, R3 = math.exp(0.1), math.exp(-0.5)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_cispo_by_hand_with_stop_gradient():
    # No floor, cap 1 + 0.28: no weight is clipped, w = r.
    # Per token -w·A·logp:
    #   seq 0 (A = +1): -1.105171·(-1.0) = 1.105171,  -1·(-2.0) = 2.0
    #   seq 1 (A = -1): +1·(-0.5) = -0.5,             +0.606531·(-1.5) = -0.909796
    # bnpo: sum / 4 = (1.105171 + 2 - 0.5 - 0.909796) / 4
    inputs = _inputs()
    loss, m = grpo_loss(inputs, LossConfig(loss_type="bnpo", policy_loss="cispo"))
    assert loss.item() == pytest.approx((R0 * 1.0 + 2.0 - 0.5 - R3 * 1.5) / 4, rel=1e-12)
    loss.backward()
    # Stop-gradient: ∂/∂logp = -w·A/4 only. Without it the weight's own derivative would add
    # -A·logp·w/4 (+1.105171/4 at the first token). The low-ratio token (0.6065, A < 0), which
    # PPO's clip silences, keeps its gradient +0.606531/4.
    expected = torch.tensor([[-R0 / 4, -0.25], [0.25, R3 / 4]], dtype=torch.float64)
    torch.testing.assert_close(inputs.logprobs.grad, expected, rtol=1e-12, atol=1e-12)
    assert m["clip_low"].item() == 0.0 and m["clip_high"].item() == 0.0


def test_cispo_cap_and_floor_by_hand():
    # cap 1 + 0.05 = 1.05: the first token's weight 1.105171 -> 1.05 (clip_high);
    # floor 1 - 0.2 = 0.8: the last token's 0.606531 -> 0.8 (clip_low).
    # Per token: 1.05·1.0 = 1.05, 2.0, -0.5, -0.8·1.5 = -1.2; bnpo: 1.35 / 4
    inputs = _inputs()
    cfg = LossConfig(loss_type="bnpo", policy_loss="cispo", eps_high=0.05, cispo_eps_low=0.2)
    loss, m = grpo_loss(inputs, cfg)
    assert loss.item() == pytest.approx((1.05 + 2.0 - 0.5 - 1.2) / 4, rel=1e-12)
    loss.backward()
    # the clipped tokens still have a gradient, the clipped weight times -A / 4
    expected = torch.tensor([[-1.05 / 4, -0.25], [0.25, 0.8 / 4]], dtype=torch.float64)
    torch.testing.assert_close(inputs.logprobs.grad, expected, rtol=1e-12, atol=1e-12)
    assert m["clip_high"].item() == 0.25 and m["clip_low"].item() == 0.25


def test_sapo_by_hand():
    # Per token -(4/τ)·σ(τ(r - 1))·A, τ = 1 for A > 0, 1.05 otherwise:
    #   (0,0): -4·σ(0.105171) = -2.105074     (0,1): -4·σ(0) = -2
    #   (1,0): +(4/1.05)·σ(0) = 1.904762       (1,1): +(4/1.05)·σ(1.05·(0.606531 - 1)) = 1.516795
    inputs = _inputs()
    loss, m = grpo_loss(inputs, LossConfig(loss_type="bnpo", policy_loss="sapo"))
    t = 1.05
    per = [
        -4 * _sigmoid(R0 - 1),
        -2.0,
        (4 / t) * 0.5,
        (4 / t) * _sigmoid(t * (R3 - 1)),
    ]
    assert per == pytest.approx([-2.105074, -2.0, 1.904762, 1.516795], abs=1e-6)
    assert loss.item() == pytest.approx(sum(per) / 4, rel=1e-12)
    loss.backward()
    # ∂/∂logp = -4σ(1 - σ)·r·A / 4: at r = 1 exactly -A/4 (the plain policy gradient);
    # (0,0): -4·σ(0.105171)(1 - σ(0.105171))·1.105171 / 4 = -1.102120 / 4
    # (1,1): +4·σ(-0.413142)(1 - σ(-0.413142))·0.606531 / 4 = +0.581368 / 4
    s0, s3 = _sigmoid(R0 - 1), _sigmoid(t * (R3 - 1))
    g0, g3 = 4 * s0 * (1 - s0) * R0, 4 * s3 * (1 - s3) * R3
    assert (g0, g3) == pytest.approx((1.102120, 0.581368), abs=1e-6)
    expected = torch.tensor([[-g0 / 4, -0.25], [0.25, g3 / 4]], dtype=torch.float64)
    torch.testing.assert_close(inputs.logprobs.grad, expected, rtol=1e-12, atol=1e-12)
    assert m["clip_region"].item() == 0.0  # a gate, no hard clip


def test_gmpo_by_hand():
    # Log-space clip [-0.4, 0.4].
    # seq 0 (A = +1): log-ratios 0.1, 0 inside; mean 0.05; loss -exp(0.05) = -1.051271
    # seq 1 (A = -1): log-ratios 0, -0.5; clamped 0, -0.4; max(x, clamp(x)) = 0, -0.4;
    #   mean -0.2; loss +exp(-0.2) = 0.818731
    # grpo reduction (each completion's loss is on each of its tokens): the mean over the
    # completions, (-1.051271 + 0.818731) / 2
    inputs = _inputs()
    cfg = LossConfig(loss_type="grpo", policy_loss="gmpo", eps_low=0.4, eps_high=0.4)
    loss, m = grpo_loss(inputs, cfg)
    e0, e1 = math.exp(0.05), math.exp(-0.2)
    assert loss.item() == pytest.approx((-e0 + e1) / 2, rel=1e-12)
    loss.backward()
    # seq 0: ∂(-exp(mean))/∂logp_t = -exp(0.05)·(1/2), then the mean over 2 completions: /2
    # seq 1: the unclipped token exp(-0.2)·(1/2)/2; the clipped one (x = -0.5 < -0.4, A < 0)
    # none
    expected = torch.tensor([[-e0 / 4, -e0 / 4], [e1 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(inputs.logprobs.grad, expected, rtol=1e-12, atol=1e-12)
    assert m["clip_low"].item() == 0.25 and m["clip_high"].item() == 0.0


def test_gmpo_positive_advantage_clips_above_only():
    # One completion, A = +2, log-ratios 0.6 and -0.6 with the clip [-0.4, 0.4]:
    # min(x, clamp(x)) = 0.4 (clipped, no gradient) and -0.6 (kept); mean -0.1;
    # loss -2·exp(-0.1); the kept token's gradient -2·exp(-0.1)/2, the clipped one 0.
    logp = torch.tensor([[0.6, -0.6]], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([2.0]),
                        torch.ones(1, 2))  # fmt: skip
    cfg = LossConfig(loss_type="grpo", policy_loss="gmpo", eps_low=0.4, eps_high=0.4)
    loss, m = grpo_loss(inputs, cfg)
    assert loss.item() == pytest.approx(-2 * math.exp(-0.1), rel=1e-12)
    loss.backward()
    expected = torch.tensor([[0.0, -math.exp(-0.1)]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-12)
    assert m["clip_high"].item() == 0.5


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo", "sapo", "gmpo"])
def test_on_policy_every_objective_is_the_policy_gradient(policy_loss):
    # r = 1 everywhere: each objective's gradient is -A·∇logp (times the reduction's weight)
    logp = torch.tensor([[-1.0, -2.0, -0.3]], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(logp, logp.detach(), torch.tensor([0.7]), torch.ones(1, 3))
    loss, _ = grpo_loss(inputs, LossConfig(loss_type="bnpo", policy_loss=policy_loss))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -0.7 / 3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (['grpo.policy_loss="gmpo"', "grpo.fused_loss=true"], r"grpo\.policy_loss: .*fused_loss"),
        (
            ['grpo.policy_loss="gmpo"', 'grpo.importance_sampling_level="sequence"'],
            r"grpo\.importance_sampling_level: gmpo",
        ),
        (['grpo.policy_loss="cispo"', "grpo.cispo_eps_low=1.0"], r"grpo\.cispo_eps_low"),
        (["grpo.sapo_tau_neg=0"], r"grpo\.sapo_tau_neg"),
        (['grpo.policy_loss="dpo"'], r"grpo\.policy_loss: Input should be 'ppo'"),
    ],
)
def test_the_config_refuses(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, overrides)


def test_the_config_carries_the_objective_to_the_loss():
    cfg = load_config(
        DEMO,
        ['grpo.policy_loss="sapo"', "grpo.sapo_tau_pos=0.5", "grpo.sapo_tau_neg=2.0",
         "grpo.fused_loss=true"],
    )  # fmt: skip
    loss_cfg = LossConfig.of(cfg.grpo, cfg.sampling.max_tokens)
    assert (loss_cfg.policy_loss, loss_cfg.sapo_tau_pos, loss_cfg.sapo_tau_neg) == ("sapo", 0.5, 2)
    assert loss_cfg.separable
    assert not LossConfig(policy_loss="gmpo").separable
