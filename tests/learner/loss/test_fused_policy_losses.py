"""The fused loss (torch path, CPU) with CISPO, SAPO and the token-level off-policy corrections,
against the unfused `grpo_loss(token_logprobs(...))`; the configurations it cannot compute
(GMPO, sequence-level weights, rejection) refused."""

from __future__ import annotations

import pytest
import torch

from learner.loss.grpo import LossConfig
from learner.loss.token import GRPOTokenLoss
from tests.learner.loss.fused_loss_common import fused, grads_of, make, reference_loss, rel

CASES = {
    "cispo": ({"policy_loss": "cispo", "eps_high": 0.2}, ()),
    "cispo_floor_kl_is": (
        {"policy_loss": "cispo", "cispo_eps_low": 0.1, "beta": 0.1, "tis_cap": 1.5},
        ("ref", "sampling"),
    ),
    "sapo": ({"policy_loss": "sapo", "sapo_tau_pos": 0.7, "sapo_tau_neg": 1.6}, ()),
    "sapo_entropy_is": (
        {"policy_loss": "sapo", "entropy_coef": 0.3, "tis_cap": 1.5},
        ("sampling",),
    ),
    "ppo_mis": ({"correction_mode": "mask", "tis_cap": 1.3}, ("sampling",)),
    "ppo_icepop": (
        {"correction_mode": "mask", "correction_low": 0.8, "tis_cap": 1.3},
        ("sampling",),
    ),
    "cispo_icepop": (
        {"policy_loss": "cispo", "correction_mode": "mask", "correction_low": 0.8, "tis_cap": 1.3},
        ("sampling",),
    ),
}


@pytest.mark.parametrize("old", [True, False])  # False: μ = 1, old = current log-probs detached
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_fused_equals_unfused(loss_type, case, old):
    over, uses = CASES[case]
    cfg = LossConfig(loss_type=loss_type, max_completion_length=16, **over)
    h, w, t, seq, ex = make(torch.float64)
    kw = {"num_items_in_batch": 70.0, "dp_world_size": 2, "num_micro_batches": 3}
    args = (t, seq, ex, cfg, uses, old, 0.8)
    ours = grads_of(lambda: fused(h, w, *args, **kw), h, w)
    ref = grads_of(lambda: reference_loss(h, w, *args, **kw), h, w)
    assert rel(ours[0], ref[0]) < 1e-9, "loss"
    assert ours[3].keys() == ref[3].keys()
    for k in ref[3]:
        assert abs(float(ours[3][k]) - float(ref[3][k])) < 1e-9, k
    assert rel(ours[4], ref[4]) < 1e-9, "grad_hidden"
    assert rel(ours[5], ref[5]) < 1e-9, "grad_weight"
    if "sampling" in uses and "mask" in str(over.get("correction_mode")):
        assert 0 < float(ref[3]["off_policy/masked"]) < 1  # the mask does something here


def test_the_closed_form_is_autograd():
    """`token_grads` (closed form) equals autograd through the token loss for every new case."""
    from learner.loss.token_grads import autograd_token_grads

    *_, seq, ex = make(torch.float64)
    n = seq.numel()
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    ent = torch.rand(n, generator=g, dtype=torch.float64)
    for name, (over, uses) in CASES.items():
        cfg = LossConfig(loss_type="bnpo", **over)
        token_loss = GRPOTokenLoss(
            cfg,
            seq,
            ex["advantages"],
            old_logprobs=ex["old"],
            sampling_logprobs=ex["sampling"] if "sampling" in uses else None,
            ref_logprobs=ex["ref"] if "ref" in uses else None,
        )
        closed, _ = token_loss.token_grads(lp, ent, 0, n)
        auto, _ = autograd_token_grads(token_loss, lp, ent, 0, n)
        torch.testing.assert_close(closed, auto, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "over",
    [
        {"policy_loss": "gmpo"},
        {"correction_level": "geo_sequence"},
        {"correction_level": "sequence", "correction_mode": "mask"},
        {"reject_low": 0.5},
    ],
)
def test_the_token_loss_refuses_what_is_not_separable(over):
    with pytest.raises(ValueError, match="separable"):
        GRPOTokenLoss(LossConfig(**over), torch.zeros(3, dtype=torch.long), torch.ones(1))
