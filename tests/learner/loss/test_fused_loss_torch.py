"""The fused linear + GRPO loss on its torch path, on CPU: against `grpo_loss(token_logprobs(...))`
and float64 logits, `GRPOTokenLoss`'s closed-form gradients against autograd, and inside the
learner (whole-model gradients, `train_on` with `grpo.fused_loss`).

The Triton path (under Triton's interpreter, and on a GPU with `pytest -m gpu`) is tested in
test_fused_loss.py; what both files share is in fused_loss_common.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from learner.loss.fused import fused_grpo_loss
from learner.loss.grpo import LOSS_TYPES, LossConfig, LossInputs, grpo_loss
from learner.loss.logprobs import token_logprobs
from learner.loss.token import GRPOTokenLoss
from learner.model.policy import PolicyLogprobs
from learner.step.batch import collate
from learner.step.packing import PackedBatch, pack
from learner.step.update import policy_forward, regroup, seq_index
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
from tests.learner.rollout_data import random_rollouts


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
    seq, n = seq_index(b), b.advantages.numel()
    cfg = LossConfig(loss_type=loss_type, beta=0.1, entropy_coef=0.05, max_completion_length=16)
    with torch.no_grad():
        lp0 = regroup(policy_forward(policy, b)[0], seq, n)
    g = torch.Generator().manual_seed(1)
    old = lp0 + 0.1 * torch.randn(lp0.shape, generator=g)  # num_iterations > 1: ratio != 1
    ref = lp0 + 0.1 * torch.randn(lp0.shape, generator=g)
    sampling = regroup(b.sampling_logprobs[b.loss_mask.bool()], seq, n)
    common = {"num_items_in_batch": 40.0, "num_micro_batches": 2}

    def learner_path():  # learner.step.update.train_on today
        flat, ent = policy_forward(policy, b, with_entropy=True)
        lp = regroup(flat, seq, n)
        inputs = LossInputs(lp, old, b.advantages, regroup(torch.ones_like(flat), seq, n),
                            sampling_logprobs=sampling, ref_logprobs=ref,
                            entropy=regroup(ent, seq, n), **common)  # fmt: skip
        return grpo_loss(inputs, cfg)

    def fused_path():
        token_loss = GRPOTokenLoss.for_batch(  # the call learner.step.update.train_on makes
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

    from learner.step.update import StepOptions, build_micro_batches, train_on

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = PolicyLogprobs(copy.deepcopy(base), chunk_size=5)
    cfg = LossConfig(loss_type="grpo", beta=0.05, entropy_coef=0.01, max_completion_length=16)
    out = []
    for use_fused in (False, True):
        model = copy.deepcopy(base)
        policy = PolicyLogprobs(model, chunk_size=5, temperature=0.9)
        opts = StepOptions(micro_batch_size=3, num_iterations=num_iterations, packing=packing,
                           max_tokens_per_micro_batch=30, need_reference=True, fused_loss=use_fused)  # fmt: skip
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


def test_train_step_says_where_its_time_went(tiny_model_dir):
    """``time/train/*``: the step's own split (no-grad passes, forward, backward, optimizer),
    every phase there and together the whole of ``train_on`` on CPU."""
    import time

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.step.update import PhaseClock, StepOptions, build_micro_batches, train_on

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
    from learner.loss.fused import auto_chunk_size
    from learner.model.setup import build_models

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
