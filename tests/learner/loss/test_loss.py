"""GRPO loss: hand-computed cases, and the chunked path end to end against float64 logits."""

import math
from pathlib import Path

import pytest
import torch

from learner.config import ConfigError, load_config
from learner.loss.grpo import LOSS_TYPES, LossConfig, LossInputs, grpo_loss
from learner.loss.logprobs import token_logprobs

ROOT = Path(__file__).resolve().parents[3]


def hand_inputs(mask):
    # ratios: exp(0.1) = 1.105171, exp(0) = 1, exp(0) = 1, exp(-0.5) = 0.606531
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.0], [-0.5, -1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return LossInputs(logp, old, adv, torch.tensor(mask, dtype=torch.float64))


# Clip range [0.8, 1.28]. Per token, -min(r·A, clip(r)·A):
#   seq 0 (A = +1): -1.105171, -1.0       seq 1 (A = -1): +1.0, +0.8 (r = 0.6065 clipped to 0.8)
# With mask [[1, 1], [1, 0]] the last token is out of the loss.
#   grpo:    mean(-2.105171 / 2, 1.0 / 1) = (-1.0525855 + 1) / 2 = -0.02629275
#   bnpo:    (-1.105171 - 1 + 1) / 3 = -0.36839033
#   dr_grpo: -1.105171 / (2 · 4) = -0.13814638            (max_completion_length = 4)
#   dapo:    -1.105171 · 2 / 10 = -0.22103418             (10 tokens in the step, 2 ranks)
@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [("grpo", -0.02629275), ("bnpo", -0.36839033), ("dr_grpo", -0.13814638), ("dapo", -0.22103418)],
)
def test_hand_computed_loss_types(loss_type, expected):
    inputs = hand_inputs([[1, 1], [1, 0]])
    inputs.num_items_in_batch, inputs.dp_world_size = 10, 2
    cfg = LossConfig(loss_type=loss_type, max_completion_length=4)
    loss, _ = grpo_loss(inputs, cfg)
    assert abs(loss.item() - expected) < 1e-7
    loss.backward()
    assert inputs.logprobs.grad[1, 1] == 0  # masked


def test_hand_computed_gradient_and_clip_metrics():
    inputs = hand_inputs([[1, 1], [1, 1]])
    loss, m = grpo_loss(inputs, LossConfig(loss_type="bnpo"))
    # Per token: -1.105171, -1, 1, 0.8 -> mean -0.07629275
    assert abs(loss.item() - (-1.105171 - 1 + 1 + 0.8) / 4) < 1e-6
    loss.backward()
    # ∂/∂logp = -A·r / 4 where unclipped; the clipped token gets no gradient.
    expected = torch.tensor([[-1.105171 / 4, -0.25], [0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(inputs.logprobs.grad, expected, atol=1e-6, rtol=0)
    # The one clipped token: r = 0.6065 < 0.8 with A < 0 -> clip_low = 1/4.
    assert m["clip_low"].item() == 0.25 and m["clip_high"].item() == 0.0
    assert m["clip_region"].item() == 0.25
    assert abs(m["ratio_mean"].item() - (1.105171 + 1 + 1 + 0.606531) / 4) < 1e-6
    assert m["num_tokens"].item() == 4


def test_hand_computed_high_clip():
    # r = exp(0.5) = 1.6487 > 1.28 with A = +2: loss -1.28·2 = -2.56, no gradient.
    logp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(logp, torch.tensor([[-0.5]]), torch.tensor([2.0]), torch.ones(1, 1))
    loss, m = grpo_loss(inputs, LossConfig())
    assert abs(loss.item() + 2.56) < 1e-12
    loss.backward()
    assert logp.grad.item() == 0.0
    assert m["clip_high"].item() == 1.0 and m["clip_low"].item() == 0.0


def test_hand_computed_kl_and_truncated_importance_sampling():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach().clone()  # μ = 1: ratio 1
    # IS weights exp(old - sampling) = [3, 1.5] -> capped at 2 -> [2, 1.5]
    sampling = old - torch.tensor([[math.log(3.0), math.log(1.5)]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -1.5]], dtype=torch.float64)
    inputs = LossInputs(
        logp,
        old,
        torch.tensor([0.5], dtype=torch.float64),
        torch.ones(1, 2),
        sampling_logprobs=sampling,
        ref_logprobs=ref,
    )
    loss, m = grpo_loss(inputs, LossConfig(loss_type="bnpo", beta=0.1, tis_cap=2.0))
    # pg = -0.5 · [2, 1.5] = [-1, -0.75]
    # k3 with d = ref - logp = [-0.2, 0.5]: exp(d) - d - 1 = [0.01873075, 0.14872127]
    # per token = pg + 0.1·k3 = [-0.99812692, -0.73512787]; mean = -0.86662740
    assert abs(loss.item() - (-0.86662740)) < 1e-7
    assert abs(m["kl"].item() - (0.01873075 + 0.14872127) / 2) < 1e-7
    assert abs(m["is_weight"].item() - 1.75) < 1e-12
    loss.backward()
    # ∂/∂logp: -A·w/2 + 0.1·(1 - exp(d))/2 = [-0.5 + 0.00906346, -0.375 - 0.03243606]
    torch.testing.assert_close(
        logp.grad,
        torch.tensor([[-0.49093654, -0.40743606]], dtype=torch.float64),
        atol=1e-7,
        rtol=0,
    )


def test_tis_cap_none_disables_the_weight():
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1), sampling_logprobs=logp - 5
    )
    loss, m = grpo_loss(inputs, LossConfig(tis_cap=None))
    assert loss.item() == -1.0 and "is_weight" not in m


def test_entropy_bonus():
    # Ratio 1, A = 0 -> pg = 0; loss = -0.01 · mean(entropy) = -0.01 · 2 = -0.02
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    inputs = LossInputs(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), entropy=ent)
    loss, m = grpo_loss(inputs, LossConfig(loss_type="bnpo", entropy_coef=0.01))
    assert abs(loss.item() + 0.02) < 1e-7 and m["entropy"].item() == 2.0
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.005, -0.005]]))


def random_batch(b=6, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.7).double()
    mask[:, 0] = 1
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def test_dapo_gradient_accumulation_equals_one_big_batch():
    # Two micro-batches with num_items_in_batch = all tokens of the step sum to the loss of
    # the whole batch; so do grpo halves with num_micro_batches = 2 (equal-size halves).
    logp, old, adv, mask = random_batch()
    total = mask.sum()
    whole, _ = grpo_loss(LossInputs(logp, old, adv, mask, num_items_in_batch=total), LossConfig())
    parts = sum(
        grpo_loss(
            LossInputs(logp[s], old[s], adv[s], mask[s], num_items_in_batch=total), LossConfig()
        )[0]
        for s in (slice(0, 2), slice(2, 6))  # unequal micro-batches on purpose
    )
    assert abs(whole.item() - parts.item()) < 1e-12
    cfg = LossConfig(loss_type="grpo")
    whole, _ = grpo_loss(LossInputs(logp, old, adv, mask), cfg)
    halves = sum(
        grpo_loss(LossInputs(logp[s], old[s], adv[s], mask[s], num_micro_batches=2), cfg)[0]
        for s in (slice(0, 3), slice(3, 6))
    )
    assert abs(whole.item() - halves.item()) < 1e-12


def full_reference_logprobs(h, w, targets, temperature):
    z = (h.double() @ w.double().T) / temperature
    lp = torch.log_softmax(z, -1)
    return lp.gather(1, targets[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("beta", "with_is"), [(0.0, False), (0.05, False), (0.05, True)])
def test_chunked_loss_matches_float64_full_logits(dtype, tol, loss_type, beta, with_is):
    b, t, h, v, temp = 3, 7, 16, 40, 0.9
    g = torch.Generator().manual_seed(7)
    hid = torch.randn(b * t, h, generator=g).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(v, h, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (b * t,), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.8).double()
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    with torch.no_grad():
        base, _ = full_reference_logprobs(hid, w, targets, temp)
    old = (base + 0.2 * torch.randn(b * t, generator=g, dtype=torch.float64)).view(b, t)
    sampling = old - 0.5 * torch.rand(b, t, generator=g, dtype=torch.float64) if with_is else None
    ref = (base + 0.3 * torch.randn(b * t, generator=g, dtype=torch.float64)).view(b, t)
    cfg = LossConfig(
        loss_type=loss_type, beta=beta, max_completion_length=t, entropy_coef=0.01, tis_cap=1.3
    )

    def run(logprob_fn):
        hid.grad = w.grad = None
        lp, ent = logprob_fn()
        inputs = LossInputs(
            lp.double().view(b, t),
            old,
            adv,
            mask,
            sampling_logprobs=sampling,
            ref_logprobs=ref if beta else None,
            entropy=ent.double().view(b, t),
            num_items_in_batch=mask.sum() * 2,
        )
        loss, _ = grpo_loss(inputs, cfg)
        loss.backward()
        return loss.detach(), hid.grad.double().clone(), w.grad.double().clone()

    ours = run(lambda: token_logprobs(hid, w, targets, temperature=temp, chunk_size=4))
    theirs = run(lambda: full_reference_logprobs(hid, w, targets, temp))
    for a, r in zip(ours, theirs, strict=True):
        assert float((a - r).norm() / r.norm()) < tol


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"eps_low": 1.5}, "eps_low"),
        ({"tis_cap": 0.0}, "tis_cap"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ('grpo.loss_type="ppo"', r"grpo\.loss_type: Input should be 'grpo', 'bnpo'"),
        ("grpo.beta=-1.0", r"grpo\.beta: Input should be greater than or equal to 0"),
    ],
)
def test_the_grpo_section_validates_what_loss_config_takes_from_it(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "learner/configs/demo.toml", [override])


def test_loss_config_of_the_grpo_section():
    cfg = load_config(
        ROOT / "learner/configs/demo.toml",
        ['grpo.loss_type="dr_grpo"', "grpo.beta=0.04", "grpo.tis_cap=none", "grpo.eps_low=0.1"],
    )
    loss_cfg = LossConfig.of(cfg.grpo, cfg.sampling.max_tokens)
    g = cfg.grpo
    assert loss_cfg == LossConfig(
        loss_type="dr_grpo",
        eps_low=0.1,
        eps_high=g.eps_high,
        beta=0.04,
        tis_cap=None,
        max_completion_length=cfg.sampling.max_tokens,
        entropy_coef=g.entropy_coef,
        importance_sampling_level=g.importance_sampling_level,
    )


def test_missing_inputs_are_named():
    logp = torch.zeros(2, 3)
    base = LossInputs(logp, logp, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(base, LossConfig(beta=0.1))
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(base, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(LossInputs(logp, logp, torch.zeros(3), torch.ones(2, 3)), LossConfig())
    with pytest.raises(ValueError, match="mask has shape"):
        grpo_loss(LossInputs(logp, logp, torch.zeros(2), torch.ones(2, 4)), LossConfig())
