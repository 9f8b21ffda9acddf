"""Triton log-prob kernels against float64 full logits.

On CPU the kernels run under Triton's interpreter at tiny sizes. TRITON_INTERPRET must be set
before triton is imported, and other tests of the session may already have imported it, so
the checks run in a subprocess (this file executed as a script). On a GPU the same checks run
at realistic sizes in bf16 (`pytest -m gpu`).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.learner.loss.fp16_checks import fp16_small_gradient_checks


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _reference(h, w, t, temperature):
    z = (h.double() @ w.double().T) / temperature  # [N, V]
    lp = torch.log_softmax(z, dim=-1)
    return lp.gather(1, t[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


def _grads(loss_fn, h, w):
    h.grad = w.grad = None
    loss = loss_fn()
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def run_checks(device, dtype, n, hd, v, blockings, temperature=0.8, seed=0):
    """Returns [(name, error, tolerance)] for log-probs, entropy, gradients and every loss type."""
    from learner.loss.grpo import LOSS_TYPES, LossConfig, LossInputs, grpo_loss
    from learner.loss.kernels import triton_logprobs as tk
    from learner.loss.logprobs import token_logprobs

    exact = dtype == torch.float32
    tol_val, tol_grad = (1e-5, 1e-5) if exact else (1e-4, 1e-2)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hd, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, hd, generator=g) * 2 / hd**0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)
    cl = torch.randn(n, generator=g, dtype=torch.float64).to(device)
    ce = torch.randn(n, generator=g, dtype=torch.float64).to(device)
    out = []
    for blocking in blockings:
        tk.FORCE_BLOCKING = blocking
        tag = f"{dtype}-{blocking}"
        lp, ent = token_logprobs(h, w, t, temperature=temperature, impl="triton")
        ref_lp, ref_ent = _reference(h, w, t, temperature)
        out += [(f"logp {tag}", _rel(lp, ref_lp), tol_val)]
        out += [(f"entropy {tag}", _rel(ent, ref_ent), tol_val)]
        out += [(f"logp<=0 {tag}", float(lp.detach().max().clamp_min(0)), 1e-30)]
        out += [(f"nan {tag}", float(~torch.isfinite(lp).all() | ~torch.isfinite(ent).all()), 0.5)]

        def ours(with_ent):
            lp, ent = token_logprobs(h, w, t, temperature=temperature, impl="triton")
            return (lp.double() * cl).sum() + ((ent.double() * ce).sum() if with_ent else 0)

        def theirs(with_ent):
            lp, ent = _reference(h, w, t, temperature)
            return (lp * cl).sum() + ((ent * ce).sum() if with_ent else 0)

        for with_ent in (True, False):
            _, gh, gw = _grads(lambda we=with_ent: ours(we), h, w)
            _, rh, rw = _grads(lambda we=with_ent: theirs(we), h, w)
            out += [(f"grad_hidden ent={with_ent} {tag}", _rel(gh, rh), tol_grad)]
            out += [(f"grad_weight ent={with_ent} {tag}", _rel(gw, rw), tol_grad)]
    tk.FORCE_BLOCKING = blockings[-1]
    b = 4 if n % 4 == 0 else 1
    with torch.no_grad():
        base, _ = _reference(h, w, t, temperature)
    old = (base + 0.1 * torch.randn(n, generator=g, dtype=torch.float64).to(device)).view(b, -1)
    sampling = old - 0.3 * torch.rand(old.shape, generator=g, dtype=torch.float64).to(device)
    ref = old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64).to(device)
    adv = torch.randn(b, generator=g, dtype=torch.float64).to(device)
    mask = (torch.rand(old.shape, generator=g) < 0.9).double().to(device)
    for loss_type in LOSS_TYPES:
        cfg = LossConfig(
            loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_completion_length=n // b
        )

        def loss_of(fn, cfg=cfg):
            lp, ent = fn()
            inputs = LossInputs(
                lp.double().view(b, -1),
                old,
                adv,
                mask,
                sampling_logprobs=sampling,
                ref_logprobs=ref,
                entropy=ent.double().view(b, -1),
            )
            return grpo_loss(inputs, cfg)[0]

        ours_l = _grads(
            lambda: loss_of(
                lambda: token_logprobs(h, w, t, temperature=temperature, impl="triton")
            ),
            h,
            w,
        )
        ref_l = _grads(lambda: loss_of(lambda: _reference(h, w, t, temperature)), h, w)
        for name, a, r in zip(("loss", "grad_hidden", "grad_weight"), ours_l, ref_l, strict=True):
            out += [(f"{loss_type} {name} {dtype}", _rel(a, r), tol_grad)]
    tk.FORCE_BLOCKING = None
    return out


def test_triton_kernels_under_interpreter():
    from tests.learner.loss.triton_checks import assert_all, run_under_interpreter

    results = run_under_interpreter(__file__)
    assert len(results) > 40
    assert_all(results)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("dtype", "blockings", "dh_impl"),
    [
        (torch.bfloat16, [None, (512, 4096)], "auto"),
        (torch.bfloat16, [(512, 4096)], "triton"),
        (torch.float32, [(512, 4096)], "auto"),
    ],
)
def test_triton_kernels_on_gpu(dtype, blockings, dh_impl):
    # Odd sizes (no multiple of any tile); the (512, 4096) blocking forces several token and
    # vocab blocks (the addmm_ accumulation of grad_weight, the fp32 grad_hidden accumulator,
    # by cuBLAS where this torch can and by the Triton kernel).
    from learner.loss.kernels import triton_logprobs as tk

    tk.DH_IMPL = dh_impl
    try:
        from tests.learner.loss.triton_checks import assert_all

        assert_all(run_checks("cuda", dtype, 2000, 520, 50_001, blockings))
    finally:
        tk.DH_IMPL = "auto"


@pytest.mark.gpu
@needs_cuda
def test_triton_matches_torch_path_at_qwen_head_width():
    from learner.loss.logprobs import token_logprobs

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(151_936, 1024, device="cuda", generator=g) * 0.06).bfloat16()
    t = torch.randint(0, 151_936, (4096,), device="cuda", generator=g)
    lp, ent = token_logprobs(h, w, t, impl="triton")
    rlp, rent = token_logprobs(h, w, t, impl="torch")
    assert _rel(lp, rlp) < 1e-4 and _rel(ent, rent) < 1e-4
    assert bool((lp <= 0).all()) and bool(torch.isfinite(ent).all())


@pytest.mark.gpu
@needs_cuda
def test_fp16_gradients_at_grpo_magnitudes_on_gpu():
    """Per-token weights of 1/tokens, as a GRPO batch's: unscaled, fp16 would lose the softmax
    part of ∂loss/∂logits (1/2000 · 1/50001 is below fp16's smallest subnormal)."""
    from tests.learner.loss.triton_checks import assert_all

    assert_all(fp16_small_gradient_checks("cuda", 2000, 520, 50_001, weights=(1 / 2000,)))


if __name__ == "__main__":  # the interpreter run: tiny sizes, CPU
    torch.manual_seed(0)
    res = []
    res += run_checks("cpu", torch.float32, 24, 40, 70, [None, (16, 32)])
    res += run_checks("cpu", torch.bfloat16, 24, 40, 70, [(16, 32)], seed=1)
    # both Triton paths; at this size the check still fails unscaled (grad_hidden 4.9 % and
    # grad_weight 2.2 % against 2 %) and takes ~20 s under the interpreter (85 s at 200x3000)
    res += fp16_small_gradient_checks("cpu", 64, 32, 2048)
    print(json.dumps(res))
