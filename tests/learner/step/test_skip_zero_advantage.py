"""Rollouts whose gradient is zero are left out of the train step (`grpo.skip_zero_advantage`)
without changing the gradient: every row keeps the weight the layout of all rollouts gives it.

The reference is the same step with skipping off, on the same real tiny Qwen3, for every loss
type, padded and packed, plain and fused loss, one and two passes (μ)."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from learner.loss.grpo import LOSS_TYPES, LossConfig, LossInputs, grpo_loss, row_weights
from learner.step.batch import Rollout
from learner.step.update import StepOptions, build_micro_batches, rollouts_to_train, train_on
from tests.learner.launch import cpu_launch
from tests.learner.rollout_data import random_rollouts

ROOT = Path(__file__).resolve().parents[3]


# A micro-batch of 3 rows holding 2, 0 and 4 loss tokens, one of M = 2 micro-batches:
#   grpo    : 1 / (3 · 2 · n_b)   -> 1/12, 1/6 (n clamped to 1), 1/24
#   bnpo    : 1 / (6 · 2)         -> 1/12 each
#   dr_grpo : 1 / (3 · 8 · 2)     -> 1/48 each               (max_completion_length = 8)
#   dapo    : 1 each (the step's token count divides later), bnpo's without it
@pytest.mark.parametrize(
    ("loss_type", "global_tokens", "expected"),
    [
        ("grpo", True, [1 / 12, 1 / 6, 1 / 24]),
        ("bnpo", True, [1 / 12] * 3),
        ("dr_grpo", True, [1 / 48] * 3),
        ("dapo", True, [1.0] * 3),
        ("dapo", False, [1 / 12] * 3),
    ],
)
def test_row_weights_by_hand(loss_type, global_tokens, expected):
    cfg = LossConfig(loss_type=loss_type, max_completion_length=8)
    tokens = torch.tensor([2.0, 0.0, 4.0], dtype=torch.float64)
    got = row_weights(tokens, cfg, 2, global_tokens=global_tokens)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_seq_weights_replace_the_micro_batch_normalisers():
    """Weights of a larger layout (here: this micro-batch counted as one of 4 of twice its
    rows) scale the loss exactly as that layout would."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    inputs = LossInputs(logp, logp - 0.1, torch.tensor([1.0, -0.5, 2.0]), mask)
    cfg = LossConfig(loss_type="grpo")
    plain, _ = grpo_loss(inputs, cfg)
    inputs.seq_weights = 1.0 / (mask.sum(-1) * 6 * 4)
    weighted, _ = grpo_loss(inputs, cfg)
    assert weighted.item() == pytest.approx(plain.item() / 8, rel=1e-12)


def _rollouts(n: int, zero_every: int, seed: int = 0) -> list[Rollout]:
    out = random_rollouts(n, seed=seed)
    for i, r in enumerate(out):
        if i % zero_every == 0:
            r.advantage = 0.0  # a group whose rewards were all equal
    out[1].completion_mask = [0] * len(out[1].completion_mask)  # a masked (truncated) one
    return out


def _step(model_dir, rollouts, cfg: LossConfig, skip: bool, count: bool = True, **opt_kw):
    """One train step from the same seeded model; returns (metrics, parameter deltas, the
    number of micro-batches)."""
    from transformers import AutoModelForCausalLM

    from learner.model.policy import PolicyLogprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = PolicyLogprobs(model, chunk_size=5, temperature=0.9)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opts = StepOptions(skip_zero_advantage=skip, count_zero_advantage=count, **opt_kw)
    step = build_micro_batches(copy.deepcopy(rollouts), opts, cfg, pad_id=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    m = train_on(Accelerator(cpu=True), policy, None, opt, cfg, step, opts)
    delta = {k: p.detach() - before[k] for k, p in model.named_parameters()}
    return m, delta, len(step.batches)


LAYOUTS = {
    "padded": {"micro_batch_size": 3},
    "packed": {"micro_batch_size": 1, "packing": True, "max_tokens_per_micro_batch": 30},
    "fused": {"micro_batch_size": 4, "fused_loss": True},
    "mu2": {"micro_batch_size": 2, "num_iterations": 2},
}


def _assert_same_update(got: dict, want: dict) -> None:
    scale = max(d.abs().max().item() for d in want.values())
    assert scale > 1e-6  # the step moved the weights
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4 * scale, msg=k)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_skipping_changes_no_gradient(tiny_model_dir, loss_type, layout):
    rollouts = _rollouts(12, zero_every=2)
    cfg = LossConfig(loss_type=loss_type, max_completion_length=16)
    m_all, d_all, n_all = _step(tiny_model_dir, rollouts, cfg, skip=False, **layout)
    m_skip, d_skip, n_skip = _step(tiny_model_dir, rollouts, cfg, skip=True, **layout)
    assert n_skip < n_all  # less work: 6 zero-advantage rollouts and a masked one left out
    skipped = sum(sum(r.completion_mask) for r in rollouts if r.advantage == 0.0)
    assert m_all["tokens/skipped"] == 0 and m_skip["tokens/skipped"] == skipped > 0
    assert m_skip["tokens/trained"] + skipped == m_all["tokens/trained"]
    assert m_skip["loss"] == pytest.approx(m_all["loss"], rel=1e-5, abs=1e-7)
    assert m_skip["grad_norm"] == pytest.approx(m_all["grad_norm"], rel=1e-5)
    _assert_same_update(d_skip, d_all)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "layout", [LAYOUTS[k] for k in ("padded", "packed", "fused")], ids=["padded", "packed", "fused"]
)
def test_uncounted_zero_advantage_is_the_step_without_those_rollouts(
    tiny_model_dir, loss_type, layout
):
    """``count_zero_advantage = false``: the normalisers are those of the informative rollouts
    alone, i.e. the step on a batch from which the zero-advantage groups were never sampled."""
    rollouts = _rollouts(12, zero_every=2)
    informative = [r for r in rollouts if r.advantage != 0.0]
    cfg = LossConfig(loss_type=loss_type, max_completion_length=16)
    m_un, d_un, _ = _step(tiny_model_dir, rollouts, cfg, skip=True, count=False, **layout)
    m_inf, d_inf, _ = _step(tiny_model_dir, informative, cfg, skip=True, **layout)
    m_all, _, _ = _step(tiny_model_dir, rollouts, cfg, skip=True, **layout)
    assert m_un["loss"] == pytest.approx(m_inf["loss"], rel=1e-5, abs=1e-7)
    assert m_un["loss"] != pytest.approx(m_all["loss"], rel=1e-3)  # another objective
    assert m_un["tokens/trained"] == m_inf["tokens/trained"] == m_all["tokens/trained"]
    _assert_same_update(d_un, d_inf)


@pytest.mark.parametrize("skip", [True, False])
def test_a_step_without_loss_tokens_runs(tiny_model_dir, skip):
    """Every completion masked (all cut at max_tokens with mask_truncated_completions, say):
    the step runs on zero gradients instead of refusing a token count of 0."""
    rollouts = random_rollouts(4)
    for r in rollouts:
        r.completion_mask = [0] * len(r.completion_mask)
    m, delta, _ = _step(tiny_model_dir, rollouts, LossConfig(), skip=skip, micro_batch_size=2)
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0 and m["tokens/trained"] == 0
    assert all(not d.any() for d in delta.values())
    # no token means of no tokens: an is_weight of 0 would read as servers off the policy
    assert not {"ratio_mean", "clip_region", "is_weight"} & set(m), sorted(m)


def test_all_zero_advantage_still_steps_the_optimizer(tiny_model_dir):
    """Nothing to train: one micro-batch at weight 0 keeps the optimizer's step (AdamW's weight
    decay moves the weights) exactly as without skipping."""
    from transformers import AutoModelForCausalLM

    from learner.model.policy import PolicyLogprobs

    rollouts = _rollouts(6, zero_every=1)
    cfg = LossConfig()
    out = []
    for skip in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        opts = StepOptions(micro_batch_size=2, skip_zero_advantage=skip)
        step = build_micro_batches(rollouts, opts, cfg, pad_id=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        m = train_on(Accelerator(cpu=True), PolicyLogprobs(model), None, opt, cfg, step, opts)
        out.append((len(step.batches), m, [p.detach().clone() for p in model.parameters()]))
    (n_all, m_all, p_all), (n_skip, m_skip, p_skip) = out
    assert (n_all, n_skip) == (3, 1)
    assert m_skip["tokens/trained"] == 0 and m_skip["grad_norm"] == m_all["grad_norm"] == 0.0
    # the step without skipping trained its zero-advantage tokens: their means are its own
    assert "ratio_mean" in m_all and "ratio_mean" not in m_skip
    for a, b in zip(p_all, p_skip, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("over", [{"beta": 0.04}, {"entropy_coef": 0.01}])
def test_kl_or_entropy_bonus_keeps_zero_advantage_rollouts(over):
    """With a KL term or an entropy bonus a zero-advantage rollout's tokens have a gradient:
    only those without loss tokens are left out."""
    rollouts = _rollouts(6, zero_every=2)
    kept = rollouts_to_train(rollouts, StepOptions(micro_batch_size=2), LossConfig(**over))
    assert kept == [r for i, r in enumerate(rollouts) if i != 1]  # rollout 1: fully masked
    off = StepOptions(micro_batch_size=2, skip_zero_advantage=False)
    assert rollouts_to_train(rollouts, off, LossConfig()) == rollouts


@pytest.mark.slow
def test_ranks_with_unequal_micro_batches_step_together(tiny_model_dir, tmp_path):
    """2 processes (gloo, DDP): rank 0's rollouts all have zero advantage, rank 1's none, so
    skipping leaves rank 0 one micro-batch (of weight 0) and rank 1 four; rank 0 repeats it (DDP
    broadcasts buffers every forward: unequal counts would hang) and both end with the
    weights of the same step without skipping, and the same token-mean metrics."""
    cmd = [*cpu_launch(2), str(ROOT / "tests/learner/step/skip_step_ddp.py"), str(tiny_model_dir)]
    cmd.append(str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {p.name: torch.load(p) for p in tmp_path.glob("rank*.pt")}
    assert sorted(results) == ["rank0.pt", "rank1.pt"]
    r0, r1 = results["rank0.pt"], results["rank1.pt"]
    assert r0["micro_batches"] == {"skip": 4, "all": 4} and r1["micro_batches"]["skip"] == 4
    assert r0["fillers"] == 4 and r1["fillers"] == 0  # rank 0: 1 filler built, 3 repeats
    # token means over both ranks' trained tokens: rank 0 trained none, yet reports them
    m0, m1 = r0["skip_metrics"], r1["skip_metrics"]
    assert m0["entropy"] == pytest.approx(m1["entropy"], rel=1e-12) and m0["entropy"] > 0
    assert m0["tokens/skipped"] == m1["tokens/skipped"] > 0
    for k in r0["all"]:
        torch.testing.assert_close(r0["skip"][k], r0["all"][k], rtol=1e-4, atol=1e-6, msg=k)
        torch.testing.assert_close(r0["skip"][k], r1["skip"][k], rtol=0, atol=0, msg=k)
    # a metric only rank 1 has is its own value, not halved; a shared one is the mean
    assert r0["reduced"] == r1["reduced"] == {"shared": 0.5, "reward/x/mean": 0.5}


@pytest.mark.parametrize("over", ["grpo.beta=0.04", "grpo.entropy_coef=0.01"])
def test_uncounted_zero_advantage_needs_no_kl_and_no_entropy_bonus(over):
    from learner.config import ConfigError, load_config

    base = ['data.path="x.jsonl"', 'rewards=[{name="length"}]']
    assert not load_config(
        None, [*base, "grpo.count_zero_advantage=false"]
    ).grpo.count_zero_advantage
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, "grpo.count_zero_advantage=false", over])
    assert "grpo.count_zero_advantage: false leaves zero-advantage rollouts out" in str(err.value)
    assert "set both to 0, or count_zero_advantage = true" in str(err.value)
