"""The fused linear + GRPO loss against `grpo_loss(token_logprobs(...))` and float64 logits.

The torch path runs here directly; the Triton path runs under Triton's interpreter in a
subprocess (TRITON_INTERPRET must be set before triton is imported), and at realistic sizes on
a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from learner.batch import collate
from learner.fused_loss import fused_grpo_loss
from learner.logprobs import token_logprobs
from learner.loss import LOSS_TYPES, LossConfig, LossInputs, grpo_loss
from learner.packing import PackedBatch, pack
from learner.policy import PolicyLogprobs
from learner.token_loss import GRPOTokenLoss
from learner.train_step import _forward, _seq_index, regroup
from tests.learner.rollout_data import random_rollouts

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


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("old", [True, False])  # False: μ = 1, old = current log-probs detached
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_equals_grpo_loss_of_token_logprobs(loss_type, variant, old, dtype, tol):
    over, uses = VARIANTS[variant]
    cfg = LossConfig(loss_type=loss_type, max_completion_length=16, **over)
    h, w, t, seq, ex = make(dtype)
    kw = {"num_items_in_batch": 70.0, "dp_world_size": 2, "num_micro_batches": 3}
    args = (t, seq, ex, cfg, uses, old, 0.8)
    ours = grads_of(lambda: fused(h, w, *args, **kw), h, w)
    ref = grads_of(lambda: reference_loss(h, w, *args, **kw), h, w)
    for name, a, r in zip(("loss", "logp", "entropy"), ours[:3], ref[:3], strict=True):
        assert rel(a, r) < tol, name
    assert ours[3].keys() == ref[3].keys()
    for k in ref[3]:
        assert abs(float(ours[3][k]) - float(ref[3][k])) < tol, k
    assert ours[4].dtype == h.dtype and ours[5].dtype == w.dtype
    assert rel(ours[4], ref[4]) < tol, "grad_hidden"
    assert rel(ours[5], ref[5]) < tol, "grad_weight"
    assert not ours[1].requires_grad and not ours[2].requires_grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_constant_grads_only_where_the_gradient_ignores_the_values(loss_type):
    _, _, _, seq, ex = make(torch.float64)
    g = torch.Generator().manual_seed(7)
    values = [torch.randn(2, seq.numel(), generator=g, dtype=torch.float64) - 2 for _ in "ab"]
    cases = [  # (old log-probs, beta, tis_cap): only the first has value-independent gradients
        (None, 0.0, None), (ex["old"], 0.0, None), (None, 0.1, None), (None, 0.0, 2.0),
    ]  # fmt: skip
    for i, (old, beta, cap) in enumerate(cases):
        cfg = LossConfig(loss_type=loss_type, beta=beta, tis_cap=cap, entropy_coef=0.2,
                         max_completion_length=16)  # fmt: skip
        tl = GRPOTokenLoss(cfg, seq, ex["advantages"], old_logprobs=old,
                           sampling_logprobs=ex["sampling"], ref_logprobs=ex["ref"])  # fmt: skip
        grads = []
        for lp, ent in values:
            lp, ent = lp.requires_grad_(), ent.requires_grad_()
            grads.append(torch.autograd.grad(tl(lp, ent), (lp, ent)))
        same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
        assert tl.constant_grads == same == (i == 0), i


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("variant", [*VARIANTS, "mu1", "mu1-is", "dapo-items"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_closed_form_token_grads_equal_autograd(loss_type, variant, dtype):
    """`GRPOTokenLoss.token_grads` (what the fused loss differentiates with) against autograd
    through `grpo_loss`, chunk by chunk, with log-probs on both clip sides, inside the clip range
    (torch.min's tie) and with a zero advantage."""
    _, _, _, seq, ex = make(torch.float64)
    n = seq.numel()
    g = torch.Generator().manual_seed(3)
    flat_old = ex["old"][seq, torch.cat([torch.arange(k) for k in LENS])]
    lp = flat_old + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)  # ratios 0.5-2
    lp[::4] = flat_old[::4]  # ratio exactly 1: inside the range, where min(u, v) ties
    ent = torch.rand(n, generator=g, dtype=torch.float64) * 3
    adv = ex["advantages"].clone()
    adv[1] = 0.0  # a group whose rewards were all equal
    kw, names = VARIANTS.get(variant, ({"beta": 0.0, "tis_cap": 2.0}, ("sampling",)))
    old = None if variant.startswith("mu1") else ex["old"]
    if variant == "mu1":
        kw = {"beta": 0.1, "tis_cap": None, "entropy_coef": 0.3}
        names = ("ref",)
    cfg = LossConfig(loss_type=loss_type, max_completion_length=16, **kw)
    tl = GRPOTokenLoss(
        cfg, seq, adv, old_logprobs=None if old is None else old.to(dtype),
        num_items_in_batch=57.0 if variant == "dapo-items" else None,
        dp_world_size=2 if variant == "dapo-items" else 1, num_micro_batches=3,
        **{f"{k}_logprobs": ex[k].to(dtype) for k in names},
    )  # fmt: skip
    lp, ent = lp.to(dtype), ent.to(dtype)
    want_lp, want_ent = _autograd(tl, lp, ent)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for s, e in [(0, 7), (7, 20), (20, n)]:
        got_lp, got_ent = tl.token_grads(lp, ent, s, e)
        assert got_lp.dtype == dtype
        torch.testing.assert_close(got_lp, want_lp[s:e], rtol=tol, atol=tol * 1e-2)
        if want_ent is None:
            assert got_ent is None
        else:
            torch.testing.assert_close(got_ent, want_ent[s:e], rtol=tol, atol=tol * 1e-2)


def test_token_loss_rejects_a_non_positive_token_count():
    _, _, _, seq, ex = make(torch.float64)
    with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
        GRPOTokenLoss(LossConfig(), seq, ex["advantages"], num_items_in_batch=0.0)


def _autograd(tl, lp, ent):
    lp, ent = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    return torch.autograd.grad(tl(lp, ent), (lp, ent), allow_unused=True)


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


@pytest.mark.parametrize("terms", ["both", "logp", "entropy"])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_any_separable_loss_matches_float64_full_logits(terms, chunk_size):
    h, w, t, _, _ = make(torch.float64, seed=1)
    g = torch.Generator().manual_seed(2)
    cl, ce = torch.randn(t.numel(), generator=g), torch.randn(t.numel(), generator=g)
    token_loss = separable(cl if terms != "entropy" else None, ce if terms != "logp" else None)
    ours = grads_of(functools.partial(run_fused, h, w, t, token_loss, chunk_size=chunk_size), h, w)
    ref = grads_of(functools.partial(run_full, h, w, t, token_loss, 1.0), h, w)
    for i in (0, 1, 2, 4, 5):
        assert rel(ours[i], ref[i]) < 1e-10, i


def test_scaled_backward_partial_grads_and_no_grad():
    h, w, t, seq, ex = make(torch.float64, seed=3)
    cfg = LossConfig(beta=0.1)
    args = (t, seq, ex, cfg, ("ref",), True, 1.0)
    _, _, _, _, rh, rw = grads_of(lambda: reference_loss(h, w, *args), h, w)
    h.grad = w.grad = None
    (2.5 * fused(h, w, *args)[0]).backward()  # grad_output 2.5 scales both gradients
    assert rel(h.grad, 2.5 * rh) < 1e-10 and rel(w.grad, 2.5 * rw) < 1e-10
    h.grad = w.grad = None
    w.requires_grad_(False)  # LoRA: frozen head, only grad_hidden
    fused(h, w, *args)[0].backward()
    assert w.grad is None and rel(h.grad, rh) < 1e-10
    w.requires_grad_(True)
    h2 = h.detach()  # only the head's gradient
    fused(h2, w, *args)[0].backward()
    assert rel(w.grad, rw) < 1e-10
    with torch.no_grad():
        loss, lp, _, _ = fused(h, w, *args)
    assert loss.grad_fn is None and rel(lp, token_logprobs(h.double(), w.double(), t)[0]) < 1e-12


def test_second_backward_is_refused():
    h, w, t, seq, ex = make(torch.float64)
    loss = fused(h, w, t, seq, ex, LossConfig(), (), True, 1.0)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_no_loss_tokens():
    h, w, t, seq, ex = make(torch.float64, lens=[0, 0])
    loss, lp, _, _ = fused(h, w, t, seq, ex, LossConfig(), (), True, 1.0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and lp.shape == (0,)
    assert h.grad.shape == (0, 16) and float(w.grad.abs().max()) == 0.0


def test_token_loss_regroups_like_train_step_and_checks_shapes():
    _, _, _, seq, ex = make(torch.float64)
    tl = GRPOTokenLoss(LossConfig(), seq, ex["advantages"], old_logprobs=ex["old"])
    flat = torch.randn(seq.numel(), dtype=torch.float64)
    assert torch.equal(tl.regroup(flat), regroup(flat, seq, len(LENS)))
    mask_flat = ex["old"][regroup(torch.ones_like(flat), seq, len(LENS)).bool()]
    tl2 = GRPOTokenLoss(LossConfig(), seq, ex["advantages"], old_logprobs=mask_flat)  # flat [N]
    assert torch.equal(tl2.old, ex["old"] * tl.mask)
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        GRPOTokenLoss(LossConfig(), seq, ex["advantages"], ref_logprobs=torch.zeros(3, 3))
    # What needs the host (no sync at construction) is checked on first use: the fused loss's
    # forward raises before it returns anything.
    h, w, t, _, _ = make(torch.float64)
    bad_len = GRPOTokenLoss(
        LossConfig(beta=0.1), seq, ex["advantages"], ref_logprobs=ex["old"][:, :-1]
    )
    with pytest.raises(ValueError, match=r"ref_logprobs has shape .*: pass \[B, L\]"):
        fused_grpo_loss(h, w, t, bad_len)
    with pytest.raises(ValueError, match="rollout ids outside"):
        fused_grpo_loss(h, w, t, GRPOTokenLoss(LossConfig(), seq, ex["advantages"][:2]))
    with pytest.raises(ValueError, match="no rollouts"):
        GRPOTokenLoss(LossConfig(), seq, ex["advantages"][:0])


def test_bf16_gradients_and_fp32_weight_grad_accumulation():
    # 512 tokens in 64 chunks: grad_weight is rounded to bf16 64 times unless accumulated in
    # fp32, in which case it is as accurate as with a single chunk (one rounding).
    h, w, t, _, _ = make(torch.bfloat16, lens=[512], hd=64, v=256, seed=4)
    g = torch.Generator().manual_seed(5)
    cl = torch.randn(t.numel(), generator=g) / t.numel()
    token_loss = separable(cl, 0.1 * cl)
    ref = grads_of(functools.partial(run_full, h, w, t, token_loss, 0.9), h, w)
    errs = {}
    for chunk, fp32 in ((512, False), (8, False), (8, True)):
        run = functools.partial(
            run_fused, h, w, t, token_loss, temperature=0.9, chunk_size=chunk,
            fp32_weight_grad=fp32,
        )  # fmt: skip
        ours = grads_of(run, h, w)
        assert ours[4].dtype == ours[5].dtype == torch.bfloat16
        assert rel(ours[0], ref[0]) < 1e-4 and rel(ours[4], ref[4]) < 1e-2
        errs[chunk, fp32] = rel(ours[5], ref[5])
    one_chunk = errs[512, False]
    assert abs(errs[8, True] - one_chunk) < 0.02 * one_chunk, errs
    assert 1.5 * one_chunk < errs[8, False] < 1e-2, errs


def fused_forward(policy, b, token_loss):
    """What `PolicyLogprobs.forward(..., token_loss=...)` does once wired (see the module's
    docstring): the decoder as in `PolicyLogprobs.forward`, then the fused head + loss."""
    kw = {"position_ids": b.position_ids} if isinstance(b, PackedBatch) else {}
    mask = b.block_causal_mask() if isinstance(b, PackedBatch) else b.attention_mask
    hidden = policy.model.get_decoder()(input_ids=b.input_ids, attention_mask=mask, **kw)
    hidden = hidden.last_hidden_state[:, :-1]  # [B, T-1, H]
    sel = b.loss_mask.bool()
    weight = policy.model.get_output_embeddings().weight
    return fused_grpo_loss(
        hidden[sel], weight, b.input_ids[:, 1:][sel], token_loss,
        temperature=policy.temperature, chunk_size=policy.chunk_size,
    )  # fmt: skip


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_whole_model_gradients_equal_the_learner_path(tiny_model_dir, packed, loss_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = PolicyLogprobs(model, temperature=0.9, chunk_size=6)
    rs = random_rollouts()
    b = pack(rs) if packed else collate(rs, pad_id=0)
    seq, n = _seq_index(b), b.advantages.numel()
    cfg = LossConfig(loss_type=loss_type, beta=0.1, entropy_coef=0.05, max_completion_length=16)
    with torch.no_grad():
        lp0 = regroup(_forward(policy, b)[0], seq, n)
    g = torch.Generator().manual_seed(1)
    old = lp0 + 0.1 * torch.randn(lp0.shape, generator=g)  # num_iterations > 1: ratio != 1
    ref = lp0 + 0.1 * torch.randn(lp0.shape, generator=g)
    sampling = regroup(b.sampling_logprobs[b.loss_mask.bool()], seq, n)
    common = {"num_items_in_batch": 40.0, "num_micro_batches": 2}

    def learner_path():  # train_step.train_on today
        flat, ent = _forward(policy, b, with_entropy=True)
        lp = regroup(flat, seq, n)
        inputs = LossInputs(lp, old, b.advantages, regroup(torch.ones_like(flat), seq, n),
                            sampling_logprobs=sampling, ref_logprobs=ref,
                            entropy=regroup(ent, seq, n), **common)  # fmt: skip
        return grpo_loss(inputs, cfg)

    def fused_path():
        token_loss = GRPOTokenLoss.for_batch(  # the call train_step.train_on makes
            cfg, b, seq, old_logprobs=old, ref_logprobs=ref, dp_world_size=1, **common
        )
        loss, _, _ = fused_forward(policy, b, token_loss)
        return loss, token_loss.metrics

    results = []
    for path in (learner_path, fused_path):
        model.zero_grad(set_to_none=True)
        loss, metrics = path()
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, grads))
    (la, ma, ga), (lb, mb, gb) = results
    torch.testing.assert_close(lb, la, atol=1e-6, rtol=1e-5)
    assert ma.keys() == mb.keys() and ga.keys() == gb.keys() and len(ga) > 10
    for k in ma:
        torch.testing.assert_close(mb[k], ma[k], atol=1e-6, rtol=1e-5, msg=k)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], atol=1e-6, rtol=1e-4, msg=k)


@pytest.mark.parametrize(("packing", "num_iterations"), [(False, 1), (True, 2)])
def test_train_on_with_fused_loss_equals_the_plain_step(tiny_model_dir, packing, num_iterations):
    """The learner switch (grpo.fused_loss -> StepOptions.fused_loss): one optimizer step with a
    frozen reference (beta > 0) gives the same metrics and weights either way."""
    import copy

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.train_step import StepOptions, build_micro_batches, train_on

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = PolicyLogprobs(copy.deepcopy(base), chunk_size=5)
    cfg = LossConfig(loss_type="grpo", beta=0.05, entropy_coef=0.01, max_completion_length=16)
    out = []
    for fused in (False, True):
        model = copy.deepcopy(base)
        policy = PolicyLogprobs(model, chunk_size=5, temperature=0.9)
        opts = StepOptions(micro_batch_size=3, num_iterations=num_iterations, packing=packing,
                           max_tokens_per_micro_batch=30, need_reference=True, fused_loss=fused)  # fmt: skip
        step = build_micro_batches(random_rollouts(6), opts, cfg, pad_id=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = train_on(Accelerator(cpu=True), policy, ref, opt, cfg, step, opts)
        out.append((metrics, {k: p.detach().clone() for k, p in model.named_parameters()}))
    (ma, pa), (mb, pb) = out
    assert ma.keys() == mb.keys()
    for k in ma:
        if k.startswith("time/"):  # where the step's time went: not a result
            continue
        assert abs(ma[k] - mb[k]) <= 1e-5 * max(1.0, abs(ma[k])), (k, ma[k], mb[k])
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], atol=1e-6, rtol=1e-5, msg=k)


def test_rejects_bad_inputs():
    h, w, t, seq, ex = make(torch.float64)
    tl = GRPOTokenLoss(LossConfig(), seq, ex["advantages"])
    with pytest.raises(ValueError, match="targets must lie"):
        fused_grpo_loss(h, w, t + 100, tl)
    with pytest.raises(ValueError, match="impl must be"):
        fused_grpo_loss(h, w, t, tl, impl="cuda")


def run_triton_checks(device, n_lens, hd, v, chunk_sizes, fwd_rows, temperature=0.8, seed=0):
    """[(name, error, tolerance)]: the Triton path in bf16/fp16 vs float64 on the same inputs.
    `fwd_rows` < the chunk sizes: the forward kernel runs each chunk as several launches."""
    from learner.kernels import triton_fused

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

    from learner.logprobs import chunked_nll

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
    from learner.kernels.triton_fused import grpo_token_grads

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
    from learner.kernels.triton_fused import row_scale, scale_

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
    from tests.learner.triton_checks import assert_all, run_under_interpreter

    results = run_under_interpreter(__file__)
    assert len(results) > 80
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_path_on_gpu():
    # Odd sizes: hidden 520, vocab 50_001 (partial last tile), 2000 tokens in 4 ragged rollouts.
    from tests.learner.triton_checks import assert_all

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


def test_train_step_says_where_its_time_went(tiny_model_dir):
    """``time/train/*``: the step's own split (no-grad passes, forward, backward, optimizer),
    every phase there and together the whole of ``train_on`` on CPU."""
    import time

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.train_step import PhaseClock, StepOptions, build_micro_batches, train_on

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = PolicyLogprobs(model, chunk_size=5)
    opts = StepOptions(micro_batch_size=2, num_iterations=2)
    step = build_micro_batches(random_rollouts(6), opts, LossConfig(), pad_id=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.perf_counter()
    m = train_on(Accelerator(cpu=True), policy, None, opt, LossConfig(), step, opts)
    wall = time.perf_counter() - t0
    split = {k.removeprefix("time/train/"): v for k, v in m.items() if k.startswith("time/")}
    assert set(split) == {"prepare", "forward", "backward", "optimizer"}
    assert all(v >= 0 for v in split.values()) and split["backward"] > 0
    assert 0.9 * wall <= sum(split.values()) <= wall, (split, wall)

    clock = PhaseClock(torch.device("cpu"))
    for phase in ("a", "b", "a"):
        time.sleep(0.02)
        clock.lap(phase)
    secs = clock.seconds()
    assert secs.keys() == {"a", "b"} and secs["a"] >= 0.04 and 0.02 <= secs["b"] < secs["a"]


def test_auto_chunk_size_follows_the_head_and_reaches_the_policy(tiny_model_dir):
    from learner.config import load_config
    from learner.fused_loss import auto_chunk_size
    from learner.model_setup import build_models

    # 1.5 × hidden, a multiple of 256, within [1024, 2048]
    got = {h: auto_chunk_size(h) for h in (64, 896, 1024, 2048, 4096, 8192)}
    assert got == {64: 1024, 896: 1280, 1024: 1536, 2048: 3072, 4096: 4096, 8192: 4096}
    base = ['data.path="x.jsonl"', 'rewards=[{name="length"}]', "grpo.fused_loss=true"]
    policy, _ = build_models(load_config(None, base), str(tiny_model_dir))
    assert policy.fused_chunk_size is None  # auto, in fused_grpo_loss
    policy, _ = build_models(
        load_config(None, [*base, "grpo.fused_chunk_size=512"]), str(tiny_model_dir)
    )
    assert policy.fused_chunk_size == 512
