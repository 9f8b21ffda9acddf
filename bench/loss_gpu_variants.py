"""The loss bench's variants and how one is measured (imported by bench_loss_gpu.py, which
describes them): the inputs, each variant's fwd+bwd of the same DAPO loss through the LM head,
the median time and peak extra memory of one, its accuracy against float64, the bf16 matmul rate.

`FUSED_CHUNK` (--fused-chunk) and `COOLDOWN` (--cooldown) are read here; bench_loss_gpu.py sets
them in place (the same dicts).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from learner.loss.fused import auto_chunk_size

VOCAB = 151_936
TEMP = 0.9
ENT_COEF = 0.01  # the -ent variants' entropy bonus


def make_inputs(b, t, hd, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(b, t, hd, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(VOCAB, hd, device="cuda", generator=g, dtype=torch.bfloat16) * hd**-0.5
    ids = torch.randint(0, VOCAB, (b, t), device="cuda", generator=g)
    old = -3 * torch.rand(b, t, device="cuda", generator=g) - 9
    ref = old + 0.05 * torch.randn(b, t, device="cuda", generator=g)
    adv = torch.randn(b, device="cuda", generator=g)
    mask = torch.ones(b, t, device="cuda")
    return h.requires_grad_(), w.requires_grad_(), ids, old, ref, adv, mask


def _loss_backward(logp, ent, old, ref, adv, mask, entropy_coef=0.0):
    """The benchmark's DAPO loss of [B, T] log-probs, backward, detached. The entropy is a
    metric, or with `entropy_coef` a bonus (differentiated)."""
    from learner.loss.grpo import LossConfig, LossInputs, grpo_loss

    ent = ent if entropy_coef else ent.detach()
    inputs = LossInputs(logp, old, adv, mask, ref_logprobs=ref, entropy=ent)
    loss, _ = grpo_loss(inputs, LossConfig(beta=0.04, entropy_coef=entropy_coef))
    loss.backward()
    return loss.detach()


def run_full(h, w, ids, old, ref, adv, mask):  # each run_* returns its loss, detached
    logits = h @ w.T  # [B, T, V] bf16, materialised
    logits.div_(TEMP)
    lp = torch.log_softmax(logits, -1)  # [B, T, V] bf16
    del logits
    logp = lp.gather(-1, ids[..., None]).squeeze(-1).float()
    with torch.no_grad():  # entropy as a metric, 4096 tokens at a time
        flat = lp.view(-1, lp.shape[-1])
        ent = torch.cat([-(c.float().exp() * c.float()).sum(-1) for c in flat.split(4096)])
    return _loss_backward(logp, ent.view(logp.shape), old, ref, adv, mask)


def run_ours(h, w, ids, old, ref, adv, mask, entropy_coef=0.0):
    from learner.loss.logprobs import token_logprobs

    b, t, hd = h.shape
    lp, ent = token_logprobs(h.view(-1, hd), w, ids.view(-1), temperature=TEMP, impl="triton")
    return _loss_backward(lp.view(b, t), ent.view(b, t), old, ref, adv, mask, entropy_coef)


run_ours_ent = functools.partial(run_ours, entropy_coef=ENT_COEF)


FUSED_CHUNK: dict[str, int | None] = {"size": None}  # --fused-chunk; None: auto_chunk_size


def run_fused(h, w, ids, old, ref, adv, mask, entropy_coef=0.0):
    from learner.loss.fused import fused_grpo_loss
    from learner.loss.grpo import LossConfig
    from learner.loss.token import GRPOTokenLoss

    b, t, hd = h.shape
    seq = torch.arange(b * t, device=h.device) // t  # [N] rollout of each token (no host sync)
    cfg = LossConfig(beta=0.04, entropy_coef=entropy_coef)
    token_loss = GRPOTokenLoss(cfg, seq, adv, old_logprobs=old, ref_logprobs=ref)
    loss, _, _ = fused_grpo_loss(
        h.view(-1, hd), w, ids.view(-1), token_loss, temperature=TEMP,
        chunk_size=FUSED_CHUNK["size"], impl="triton",
    )  # fmt: skip
    loss.backward()
    return loss.detach()


run_fused_ent = functools.partial(run_fused, entropy_coef=ENT_COEF)


def _entropy_coef(variant: str) -> float:
    """The entropy bonus a variant's loss has (the -ent ones: ENT_COEF)."""
    return ENT_COEF if variant.endswith("-ent") else 0.0


def fused_at(spec):
    """run_fused at `CHUNK[:FWD_ROWS]` (see --fused-configs)."""
    from learner.loss.kernels import triton_fused

    chunk, fwd_rows = ([int(x) for x in spec.split(":")] + [0])[:2]

    def run(*inputs):
        saved = (FUSED_CHUNK["size"], triton_fused.FWD_ROWS)
        FUSED_CHUNK["size"] = chunk
        triton_fused.FWD_ROWS = fwd_rows or saved[1]
        try:
            return run_fused(*inputs)
        finally:
            FUSED_CHUNK["size"], triton_fused.FWD_ROWS = saved

    return run


_LIGER = {}


def run_liger(h, w, ids, old, ref, adv, mask):
    if "loss" not in _LIGER:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        _LIGER["loss"] = LigerFusedLinearGRPOLoss(
            beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo", temperature=TEMP
        )
    loss, _ = _LIGER["loss"](h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
    loss.backward()
    return loss.detach()


def run_full_trl(h, w, ids, old, ref, adv, mask):
    from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

    logits = h @ w.T  # [B, T, V] bf16, materialised
    lp, ent = selective_log_softmax_and_entropy(logits, ids, temperature=TEMP)  # fp32 each
    del logits
    return _loss_backward(lp, ent, old, ref, adv, mask)


TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


def run_trl_chunked(h, w, ids, old, ref, adv, mask):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    b, t, hd = h.shape
    lp, ent, *_ = ChunkedLogProbFunction.apply(
        h.view(-1, hd), w, None, ids.view(-1), TEMP, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",)
    )
    return _loss_backward(lp.view(b, t), ent.view(b, t), old, ref, adv, mask)


def _gemm_floor(h, w, chunk):
    """Only the three bf16 cuBLAS products of a loss through the head, `chunk` tokens of
    logits at a time (all of them: None), with no loss math: logits = h W^T, then the
    gradients G W and G^T h with the logits standing in for G. Sets the .grad of h and w
    (meaningless values) like a variant; returns a zero loss."""
    hd = h.shape[-1]
    hf, wd = h.detach().view(-1, hd), w.detach()
    n = hf.shape[0]
    c = n if chunk is None else chunk
    buf = torch.empty(min(c, n), wd.shape[0], dtype=wd.dtype, device=wd.device)
    gh, gw = torch.empty_like(hf), torch.empty_like(wd)
    for s in range(0, n, c):
        e = min(s + c, n)
        z = torch.mm(hf[s:e], wd.T, out=buf[: e - s])  # [C, V]
        torch.mm(z, wd, out=gh[s:e])  # [C, H]
        torch.addmm(gw, z.T, hf[s:e], beta=0.0 if s == 0 else 1.0, out=gw)  # [V, H]
    h.grad, w.grad = gh.view_as(h), gw
    return hf.new_zeros(())


def run_gemm_floor(h, w, ids, old, ref, adv, mask):
    return _gemm_floor(h, w, FUSED_CHUNK["size"] or auto_chunk_size(h.shape[-1]))


def run_gemm_floor_whole(h, w, ids, old, ref, adv, mask):
    return _gemm_floor(h, w, None)


VARIANTS = {
    "full": run_full, "full-trl": run_full_trl, "trl-chunked": run_trl_chunked,
    "liger": run_liger, "ours": run_ours, "fused": run_fused,
    "ours-ent": run_ours_ent, "fused-ent": run_fused_ent,
    "gemm-floor": run_gemm_floor, "gemm-floor-whole": run_gemm_floor_whole,
}  # fmt: skip


COOLDOWN = {"s": 0.0}  # --cooldown


def measure(fn, inputs, iters):
    h, w = inputs[0], inputs[1]
    h.grad = w.grad = None
    fn(*inputs)  # warm-up (compilation, autotuning)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(iters):
        h.grad = w.grad = None
        if COOLDOWN["s"]:  # an idle GPU first: clocks back from the power cap
            time.sleep(COOLDOWN["s"])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak / 1e9


def accuracy(hd, b, t, variants):
    """Relative errors of each variant's loss and gradients against float64 on the same inputs."""
    from learner.loss.grpo import LossConfig, LossInputs, grpo_loss
    from learner.loss.logprobs import token_logprobs

    inputs = make_inputs(b, t, hd, seed=1)
    h, w, ids, old, ref, adv, mask = inputs
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    lp, ent = token_logprobs(h64.view(-1, hd), w64, ids.view(-1), temperature=TEMP, impl="torch")
    refs = {}  # the float64 loss and gradients, without and with the entropy bonus
    for coef in {_entropy_coef(name) for name in variants}:
        ins = LossInputs(lp.view(b, t), old, adv, mask, ref_logprobs=ref, entropy=ent.view(b, t))
        want, _ = grpo_loss(ins, LossConfig(beta=0.04, entropy_coef=coef))
        gh, gw = torch.autograd.grad(want, (h64, w64), retain_graph=True)
        refs[coef] = (want.detach(), gh, gw)
    rows = []
    for name in variants:
        h.grad = w.grad = None
        got = VARIANTS[name](*inputs)
        want, h64_grad, w64_grad = refs[_entropy_coef(name)]
        errs = {
            "loss": _rel(got, want),
            "grad_hidden": _rel(h.grad, h64_grad),
            "grad_weight": _rel(w.grad, w64_grad),
        }
        rows.append({"variant": name, "hidden": hd, "tokens": b * t, **errs})
        ok = errs["grad_hidden"] <= 1e-2 and errs["grad_weight"] <= 1e-2
        print(
            f"accuracy H={hd} N={b * t} {name:<12} vs float64: loss {errs['loss']:.2e}, "
            f"grad_hidden {errs['grad_hidden']:.2e}, grad_weight {errs['grad_weight']:.2e}  "
            f"({'ok' if ok else 'OVER 1e-2'})",
            flush=True,
        )
    h.grad = w.grad = None
    return rows


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def matmul_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
