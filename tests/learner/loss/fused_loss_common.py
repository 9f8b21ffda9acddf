"""What the fused-loss tests share (test_fused_loss.py: the Triton path and the GPU tests;
test_fused_loss_torch.py: the torch path on CPU): ragged inputs with old, sampling and reference
log-probs, the loss variants, the learner's current path and the fused loss to compare, float64
full logits and a separable token loss, and a run's loss, outputs and gradients.
"""

from __future__ import annotations

import torch

from learner.loss.fused import fused_grpo_loss
from learner.loss.grpo import LossInputs, grpo_loss
from learner.loss.logprobs import token_logprobs
from learner.loss.token import GRPOTokenLoss
from learner.step.update import regroup

LENS = [9, 0, 14, 5, 11]  # loss tokens per rollout: ragged, one rollout without any


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make(dtype, lens=LENS, hd=16, v=50, seed=0, w_std=0.7):
    g = torch.Generator().manual_seed(seed)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # [N]
    n, b = seq.numel(), len(lens)
    h = torch.randn(n, hd, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, hd, generator=g) * w_std).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        base = token_logprobs(h.double(), w.double(), t)[0]
    old = regroup(base + 0.3 * torch.randn(n, generator=g, dtype=torch.float64), seq, b)
    extra = {
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
        "old": old,  # [B, L], ratios far enough from 1 that both clip sides occur
        "sampling": old - 0.5 * torch.rand(old.shape, generator=g, dtype=torch.float64),
        "ref": old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64),
    }
    return h, w, t, seq, extra


VARIANTS = {
    "plain": ({"beta": 0.0, "tis_cap": None}, ()),
    "kl": ({"beta": 0.1, "tis_cap": None}, ("ref",)),
    "is": ({"beta": 0.0, "tis_cap": 1.5}, ("sampling",)),
    "entropy": ({"beta": 0.0, "tis_cap": None, "entropy_coef": 0.3}, ()),
    "all": ({"beta": 0.1, "tis_cap": 1.5, "entropy_coef": 0.3}, ("ref", "sampling")),
}


def reference_loss(h, w, t, seq, ex, cfg, uses, old, temperature, **kw):
    """The learner's current path: chunked log-probs, regrouped, `grpo_loss`."""
    b = ex["advantages"].numel()
    lp, ent = token_logprobs(h.double(), w.double(), t, temperature=temperature, chunk_size=5)
    lp_g = regroup(lp, seq, b)
    inputs = LossInputs(
        logprobs=lp_g,
        old_logprobs=ex["old"] if old else lp_g.detach(),
        advantages=ex["advantages"],
        mask=regroup(torch.ones_like(lp), seq, b),
        sampling_logprobs=ex["sampling"] if "sampling" in uses else None,
        ref_logprobs=ex["ref"] if "ref" in uses else None,
        entropy=regroup(ent, seq, b),
        **kw,
    )
    loss, metrics = grpo_loss(inputs, cfg)
    return loss, lp, ent, metrics


def fused(h, w, t, seq, ex, cfg, uses, old, temperature, chunk_size=4, impl="torch", **kw):
    token_loss = GRPOTokenLoss(
        cfg,
        seq,
        ex["advantages"],
        old_logprobs=ex["old"] if old else None,
        sampling_logprobs=ex["sampling"] if "sampling" in uses else None,
        ref_logprobs=ex["ref"] if "ref" in uses else None,
        **kw,
    )
    loss, lp, ent = fused_grpo_loss(
        h, w, t, token_loss, temperature=temperature, chunk_size=chunk_size, impl=impl
    )
    return loss, lp, ent, token_loss.metrics


def grads_of(run, h, w):
    h.grad = w.grad = None
    loss, lp, ent, metrics = run()
    loss.backward()
    return loss.detach(), lp, ent, metrics, h.grad.clone(), w.grad.clone()


def full_logits(h, w, t, temperature):
    z = (h.double() @ w.double().T) / temperature  # [N, V]
    lp = torch.log_softmax(z, dim=-1)
    return lp.gather(1, t[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


def separable(cl, ce):
    """Σ cl·logp + Σ ce·entropy (a term left out where its weights are None): a separable token
    loss whose random per-token weights exercise every gradient path."""

    def token_loss(lp, ent):
        out = (lp.double() * cl).sum() if cl is not None else 0.0
        return out + (ent.double() * ce).sum() if ce is not None else out

    token_loss.entropy_grad = ce is not None  # without: the Triton path's anchored tiles (bf16)
    return token_loss


def run_full(h, w, t, token_loss, temperature):
    lp, ent = full_logits(h, w, t, temperature)
    return token_loss(lp, ent), lp, ent, {}


def run_fused(h, w, t, token_loss, **kw):
    return (*fused_grpo_loss(h, w, t, token_loss, **kw), {})
