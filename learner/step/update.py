"""One optimizer step over a batch of rollouts: micro-batches, the chunked GRPO loss, backward.

Micro-batches are padded rows (grouped by length) or packed rows (padding-free,
``learner.step.packing``). Either way the policy returns flat per-token log-probs at the loss
positions, which are regrouped into ``[B, L]`` per-sequence tensors before the loss, so every
loss type sees exactly the same numbers whatever the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from learner.loss.grpo import LossConfig, LossInputs, grpo_loss, row_weights
from learner.loss.token import GRPOTokenLoss
from learner.model.offload import ActivationOffload
from learner.step.batch import Rollout, TrainBatch, collate, micro_batches
from learner.step.packing import PackedBatch, pack, packed_micro_batches

logger = logging.getLogger(__name__)


@dataclass
class StepOptions:
    micro_batch_size: int
    num_iterations: int = 1
    max_grad_norm: float = 1.0
    packing: bool = False
    fused_loss: bool = False  # grpo.fused_loss
    max_tokens_per_micro_batch: int = 4096
    pad_to_multiple_of: int = 1
    activation_offloading: bool = False
    need_reference: bool = False  # beta > 0
    reference_is_adapterless: bool = False  # LoRA: reference = adapters disabled
    skip_zero_advantage: bool = True  # grpo.skip_zero_advantage: see `rollouts_to_train`
    count_zero_advantage: bool = True  # grpo.count_zero_advantage: see `build_micro_batches`


class PhaseClock:
    """Seconds per phase of a train step, summed over micro-batches and iterations.

    On CUDA the laps are events on the current stream, read once at the end: the GPU's own
    timeline, which host syncs inside the step (a loss read back) do not distort, and which
    includes the time the GPU waits for the host to launch work (what makes a launch-bound
    step slow). Elsewhere, ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._laps: list[tuple[str, Any]] = [("", self._stamp())]  # the start

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, phase: str) -> None:
        """The time since the previous lap (or the start) was spent in ``phase``."""
        self._laps.append((phase, self._stamp()))

    def seconds(self) -> dict[str, float]:
        if self.cuda:
            self._laps[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, prev), (phase, stamp) in itertools.pairwise(self._laps):
            dt = prev.elapsed_time(stamp) / 1e3 if self.cuda else stamp - prev
            out[phase] = out.get(phase, 0.0) + dt
        return out


@dataclass
class StepBatches:
    """A step's micro-batches on this rank, and what the loss needs of the rollouts left out."""

    batches: list[TrainBatch]
    trained: list[Rollout]  # the rollouts in `batches` (fillers apart)
    loss_tokens: int  # loss tokens of every counted rollout of the step here, skipped included
    skipped_tokens: int = 0  # those of the skipped rollouts
    fillers: int = 0  # trailing batches of weight 0 (a step must run at least one, see below)


def _loss_tokens(rollouts: list[Rollout]) -> int:
    return sum(sum(r.completion_mask) for r in rollouts)


def rollouts_to_train(
    rollouts: list[Rollout], opts: StepOptions, loss_cfg: LossConfig
) -> list[Rollout]:
    """The rollouts whose tokens may have a non-zero gradient: all, less (with
    ``skip_zero_advantage``) those without loss tokens and, where the loss has no KL and no
    entropy bonus, those of zero advantage (every term of their tokens' loss is a multiple of
    it: ``-min(r·0, clip(r)·0)·w = 0``)."""
    if not opts.skip_zero_advantage:
        return rollouts
    pg_only = loss_cfg.beta == 0.0 and loss_cfg.entropy_coef == 0.0
    return [r for r in rollouts if any(r.completion_mask) and not (pg_only and r.advantage == 0.0)]


def _layout(rollouts: list[Rollout], opts: StepOptions) -> list[list[Rollout]]:
    if opts.packing:
        return packed_micro_batches(rollouts, opts.max_tokens_per_micro_batch)
    return micro_batches(rollouts, opts.micro_batch_size)


def _collate(rollouts: list[Rollout], weights: list[float], opts: StepOptions, pad_id: int):
    b = pack(rollouts) if opts.packing else collate(rollouts, pad_id, opts.pad_to_multiple_of)
    b.seq_weights = torch.tensor(weights, dtype=torch.float64)
    return b


def build_micro_batches(
    rollouts: list[Rollout], opts: StepOptions, loss_cfg: LossConfig, pad_id: int
) -> StepBatches:
    """The step's micro-batches; every row carries its weight in the step's loss (the loss
    types' normalisers, ``loss.row_weights``) as the layout of *all* the rollouts gives it.
    So leaving out rollouts whose gradient is zero (``rollouts_to_train``) and laying out the
    others in fewer, fuller micro-batches changes no gradient: only the work.

    With ``count_zero_advantage`` off the normalisers are those of the rollouts of non-zero
    advantage alone: the step is the one it would be had the zero-advantage groups never been
    sampled (the loss averages over the informative rollouts, as with DAPO's dynamic sampling,
    without generating more); the config allows it only without KL and entropy bonus."""
    if not rollouts:
        raise ValueError("a step needs at least one rollout")
    counted = rollouts
    if not opts.count_zero_advantage:
        counted = [r for r in rollouts if r.advantage != 0.0]
    layout = _layout(counted, opts) if counted else []
    weight: dict[int, float] = {}  # rollouts outside `counted` weigh 0
    for group in layout:
        tokens = torch.tensor([float(sum(r.completion_mask)) for r in group], dtype=torch.float64)
        w = row_weights(tokens, loss_cfg, len(layout), global_tokens=True)
        weight.update(zip(map(id, group), w.tolist(), strict=True))
    kept = rollouts_to_train(rollouts, opts, loss_cfg)
    loss_tokens, skipped = _loss_tokens(counted), _loss_tokens(rollouts) - _loss_tokens(kept)
    if not kept:  # the optimizer still steps (on zero gradients, as without skipping)
        shortest = min(rollouts, key=lambda r: len(r.prompt_ids) + len(r.completion_ids))
        filler = _collate([shortest], [0.0], opts, pad_id)
        return StepBatches([filler], [], loss_tokens, skipped, fillers=1)
    batches = [
        _collate(g, [weight.get(id(r), 0.0) for r in g], opts, pad_id) for g in _layout(kept, opts)
    ]
    return StepBatches(batches, kept, loss_tokens, skipped)


def _equalize(accelerator: Accelerator, step: StepBatches) -> StepBatches:
    """Every rank runs as many micro-batches (each forward gathers ZeRO-3's parameters, DDP
    may broadcast buffers: collectives every rank must join): the ranks with fewer repeat
    their smallest one at weight 0."""
    if accelerator.num_processes == 1:
        return step
    missing = max_over_ranks(accelerator, len(step.batches)) - len(step.batches)
    if missing == 0:
        return step
    smallest = min(step.batches, key=lambda b: b.input_ids.numel())
    filler = dataclasses.replace(smallest, seq_weights=torch.zeros_like(smallest.advantages))
    return dataclasses.replace(
        step, batches=step.batches + [filler] * missing, fillers=step.fillers + missing
    )


def _seq_index(b: TrainBatch) -> torch.Tensor:
    """The rollout (row of ``b.advantages``) of every loss position, flat ``[N]``."""
    sel = b.loss_mask.bool()
    if isinstance(b, PackedBatch):
        assert b.seq_advantage_index is not None
        return b.seq_advantage_index[None].expand_as(sel)[sel]
    rows = torch.arange(sel.shape[0], device=sel.device)[:, None].expand_as(sel)
    return rows[sel]


def regroup(flat: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Flat per-token values ``[N]`` (each sequence's tokens contiguous, in order) -> ``[B, L]``
    right-padded with zeros; differentiable."""
    counts = torch.bincount(seq, minlength=num_seqs)  # [B]
    starts = torch.cumsum(counts, 0) - counts  # [B]
    col = torch.arange(seq.numel(), device=seq.device) - starts[seq]  # [N]
    out = flat.new_zeros(num_seqs, int(counts.max().item()) if seq.numel() else 1)
    return out.index_put((seq, col), flat)


def _forward(policy, b: TrainBatch, **kw):  # type: ignore[no-untyped-def]
    if isinstance(b, PackedBatch):
        # flash-attention reads sequence starts from position_ids; SDPA/eager need the mask
        return policy(b.input_ids, b.block_causal_mask(), b.loss_mask, b.position_ids, **kw)
    return policy(b.input_ids, b.attention_mask, b.loss_mask, **kw)


def train_on(
    accelerator: Accelerator,
    policy: torch.nn.Module,
    ref_policy: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    loss_cfg: LossConfig,
    step: StepBatches,
    opts: StepOptions,
) -> dict[str, float]:
    """Forward/backward every micro-batch ``num_iterations`` times, stepping after each pass."""
    dev = accelerator.device
    clock = PhaseClock(torch.device(dev))
    step = _equalize(accelerator, step)
    batches = [b.to(dev) for b in step.batches]
    real = len(batches) - step.fillers  # the fillers' metrics are not the step's
    local_tokens = sum(b.num_loss_tokens for b in batches[:real])
    # The loss normaliser is global: every counted token of the step on every rank (DAPO),
    # skipped rollouts' included.
    counts = [step.loss_tokens, step.skipped_tokens, local_tokens]
    counts_t = torch.tensor(counts, dtype=torch.float64, device=dev)
    global_tokens, global_skipped, global_trained = accelerator.reduce(
        counts_t, reduction="sum"
    ).tolist()
    # no counted token anywhere (every completion masked, say): every row's token sum or weight
    # is 0 and any normaliser gives the zero loss (0 itself would be refused as a count)
    num_items = max(global_tokens, 1.0)
    seqs = [_seq_index(b) for b in batches]
    group = [
        functools.partial(regroup, seq=s, num_seqs=b.advantages.numel())
        for s, b in zip(seqs, batches, strict=True)
    ]

    olds: list[torch.Tensor | None] = [None] * len(batches)
    refs: list[torch.Tensor | None] = [None] * len(batches)
    with torch.no_grad():
        for i, b in enumerate(batches):
            if opts.num_iterations > 1:
                olds[i] = group[i](_forward(policy, b)[0])
            if opts.need_reference:
                if opts.reference_is_adapterless:
                    lp = _forward(accelerator.unwrap_model(policy), b, reference=True)[0]
                else:
                    assert ref_policy is not None
                    lp = _forward(ref_policy, b)[0]
                refs[i] = group[i](lp)
    clock.lap("prepare")  # batches to the device, the no-grad passes (old/reference log-probs)

    offload = ActivationOffload(keep=policy.parameters()) if opts.activation_offloading else None
    # DeepSpeed owns accumulation and the optimizer step: tell its engine where the step ends
    # (accelerate's backward would step it after every micro-batch).
    engine = policy if hasattr(policy, "set_gradient_accumulation_boundary") else None
    # loss and metrics summed on the device, read back once at the end: a read per micro-batch
    # would make the host wait for the GPU before it may queue the next micro-batch's work
    sums: dict[str, torch.Tensor | float] = {}
    grad_norm = 0.0
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)
    for _ in range(opts.num_iterations):
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            if engine is not None:
                engine.set_gradient_accumulation_boundary(last)
                sync = contextlib.nullcontext()
            else:
                sync = accelerator.no_sync(policy) if not last else contextlib.nullcontext()
            saved = offload() if offload is not None else contextlib.nullcontext()
            with sync, saved:
                if opts.fused_loss:  # loss fused with the LM head, gradients in the forward
                    token_loss = GRPOTokenLoss.for_batch(
                        loss_cfg,
                        b,
                        seqs[i],
                        old_logprobs=olds[i],
                        ref_logprobs=refs[i],
                        num_items_in_batch=num_items,
                        dp_world_size=accelerator.num_processes,
                        num_micro_batches=len(batches),
                    )
                    loss = _forward(policy, b, token_loss=token_loss)[0]
                    m = token_loss.metrics
                else:
                    lp_flat, ent_flat = _forward(policy, b, with_entropy=True)
                    logprobs = group[i](lp_flat)
                    mask = group[i](torch.ones_like(lp_flat))
                    inputs = LossInputs(
                        logprobs=logprobs,
                        old_logprobs=olds[i] if olds[i] is not None else logprobs.detach(),
                        advantages=b.advantages,
                        mask=mask,
                        sampling_logprobs=group[i](b.sampling_logprobs[b.loss_mask.bool()])
                        if loss_cfg.tis_cap
                        else None,
                        ref_logprobs=refs[i],
                        entropy=group[i](ent_flat) if ent_flat is not None else None,
                        num_items_in_batch=num_items,
                        dp_world_size=accelerator.num_processes,
                        num_micro_batches=len(batches),
                        seq_weights=b.seq_weights,
                    )
                    loss, m = grpo_loss(inputs, loss_cfg)
                clock.lap("forward")
                if engine is not None:
                    engine.backward(loss)  # gradient_accumulation_steps = 1: no extra scaling
                else:
                    accelerator.backward(loss)
                clock.lap("backward")
            total_loss += loss.detach().double()
            weight = float(b.num_loss_tokens) if i < real else 0.0
            for k, v in m.items():
                if k != "num_tokens":
                    add = v.detach().double() * weight if torch.is_tensor(v) else float(v) * weight
                    sums[k] = sums.get(k, 0.0) + add
        if engine is not None:  # clips with the DeepSpeed config's gradient_clipping
            engine.step()
            grad_norm = float(engine.get_global_grad_norm() or 0.0)
        else:
            grad_norm = step_if_finite(accelerator, policy, optimizer, opts.max_grad_norm)
        clock.lap("optimizer")
    # token means over every rank's trained tokens (a rank may train few or none of its own)
    keys = sorted(sums)
    totals = torch.tensor(
        [float(sums[k]) for k in keys] + [float(local_tokens)], dtype=torch.float64, device=dev
    )
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    *values, tokens = totals.tolist()
    out = {
        k: v / (max(1.0, tokens) * opts.num_iterations) for k, v in zip(keys, values, strict=True)
    }
    out["loss"] = float(total_loss) / opts.num_iterations
    out["grad_norm"] = grad_norm
    out["tokens/trained"] = global_trained
    out["tokens/skipped"] = global_skipped  # zero gradient: left out (`rollouts_to_train`)
    out["tokens/padded"] = float(sum(b.input_ids.numel() for b in batches))
    for phase, secs in clock.seconds().items():  # where the train phase went
        out[f"time/train/{phase}"] = secs
    return out


class NonFiniteError(RuntimeError):
    """Steps in a row had a non-finite gradient: the run cannot make progress."""


def step_if_finite(
    accelerator: Accelerator, policy: torch.nn.Module, optimizer: Any, max_grad_norm: float
) -> float:
    """Clip, then step only if the gradient norm is finite: one nan or inf gradient would
    otherwise make every weight nan, and the next sync would serve them. Returns the norm
    (nan or inf for a skipped step; ``NonFiniteGuard`` stops a run that keeps skipping)."""
    grad_norm = float(accelerator.clip_grad_norm_(policy.parameters(), max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@dataclass
class NonFiniteGuard:
    """Warns for a step skipped for a non-finite gradient, stops after ``limit`` in a row."""

    limit: int = 3
    in_a_row: int = 0

    def check(self, step: int, metrics: dict[str, float]) -> None:
        if math.isfinite(metrics["grad_norm"]):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        what = f"step {step}: gradient norm {metrics['grad_norm']} (loss {metrics['loss']})"
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{what}: {self.in_a_row} steps in a row with a non-finite gradient (the "
                "weights are those of the last finite step). Lower optim.lr, check the data and "
                "rewards, or resume from a checkpoint"
            )
        logger.warning("%s: the optimizer step was skipped, the weights are unchanged", what)


def max_over_ranks(accelerator: Accelerator, n: int) -> int:
    """The largest ``n`` of all ranks (a collective: every rank must call it)."""
    if accelerator.num_processes == 1:
        return n
    return int(accelerator.gather(torch.tensor([n], device=accelerator.device)).max())


def reduce_metrics(accelerator: Accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Mean of each metric over the ranks that have it (`train_on`'s token means are the same on
    every rank already). Ranks may hold different keys: a reward that abstained on all of one
    rank's completions has no mean there, so the keys are gathered first."""
    if accelerator.num_processes == 1:
        return metrics
    keys = sorted(set(gather_object(sorted(metrics))))
    rows = [[metrics.get(k, 0.0), float(k in metrics)] for k in keys]
    t = torch.tensor(rows, dtype=torch.float64, device=accelerator.device)
    t = accelerator.reduce(t, reduction="sum")
    return {k: total / count for k, (total, count) in zip(keys, t.tolist(), strict=True)}
