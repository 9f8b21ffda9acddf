"""The fused linear + GRPO loss against `grpo_loss(token_logprobs(...))` and float64 logits: the
Triton path, and the GPU tests.

The Triton path runs under Triton's interpreter in a subprocess (TRITON_INTERPRET must be set
before triton is imported), and at realistic sizes on a GPU (`pytest -m gpu`, the torch path's
GPU checks too). The torch path's CPU tests are in test_fused_loss_torch.py; what both files
share is in fused_loss_common.py.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from learner.loss.fused import fused_grpo_loss
from learner.loss.grpo import LossConfig
from learner.loss.token import GRPOTokenLoss
from tests.learner.loss.fused_loss_common import (
    LENS,
    VARIANTS,
    fused,
    grads_of,
    make,
    reference_loss,
    rel,
    run_full,
    run_fused,
    separable,
)


def run_triton_checks(device, n_lens, hd, v, chunk_sizes, fwd_rows, temperature=0.8, seed=0):
    """[(name, error, tolerance)]: the Triton path in bf16/fp16 vs float64 on the same inputs.
    `fwd_rows` < the chunk sizes: the forward kernel runs each chunk as several launches."""
    from learner.loss.kernels import triton_fused

    triton_fused.FWD_ROWS = fwd_rows
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        # Logits of std ~3 at any width (0.7 · √16, as the CPU tests' make()): with 0.7 at
        # H = 520 they reach ±100, the KL term's exp(ref - logp) 1e10, and the exact gradients
        # (6e10) do not fit in fp16 at all.
        h, w, t, seq, ex = make(dtype, lens=n_lens, hd=hd, v=v, seed=seed, w_std=2.8 / hd**0.5)
        h, w = h.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        t, seq = t.to(device), seq.to(device)
        ex = {k: x.to(device) for k, x in ex.items()}
        g = torch.Generator().manual_seed(seed + 1)
        cl = torch.randn(t.numel(), generator=g, dtype=torch.float64).to(device)
        ce = torch.randn(t.numel(), generator=g, dtype=torch.float64).to(device)
        for with_ent in (False, True):
            token_loss = separable(cl, ce if with_ent else None)
            ref = grads_of(functools.partial(run_full, h, w, t, token_loss, temperature), h, w)
            for cs, fp32 in [(c, False) for c in chunk_sizes] + [(chunk_sizes[0], True)]:
                tag = f"{dtype} entropy term={with_ent} chunk={cs} fp32 dW={fp32}"
                run = functools.partial(
                    run_fused, h, w, t, token_loss, temperature=temperature, chunk_size=cs,
                    fp32_weight_grad=fp32, impl="triton",
                )  # fmt: skip
                ours = grads_of(run, h, w)
                for i, name in enumerate(("loss", "logp", "entropy")):
                    out.append((f"{name} {tag}", rel(ours[i], ref[i]), 1e-4))
                out.append((f"grad_hidden {tag}", rel(ours[4], ref[4]), 1e-2))
                out.append((f"grad_weight {tag}", rel(ours[5], ref[5]), 1e-2))
                out.append((f"logp<=0 {tag}", float(ours[1].max().clamp_min(0)), 1e-30))
                finite = all(bool(torch.isfinite(x).all()) for x in (*ours[1:3], *ours[4:]))
                out.append((f"finite {tag}", float(not finite), 0.5))
        if dtype == torch.bfloat16:  # anchored tiles: a target 2^-128 below its row's max
            for ent_term in (None, ce):
                out += _overflow_checks(h, w, t, cl, ent_term, temperature, chunk_sizes[0])
        out += _scale_kernel_checks(device, dtype)
        cfg = LossConfig(loss_type="grpo", beta=0.1, tis_cap=1.5, entropy_coef=0.3)
        args = (h, w, t, seq, ex, cfg, ("ref", "sampling"), True, temperature)
        run = functools.partial(fused, *args, chunk_size=chunk_sizes[0], impl="triton")
        ours = grads_of(run, h, w)
        ref = grads_of(functools.partial(reference_loss, *args), h, w)
        for i, name in ((0, "loss"), (4, "grad_hidden"), (5, "grad_weight")):
            out.append((f"grpo_loss {name} {dtype}", rel(ours[i], ref[i]), 1e-2))
    return out + _token_grads_kernel_checks(device) + _nll_checks(device, chunk_sizes[0])


def _nll_checks(device, chunk_size):
    """The SFT loss on the fused Triton path (`chunked_nll(fused=True)`: `NLLTokenLoss`,
    constant per-token gradients, anchored tiles row-scaled) against float64 cross entropy over
    the masked tokens, bf16."""
    import torch.nn.functional as F

    from learner.loss.nll import chunked_nll

    h, w, t, _, _ = make(torch.bfloat16, seed=5)
    h, w = h.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
    t = t.to(device)
    mask = (torch.arange(t.numel()) % 3 != 1).to(device)  # two tokens in three are targets

    def loss_and_grads(run):
        h.grad = w.grad = None
        loss = run()
        loss.backward()
        return loss.detach(), h.grad.clone(), w.grad.clone()

    want = loss_and_grads(lambda: F.cross_entropy((h.double() @ w.double().T)[mask], t[mask]))
    got = loss_and_grads(
        lambda: chunked_nll(h, w, t, mask, fused=True, fused_chunk_size=chunk_size, impl="triton")
    )
    names = ("loss", "grad_hidden", "grad_weight")
    tols = (1e-4, 1e-2, 1e-2)
    return [
        (f"nll {name}, fused triton", rel(a, b), tol)
        for name, a, b, tol in zip(names, got, want, tols, strict=True)
    ]


def _token_grads_kernel_checks(device):
    """`grpo_token_grads` (one launch, CUDA's path of `GRPOTokenLoss.token_grads`) against the
    PyTorch closed form, fp32, for every loss term, with ratios on both clip sides, exactly 1
    (min's tie) and a zero advantage."""
    from learner.loss.kernels.triton_fused import grpo_token_grads

    _, _, _, seq, ex = make(torch.float64)
    n = seq.numel()
    g = torch.Generator().manual_seed(3)
    flat_old = ex["old"][seq, torch.cat([torch.arange(k) for k in LENS])]
    lp = flat_old + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    lp[::4] = flat_old[::4]
    adv = ex["advantages"].clone()
    adv[1] = 0.0
    out = []
    for variant, (kw, names) in VARIANTS.items():
        for mu1 in (False, True):
            cfg = LossConfig(loss_type="dapo", **kw)
            tl = GRPOTokenLoss(
                cfg, seq.to(device), adv.float().to(device),
                old_logprobs=None if mu1 else ex["old"].float().to(device),
                **{f"{k}_logprobs": ex[k].float().to(device) for k in names},
            )  # fmt: skip
            x = lp.float().to(device)
            want, _ = tl.token_grads(x, x, 0, n)  # on CPU: the PyTorch closed form
            a, w_, old, ref, samp, _ = tl._consts
            clip = (1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
            got = grpo_token_grads(x, a, w_, old, ref, samp, clip, cfg.beta, cfg.tis_cap)
            out.append((f"grpo_token_grads {variant} mu1={mu1}", rel(got, want), 1e-6))
    return out


def _scale_kernel_checks(device, dtype):
    """The row-scale and in-place scale kernels the fused path applies its gradients with."""
    from learner.loss.kernels.triton_fused import row_scale, scale_

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 1500, generator=g).to(dtype).to(device)
    sc = (torch.rand(37, generator=g, dtype=torch.float64) * 1e-3).float().to(device)
    want = (x.double() * sc.double()[:, None]).to(dtype)
    # bf16: Triton's interpreter rounds toward zero (an ulp, 2^-8, off round-to-nearest)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-30
    out = [(f"row_scale {dtype}", rel(row_scale(x, sc, torch.empty_like(x)), want), tol)]
    y = x.clone()
    out.append((f"row_scale in place {dtype}", rel(row_scale(y, sc, y), want), tol))
    for v in (2.5, 1.0):
        y = x.clone()
        scale_(y, torch.tensor([v], device=device))
        out.append((f"scale_ by {v} {dtype}", rel(y, (x.double() * v).to(dtype)), tol))
    return out


def _overflow_checks(h, w, t, cl, ce, temperature, chunk_size):
    """Two tokens whose target is the least likely token by ~90·T nats and more: their
    anchored tiles (2^(z - z_target) in bf16) overflow, and the fallback redoes those rows
    (with an entropy term `ce` too: then the in-place pass reads the fallback's tiles)."""
    h = h.detach().clone()
    t = t.clone()
    for k in (0, h.shape[0] - 1):
        h[k] *= 40.0
        t[k] = int((h[k].double() @ w.detach().double().T).argmin())
    h.requires_grad_()
    token_loss = separable(cl, ce)
    ref = grads_of(functools.partial(run_full, h, w, t, token_loss, temperature), h, w)
    run = functools.partial(
        run_fused, h, w, t, token_loss, temperature=temperature, chunk_size=chunk_size,
        impl="triton",
    )  # fmt: skip
    ours = grads_of(run, h, w)
    tag = f"overflowing anchor (target logp {float(ref[1][0]):.0f}, {float(ref[1][-1]):.0f})"
    tag += " with entropy term" if ce is not None else ""
    out = [
        (f"{name} {tag}", rel(ours[i], ref[i]), 1e-4) for i, name in ((1, "logp"), (2, "entropy"))
    ]
    out.append((f"grad_hidden {tag}", rel(ours[4], ref[4]), 1e-2))
    out.append((f"grad_weight {tag}", rel(ours[5], ref[5]), 1e-2))
    finite = all(bool(torch.isfinite(x).all()) for x in (*ours[1:3], *ours[4:]))
    out.append((f"finite {tag}", float(not finite), 0.5))
    out.append((f"the targets are 2^-128 unlikely {tag}", float(ref[1][[0, -1]].max() + 130), 0.0))
    return out


def test_triton_path_under_interpreter():
    from tests.learner.loss.triton_checks import assert_all, run_under_interpreter

    results = run_under_interpreter(__file__)
    assert len(results) > 80
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_path_on_gpu():
    # Odd sizes: hidden 520, vocab 50_001 (partial last tile), 2000 tokens in 4 ragged rollouts.
    from tests.learner.loss.triton_checks import assert_all

    assert_all(run_triton_checks("cuda", [700, 0, 900, 400], 520, 50_001, [512, 2000], 768))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_targets_checked_on_gpu_without_a_host_sync(impl):
    """Out-of-range targets still get the ValueError on CUDA, from the forward (the kernels
    read clamped targets meanwhile, so nothing reads out of bounds and the GPU stays usable),
    and a whole fwd+bwd with the GRPO token loss makes no host sync PyTorch can see."""
    lens = [300, 0, 500, 200]
    h, w, t, seq, ex = make(torch.float32, lens=lens, hd=64, v=3000, w_std=2.8 / 8)
    dev = torch.device("cuda")
    h = h.detach().to(dev, torch.bfloat16).requires_grad_()
    w = w.detach().to(dev, torch.bfloat16).requires_grad_()
    t, seq = t.to(dev), seq.to(dev)
    ex = {k: x.to(dev) for k, x in ex.items()}
    cfg = LossConfig(beta=0.04)
    args = (h, w, t, seq, ex, cfg, ("ref",), True, 0.9)
    for bad in (t + 3000, t - 3000):
        with pytest.raises(ValueError, match="targets must lie in \\[0, 3000\\); got min"):
            fused(h, w, bad, *args[3:], chunk_size=256, impl=impl)
    torch.cuda.synchronize()  # a device-side fault would surface here
    want = grads_of(functools.partial(reference_loss, *args), h, w)
    h.grad = w.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _, _, _ = fused(*args, chunk_size=256, impl=impl)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rel(loss, want[0]) < 1e-3
    assert rel(h.grad, want[4]) < 1e-2
    assert rel(w.grad, want[5]) < 1e-2


class _HostSync:
    """A token loss that reads its value on the host: it cannot be captured in a CUDA graph."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, logp, entropy):
        loss = self.inner(logp, entropy)
        assert float(loss.detach()) == float(loss.detach())  # .item(): a device-to-host sync
        return loss


class _Autograd:
    """A token loss differentiated by autograd: `GRPOTokenLoss` without its closed form."""

    def __init__(self, inner):
        self.inner = inner
        self.entropy_grad = inner.entropy_grad

    def __call__(self, logp, entropy):
        return self.inner(logp, entropy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_token_grads_equal_eager_ones_and_fall_back():
    """A token loss differentiated by autograd: its per-chunk gradients replayed from a CUDA
    graph are the eager ones, bit for bit (the process's first capture after an eager chunk,
    later ones before the first chunk); a token loss with a host sync falls back to eager with
    a warning, same results. `GRPOTokenLoss`'s closed form gives the same loss and gradients
    to rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hd, v, b = 3000, 256, 5000, 4
    h = torch.randn(n, hd, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, hd, device="cuda", generator=g) * hd**-0.5).bfloat16()
    tgt = torch.randint(0, v, (n,), device="cuda", generator=g)
    seq = torch.arange(b, device="cuda").repeat_interleave(n // b)
    old = -torch.rand(n, device="cuda", generator=g) - 8
    ref = old + 0.05 * torch.randn(n, device="cuda", generator=g)
    adv = torch.randn(b, device="cuda", generator=g)
    cfg = LossConfig(beta=0.04, tis_cap=2.0, entropy_coef=0.01)
    token_loss = GRPOTokenLoss(
        cfg, seq, adv, old_logprobs=old, ref_logprobs=ref, sampling_logprobs=old - 0.1
    )
    assert not token_loss.constant_grads

    def run(loss_fn, graph):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fused_grpo_loss(
            hh, ww, tgt, loss_fn, temperature=0.9, chunk_size=512, cuda_graph=graph
        )
        out[0].backward()
        return (*out, hh.grad, ww.grad)

    plain = _Autograd(token_loss)
    eager = run(plain, False)
    for a, c in zip(eager, run(plain, True), strict=True):
        assert torch.equal(a, c)
    # once warm, another token loss (other lengths) is captured before its first chunk
    seq3 = torch.arange(b, device="cuda").repeat_interleave(
        torch.tensor([500, 1000, 700, 800]).cuda()
    )
    third = _Autograd(GRPOTokenLoss(cfg, seq3, adv, old_logprobs=old, ref_logprobs=ref))
    for a, c in zip(run(third, False), run(third, True), strict=True):
        assert torch.equal(a, c)
    with pytest.warns(UserWarning, match="could not be captured in a CUDA graph"):
        fallen = run(_HostSync(token_loss), True)
    # found before any capture: a capture that fails part way leaves the CUDA RNG marked as
    # capturing ("Offset increment outside graph capture" here) and memory behind
    torch.randint(0, 10, (4,), device="cuda")
    for a, c in zip(eager, fallen, strict=True):
        assert torch.equal(a, c)
    closed = run(token_loss, True)  # token_grads: no graph, no autograd
    for a, c in zip(eager[:3], closed[:3], strict=True):  # loss, log-probs, entropy: the same
        assert torch.equal(a, c)
    for a, c in zip(eager[3:], closed[3:], strict=True):  # gradients: bf16 roundings of G
        assert rel(c, a) < 1e-3, rel(c, a)


if __name__ == "__main__":  # the interpreter run: tiny sizes, CPU
    print(json.dumps(run_triton_checks("cpu", [13, 0, 11], 32, 300, [10, 24], fwd_rows=7)))
