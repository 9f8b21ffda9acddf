"""Off-policy corrections (`learner.loss.off_policy`): every weight, mask and rejection by hand,
their effect on the loss, the metrics (k3 against an offline computation), tokens per version
lag, and the config's shape and checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.config import ConfigError, load_config
from learner.loss.grpo import LossConfig, LossInputs, grpo_loss
from learner.loss.off_policy import (
    correction_metrics,
    correction_weights,
    k3,
    tokens_per_version_lag,
)
from learner.loss.settings import Correction

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "learner/configs/demo.toml"

# Token ratios exp(old - sampling): seq 0 [3, 1, 0.5], seq 1 [1.2, 0.9] (its third is masked
# out, ratio 100, and must never count).
RATIOS = [[3.0, 1.0, 0.5], [1.2, 0.9, 100.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]], dtype=torch.float64)
SAMPLING = OLD - torch.tensor(RATIOS, dtype=torch.float64).log()
GEO0, GEO1 = 1.5 ** (1 / 3), 1.08**0.5  # geometric means: (3·1·0.5)^(1/3) = 1.144714, 1.039230


def _weights(**kw):
    c = Correction(**kw)
    w = correction_weights(OLD, SAMPLING, MASK, c)
    return w, correction_metrics(OLD, SAMPLING, MASK, w, c)


def _close(t: torch.Tensor, rows: list[list[float]]) -> None:
    want = torch.tensor(rows, dtype=torch.float64)
    torch.testing.assert_close(t * MASK, want * MASK, rtol=1e-12, atol=1e-12)


def test_token_truncation_tis():
    w, m = _weights(level="token", mode="truncate", high=2.0)
    _close(w.weight, [[2.0, 1.0, 0.5], [1.2, 0.9, 0]])  # 3 -> 2
    assert m["off_policy/truncated"].item() == pytest.approx(1 / 5)
    assert m["off_policy/weight"].item() == pytest.approx((2 + 1 + 0.5 + 1.2 + 0.9) / 5)
    assert "off_policy/masked" not in m and "off_policy/seq_truncated" not in m


def test_token_masking_mis():
    w, m = _weights(level="token", mode="mask", high=2.0)
    _close(w.weight, [[0.0, 1.0, 0.5], [1.2, 0.9, 0]])  # 3 > 2: weight 0, the others kept
    assert m["off_policy/masked"].item() == pytest.approx(1 / 5)


def test_icepop_band():
    # [0.8, 2]: 3 above, 0.5 below -> 0; 1, 1.2, 0.9 inside keep their ratio
    w, m = _weights(level="token", mode="mask", low=0.8, high=2.0)
    _close(w.weight, [[0.0, 1.0, 0.0], [1.2, 0.9, 0]])
    assert m["off_policy/masked"].item() == pytest.approx(2 / 5)


def test_sequence_arithmetic_mean_truncated():
    # seq 0: (3 + 1 + 0.5) / 3 = 1.5 -> capped 1.1; seq 1: (1.2 + 0.9) / 2 = 1.05 (the masked
    # ratio 100 is not in the mean)
    w, m = _weights(level="sequence", mode="truncate", high=1.1)
    _close(w.weight, [[1.1] * 3, [1.05] * 3])
    assert m["off_policy/truncated"].item() == pytest.approx(3 / 5)  # seq 0's three tokens
    assert m["off_policy/seq_truncated"].item() == pytest.approx(1 / 2)


def test_sequence_arithmetic_mean_masked():
    w, m = _weights(level="sequence", mode="mask", high=1.1)
    _close(w.weight, [[0.0] * 3, [1.05] * 3])  # 1.5 > 1.1: seq 0 masked
    assert m["off_policy/masked"].item() == pytest.approx(3 / 5)
    assert m["off_policy/seq_masked"].item() == pytest.approx(1 / 2)


def test_geometric_mean_truncated_and_masked():
    w, m = _weights(level="geo_sequence", mode="truncate", high=1.1)
    _close(w.weight, [[1.1] * 3, [GEO1] * 3])  # 1.144714 -> 1.1; 1.039230 kept
    assert m["off_policy/seq_truncated"].item() == pytest.approx(1 / 2)
    # mask [1.04, 1.2]: seq 0 (1.1447) inside, seq 1 (1.0392) below
    w, m = _weights(level="geo_sequence", mode="mask", low=1.04, high=1.2)
    _close(w.weight, [[GEO0] * 3, [0.0] * 3])
    assert m["off_policy/masked"].item() == pytest.approx(2 / 5)
    assert m["off_policy/seq_masked"].item() == pytest.approx(1 / 2)


def test_sequence_rejection_on_top_of_token_truncation():
    # band [0.95, 1.1] on the geometric mean: seq 0 (1.144714) rejected, seq 1 (1.039230) kept
    # with its token weights capped at 2 (none is above)
    w, m = _weights(level="token", mode="truncate", high=2.0, reject_low=0.95, reject_high=1.1)
    _close(w.weight, [[0.0] * 3, [1.2, 0.9, 0]])
    assert w.rejected.tolist() == [True, False]
    assert m["off_policy/rejected"].item() == pytest.approx(3 / 5)
    assert m["off_policy/seq_rejected"].item() == pytest.approx(1 / 2)
    # rejection alone (no weight): the kept sequence weighs 1
    w, _ = _weights(high=None, reject_high=1.1)
    _close(w.weight, [[0.0] * 3, [1.0, 1.0, 0]])


def test_k3_equals_an_offline_computation():
    # k3 = r - log r - 1 per sampled token, r = exp(old - sampling), mean over the 5 loss tokens
    offline = [r - math.log(r) - 1 for r in (3.0, 1.0, 0.5, 1.2, 0.9)]
    assert offline == pytest.approx([0.901388, 0.0, 0.193147, 0.017678, 0.005361], abs=1e-6)
    _, m = _weights()
    assert m["off_policy/k3"].item() == pytest.approx(sum(offline) / 5, rel=1e-12)
    assert k3(torch.tensor([0.0])).item() == 0.0


def test_the_weight_multiplies_the_policy_gradient_term_only():
    # μ = 1 (ratio 1), A = +1 and -1, bnpo over 5 tokens, beta = 0.1 with ref = logp (KL 0,
    # gradient 0), ICEPOP's band [0.8, 2]: weights [0, 1, 0], [1.2, 0.9].
    # loss = Σ -A·w / 5 = (-(0 + 1 + 0) + (1.2 + 0.9)) / 5 = 1.1 / 5; ∂/∂logp = -A·w / 5
    logp = OLD.clone().requires_grad_()
    inputs = LossInputs(
        logp, OLD, torch.tensor([1.0, -1.0], dtype=torch.float64), MASK,
        sampling_logprobs=SAMPLING, ref_logprobs=OLD,
    )  # fmt: skip
    cfg = LossConfig(
        loss_type="bnpo", beta=0.1, correction_mode="mask", correction_low=0.8, tis_cap=2.0
    )
    loss, m = grpo_loss(inputs, cfg)
    assert loss.item() == pytest.approx(1.1 / 5, rel=1e-12)
    loss.backward()
    _close(logp.grad, [[0.0, -0.2, 0.0], [1.2 / 5, 0.9 / 5, 0.0]])
    assert m["is_weight"].item() == pytest.approx((2 + 1 + 0.5 + 1.2 + 0.9) / 5)  # drift gauge
    assert m["off_policy/masked"].item() == pytest.approx(2 / 5)


def test_tokens_per_version_lag():
    # learner at version 5; rollouts from 5, 4, 4, 3 with 10, 7, 3, 2 loss tokens
    got = tokens_per_version_lag([5, 4, 4, 3], [10, 7, 3, 2], 5, at_least=3)
    assert got == {0: 10, 1: 10, 2: 2, 3: 0}
    assert tokens_per_version_lag([], [], 5, at_least=1) == {0: 0, 1: 0}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["grpo.correction_low=0.5"], r"grpo\.correction_low: truncation caps"),
        (['grpo.correction_mode="mask"', "grpo.correction_low=1.5"], r"grpo\.correction_low"),
        (['grpo.correction_mode="mask"', "grpo.tis_cap=0.9"], r"grpo\.tis_cap: masking above"),
        (['grpo.correction_mode="mask"', "grpo.tis_cap=none"], r"grpo\.correction_mode"),
        (["grpo.reject_low=1.5"], r"grpo\.reject_low"),
        (["grpo.reject_high=0.5"], r"grpo\.reject_high"),
        (["grpo.reject_high=1.1", "grpo.fused_loss=true"], r"grpo\.reject_high: .*fused_loss"),
        (
            ['grpo.correction_level="geo_sequence"', "grpo.fused_loss=true"],
            r"grpo\.correction_level: .*fused_loss = false",
        ),
        (['grpo.correction_level="seq"'], r"grpo\.correction_level: Input should be"),
    ],
)
def test_the_config_refuses(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, overrides)


def test_tis_cap_alone_is_token_truncation_as_before():
    cfg = load_config(DEMO, ["grpo.tis_cap=1.5"]).grpo
    assert cfg.correction == Correction("token", "truncate", None, 1.5, None, None)
    assert cfg.needs_sampling_logprobs
    off = load_config(DEMO, ["grpo.tis_cap=none"]).grpo
    assert not off.needs_sampling_logprobs
    # a rejection band alone still needs the servers' log-probs
    assert load_config(
        DEMO, ["grpo.tis_cap=none", "grpo.reject_high=1.5"]
    ).grpo.needs_sampling_logprobs
    loss_cfg = LossConfig.of(
        load_config(DEMO, ['grpo.correction_mode="mask"', "grpo.correction_low=0.5"]).grpo, 16
    )
    assert loss_cfg.correction == Correction("token", "mask", 0.5, 2.0, None, None)
