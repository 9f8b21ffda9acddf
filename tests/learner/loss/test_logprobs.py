"""The chunked PyTorch log-prob path against float64 full logits (values and gradients)."""

import pytest
import torch

from learner.loss.logprobs import token_logprobs
from learner.loss.nll import chunked_nll


def reference(h, w, t, temperature=1.0):
    """float64 full-logits log-probs and entropy (the thing the chunked path must equal)."""
    z = (h.double() @ w.double().T) / temperature  # [N, V]
    lp = torch.log_softmax(z, dim=-1)
    return lp.gather(1, t[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make(n=37, h=16, v=50, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    # Random upstream weights for both outputs, so every gradient path is exercised.
    cl = torch.randn(n, generator=g, dtype=torch.float64)
    ce = torch.randn(n, generator=g, dtype=torch.float64)
    return hid, w, t, cl, ce


def grads(fn, hid, w):
    hid.grad = w.grad = None
    fn().backward()
    return hid.grad.clone(), w.grad.clone()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("chunk_size", [1, 8, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_full_logits(dtype, tol, chunk_size, temperature):
    hid, w, t, cl, ce = make(dtype=dtype)
    lp, ent = token_logprobs(hid, w, t, temperature=temperature, chunk_size=chunk_size)
    ref_lp, ref_ent = reference(hid.detach(), w.detach(), t, temperature)
    assert lp.dtype == ent.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel(lp, ref_lp) < tol and rel(ent, ref_ent) < tol

    def ours():
        lp, ent = token_logprobs(hid, w, t, temperature=temperature, chunk_size=chunk_size)
        return (lp.double() * cl).sum() + (ent.double() * ce).sum()

    def theirs():
        lp, ent = reference(hid, w, t, temperature)
        return (lp * cl).sum() + (ent * ce).sum()

    gh, gw = grads(ours, hid, w)
    rh, rw = grads(theirs, hid, w)
    assert gh.dtype == hid.dtype and gw.dtype == w.dtype
    assert rel(gh, rh) < tol and rel(gw, rw) < tol


def test_logprob_only_gradient_and_no_entropy():
    hid, w, t, cl, _ = make(seed=1)
    _lp, ent = token_logprobs(hid, w, t, chunk_size=5, with_entropy=False)
    assert ent is None
    gh, gw = grads(lambda: (token_logprobs(hid, w, t, chunk_size=5)[0] * cl).sum(), hid, w)
    rh, rw = grads(lambda: (reference(hid, w, t)[0] * cl).sum(), hid, w)
    assert rel(gh, rh) < 1e-10 and rel(gw, rw) < 1e-10


def test_entropy_only_gradient():
    hid, w, t, _, ce = make(seed=2)
    gh, gw = grads(lambda: (token_logprobs(hid, w, t, chunk_size=4)[1] * ce).sum(), hid, w)
    rh, rw = grads(lambda: (reference(hid, w, t)[1] * ce).sum(), hid, w)
    assert rel(gh, rh) < 1e-10 and rel(gw, rw) < 1e-10


def test_peaked_distribution_is_finite_and_exact():
    # Large logits (|z| ~ 100s): exp underflows for most of the vocab; nothing may turn NaN.
    hid, w, t, _cl, ce = make(seed=3, scale=40.0)
    lp, ent = token_logprobs(hid, w, t, chunk_size=16)
    ref_lp, ref_ent = reference(hid.detach(), w.detach(), t)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert rel(lp, ref_lp) < 1e-10
    assert (ent - ref_ent).abs().max() < 1e-10
    gh, gw = grads(lambda: (token_logprobs(hid, w, t)[1] * ce).sum(), hid, w)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_only_inputs_and_per_token_stats_are_saved():
    # The point of chunking: nothing of size N x V may be kept for the backward pass.
    n, v = 64, 300
    hid, w, t, _, _ = make(n=n, v=v)
    lp, _ = token_logprobs(hid, w, t, chunk_size=16)
    saved = lp.grad_fn.saved_tensors
    assert max(s.numel() for s in saved) == v * w.shape[1]  # the weight itself
    assert all(s.numel() < n * v for s in saved)


def test_gradient_to_weight_only():
    hid, w, t, cl, _ = make(seed=4)
    hid = hid.detach()
    (token_logprobs(hid, w, t)[0].double() * cl).sum().backward()
    w_ref = w.detach().clone().requires_grad_()
    (reference(hid, w_ref, t)[0] * cl).sum().backward()
    assert rel(w.grad, w_ref.grad) < 1e-10


def test_bfloat16_inputs_computed_in_fp32():
    hid, w, t, cl, _ = make(dtype=torch.bfloat16, seed=5)
    lp, _ent = token_logprobs(hid, w, t, chunk_size=8)
    assert lp.dtype == torch.float32
    ref_lp, _ = reference(hid.detach(), w.detach(), t)  # same bf16 values, exact arithmetic
    assert rel(lp, ref_lp) < 1e-5
    (lp.double() * cl).sum().backward()
    assert hid.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_chunked_nll_ignores_masked_rows_and_their_targets():
    hid, w, t, _, _ = make(n=12, seed=6)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1])
    targets = torch.where(mask.bool(), t, torch.full_like(t, -100))  # padding ids
    loss = chunked_nll(hid.view(3, 4, -1), w, targets.view(3, 4), mask.view(3, 4), chunk_size=3)
    ref_lp, _ = reference(hid, w, t)
    ref = -(ref_lp * mask).sum() / mask.sum()
    assert rel(loss, ref) < 1e-12
    loss.backward()
    assert hid.grad[~mask.bool()].abs().max() == 0  # masked rows get no gradient


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"targets": torch.tensor([0, 99])}, "targets must lie"),
        ({"targets": torch.tensor([0, -100])}, "targets must lie"),
        ({"targets": torch.tensor([0.0, 1.0])}, "integer tensor"),
        ({"hidden": torch.zeros(2, 3)}, "hidden size mismatch"),
        ({"temperature": 0.0}, "temperature must be"),
        ({"impl": "cuda"}, "impl must be"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = {
        "hidden": torch.zeros(2, 4),
        "weight": torch.zeros(10, 4),
        "targets": torch.tensor([0, 1]),
        "temperature": 1.0,
        "impl": "torch",
    }
    args.update(kwargs)
    h, w, t = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError, match=match):
        token_logprobs(h, w, t, **args)
