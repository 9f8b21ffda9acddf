"""One optimizer step over a batch of rollouts: micro-batches, the chunked GRPO loss, backward.

Micro-batches are padded rows (grouped by length) or packed rows (padding-free,
``learner.step.packing``). Either way the policy returns flat per-token log-probs at the loss
positions, which are regrouped into ``[B, L]`` per-sequence tensors before the loss, so every
loss type sees exactly the same numbers whatever the layout.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import nullcontext
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from learner.loss.grpo import LossConfig, LossInputs, grpo_loss, row_weights
from learner.loss.off_policy import SEQUENCE_METRICS, tokens_per_version_lag
from learner.loss.token import GRPOTokenLoss
from learner.model.offload import ActivationOffload
from learner.model.routing import record_routes
from learner.step.batch import Rollout, TrainBatch, collate, micro_batches
from learner.step.optimizer import accumulating, backward, deepspeed_engine, optimizer_step
from learner.step.packing import PackedBatch, pack, packed_micro_batches

if TYPE_CHECKING:
    from learner.config import LearnerConfig

C = TypeVar("C")


def _config(section: str) -> Any:
    """A step option that is the config's ``[section]`` field of the same name: `StepOptions.of`
    reads it by name (as `LossConfig.of` reads the loss's), and `_config_defaults` gives it that
    field's default, so no default is written twice and a StepOptions built by hand (tests,
    benches) is a default config's."""
    return field(metadata={"section": section})


def _config_defaults(cls: type[C]) -> type[C]:
    """Give each ``_config`` option of a class about to be a dataclass its config field's
    default (applied before ``@dataclass`` reads the class)."""
    from learner.config import LearnerConfig

    for name in cls.__annotations__:
        option = cls.__dict__.get(name)
        if isinstance(option, Field) and "section" in option.metadata:
            section: Any = LearnerConfig.model_fields[option.metadata["section"]].annotation
            option.default = section.model_fields[name].default
    return cls


@dataclass
@_config_defaults
class StepOptions:
    micro_batch_size: int = _config("grpo")
    num_iterations: int = _config("grpo")
    max_grad_norm: float = _config("optim")
    packing: bool = _config("grpo")
    fused_loss: bool = _config("grpo")
    max_tokens_per_micro_batch: int = _config("grpo")
    pad_to_multiple_of: int = _config("grpo")
    activation_offloading: bool = _config("model")
    need_reference: bool = False  # grpo.beta > 0
    reference_is_adapterless: bool = False  # LoRA: reference = adapters disabled
    skip_zero_advantage: bool = _config("grpo")  # see `rollouts_to_train`
    count_zero_advantage: bool = _config("grpo")  # see `build_micro_batches`
    routing_replay: str = _config("model")  # "r2": the old forward's routes replayed

    @classmethod
    def of(cls, cfg: LearnerConfig) -> StepOptions:
        """The step's options as the validated config sets them ([grpo], [optim], [model]):
        each ``_config`` option read by name from its section, and the two derived ones."""
        own = {
            f.name: getattr(getattr(cfg, f.metadata["section"]), f.name)
            for f in fields(cls)
            if "section" in f.metadata
        }
        return cls(
            **own,
            need_reference=cfg.grpo.beta > 0,
            reference_is_adapterless=cfg.model.lora is not None,
        )


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


def equalize_batches(accelerator: Accelerator, step: StepBatches) -> StepBatches:
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


def seq_index(b: TrainBatch) -> torch.Tensor:
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


def policy_forward(policy, b: TrainBatch, **kw):  # type: ignore[no-untyped-def]
    """The policy (``PolicyLogprobs``) on a padded or a packed micro-batch: flat per-token
    log-probs at its loss positions (and what ``kw`` asks for: entropies, a fused loss), the
    batch's recorded experts replayed where it has them (``learner.model.routing``)."""
    if b.routes is not None:
        kw["routes"] = b.routes
    if isinstance(b, PackedBatch):
        # flash-attention reads sequence starts from position_ids; SDPA/eager need the mask
        return policy(b.input_ids, b.block_causal_mask(), b.loss_mask, b.position_ids, **kw)
    return policy(b.input_ids, b.attention_mask, b.loss_mask, **kw)


@dataclass
class PreparedStep:
    """A step's micro-batches on the device, with what every pass over them reuses: each
    loss position's rollout, the no-grad log-probs (old policy, reference) and the loss
    normaliser's token counts over all ranks."""

    batches: list[TrainBatch]
    real: int  # the first `real` batches are the step's; the rest are fillers of weight 0
    seqs: list[torch.Tensor]  # seq_index of each batch
    olds: list[torch.Tensor | None]  # the policy's log-probs before the step (num_iterations > 1)
    refs: list[torch.Tensor | None]  # the reference's (beta > 0)
    num_items: float  # the loss normaliser: the step's counted tokens on every rank
    local_tokens: int  # the loss tokens of this rank's real batches
    global_trained: float
    global_skipped: float

    def group(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Batch ``i``'s flat per-token values as ``[B, L]`` (``regroup``)."""
        return regroup(flat, self.seqs[i], self.batches[i].advantages.numel())


def prepare_step(
    accelerator: Accelerator,
    policy: torch.nn.Module,
    ref_policy: torch.nn.Module | None,
    step: StepBatches,
    opts: StepOptions,
) -> PreparedStep:
    """The batches to the device, the token counts over the ranks, the no-grad passes."""
    dev = accelerator.device
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
    prep = PreparedStep(
        batches=batches,
        real=real,
        seqs=[seq_index(b) for b in batches],
        olds=[None] * len(batches),
        refs=[None] * len(batches),
        num_items=max(global_tokens, 1.0),
        local_tokens=local_tokens,
        global_trained=global_trained,
        global_skipped=global_skipped,
    )
    with torch.no_grad():
        for i, b in enumerate(batches):
            if opts.num_iterations > 1:
                with record_routes(policy) if opts.routing_replay == "r2" else nullcontext() as rec:
                    prep.olds[i] = prep.group(i, policy_forward(policy, b)[0])
                if rec is not None:  # every later forward of this batch routes as the old one
                    b = batches[i] = dataclasses.replace(b, routes=rec.routes(b.input_ids.shape))
            if opts.need_reference:
                if opts.reference_is_adapterless:
                    lp = policy_forward(accelerator.unwrap_model(policy), b, reference=True)[0]
                else:
                    assert ref_policy is not None
                    lp = policy_forward(ref_policy, b)[0]
                prep.refs[i] = prep.group(i, lp)
    return prep


def micro_batch_loss(
    accelerator: Accelerator,
    policy: torch.nn.Module,
    loss_cfg: LossConfig,
    prep: PreparedStep,
    i: int,
    fused: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss of micro-batch ``i`` (with gradient) and its metrics; ``fused``: the loss
    fused with the LM head, its gradients computed in the forward."""
    b = prep.batches[i]
    if fused:
        token_loss = GRPOTokenLoss.for_batch(
            loss_cfg,
            b,
            prep.seqs[i],
            old_logprobs=prep.olds[i],
            ref_logprobs=prep.refs[i],
            num_items_in_batch=prep.num_items,
            dp_world_size=accelerator.num_processes,
            num_micro_batches=len(prep.batches),
        )
        loss = policy_forward(policy, b, token_loss=token_loss)[0]
        return loss, token_loss.metrics
    lp_flat, ent_flat = policy_forward(policy, b, with_entropy=True)
    logprobs = prep.group(i, lp_flat)
    mask = prep.group(i, torch.ones_like(lp_flat))
    old = prep.olds[i]
    inputs = LossInputs(
        logprobs=logprobs,
        old_logprobs=old if old is not None else logprobs.detach(),
        advantages=b.advantages,
        mask=mask,
        sampling_logprobs=prep.group(i, b.sampling_logprobs[b.loss_mask.bool()])
        if loss_cfg.uses_sampling_logprobs
        else None,
        ref_logprobs=prep.refs[i],
        entropy=prep.group(i, ent_flat) if ent_flat is not None else None,
        num_items_in_batch=prep.num_items,
        dp_world_size=accelerator.num_processes,
        num_micro_batches=len(prep.batches),
        seq_weights=b.seq_weights,
    )
    return grpo_loss(inputs, loss_cfg)


class MetricSums:
    """A step's loss and its metrics' token-weighted sums (sequence-weighted for
    ``SEQUENCE_METRICS``), kept on the device and read back once at the end: a read per
    micro-batch would make the host wait for the GPU before it may queue the next
    micro-batch's work."""

    def __init__(self, device: torch.device | str) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.seqs: torch.Tensor | float = 0.0  # sequences with loss tokens, summed like them

    def add(self, loss: torch.Tensor, metrics: dict[str, Any], weight: float) -> None:
        """``weight``: the micro-batch's loss tokens (0 for a filler)."""
        self.loss += loss.detach().double()
        seqs = metrics.get("num_seqs", 0.0) if weight else 0.0
        seqs = seqs.detach().double() if torch.is_tensor(seqs) else float(seqs)
        self.seqs = self.seqs + seqs
        for k, v in metrics.items():
            if k in ("num_tokens", "num_seqs"):
                continue
            w = seqs if k in SEQUENCE_METRICS else weight
            add = v.detach().double() * w if torch.is_tensor(v) else float(v) * w
            self.sums[k] = self.sums.get(k, 0.0) + add

    def means(self, accelerator: Accelerator, tokens: int, passes: int) -> dict[str, float]:
        """Token means over every rank's trained tokens (``tokens``: this rank's; a rank may
        train few or none of its own), sequence means of ``SEQUENCE_METRICS`` over every rank's
        trained sequences, and the loss, averaged over the ``passes``. A step that trained no
        token (every group's advantage zero, say) has no token means: they are left out, not
        reported as 0 (an ``is_weight`` of 0 would read as servers off the policy)."""
        keys = sorted(self.sums)
        totals = torch.tensor(
            [float(self.sums[k]) for k in keys] + [float(tokens), float(self.seqs)],
            dtype=torch.float64,
            device=accelerator.device,
        )
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        *values, total_tokens, total_seqs = totals.tolist()
        out: dict[str, float] = {}
        if total_tokens > 0:
            for k, v in zip(keys, values, strict=True):
                count = total_seqs if k in SEQUENCE_METRICS else total_tokens
                out[k] = v / (count * passes)
        out["loss"] = float(self.loss) / passes
        return out


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
    clock = PhaseClock(torch.device(accelerator.device))
    prep = prepare_step(accelerator, policy, ref_policy, equalize_batches(accelerator, step), opts)
    clock.lap("prepare")  # batches to the device, the no-grad passes (old/reference log-probs)
    offload = ActivationOffload(keep=policy.parameters()) if opts.activation_offloading else None
    engine = deepspeed_engine(policy)
    sums = MetricSums(accelerator.device)
    grad_norm = 0.0
    for _ in range(opts.num_iterations):
        for i, b in enumerate(prep.batches):
            last = i == len(prep.batches) - 1
            with accumulating(accelerator, policy, engine, last=last, saved=offload):
                loss, m = micro_batch_loss(accelerator, policy, loss_cfg, prep, i, opts.fused_loss)
                clock.lap("forward")
                backward(accelerator, engine, loss)
                clock.lap("backward")
            sums.add(loss, m, float(b.num_loss_tokens) if i < prep.real else 0.0)
        grad_norm = optimizer_step(accelerator, policy, optimizer, engine, opts.max_grad_norm)
        clock.lap("optimizer")
    out = sums.means(accelerator, prep.local_tokens, opts.num_iterations)
    out["grad_norm"] = grad_norm
    out["tokens/trained"] = prep.global_trained
    out["tokens/skipped"] = prep.global_skipped  # zero gradient: left out (`rollouts_to_train`)
    out["tokens/padded"] = float(sum(b.input_ids.numel() for b in prep.batches))
    for phase, secs in clock.seconds().items():  # where the train phase went
        out[f"time/train/{phase}"] = secs
    return out


def version_lag_metrics(
    accelerator: Accelerator, rollouts: list[Rollout], learner_version: int, max_lag: int
) -> dict[str, float]:
    """The step's loss tokens by version lag, summed over the ranks (a collective: every rank
    must call it): ``off_policy/tokens_lag_{k}`` for k = 0 .. ``max_lag`` (the staleness
    bound; 0 where none), ``off_policy/tokens_lag_beyond`` when tokens are older still (or
    newer than the learner's weights), and ``off_policy/version_lag_mean``, the token mean of
    the lag. The lag of a rollout is ``learner_version - weight_version``: how many weight
    updates the learner made since the weights that sampled it."""
    lags = tokens_per_version_lag(
        [r.weight_version for r in rollouts],
        [sum(r.completion_mask) for r in rollouts],
        learner_version,
    )
    counts = [0.0] * (max_lag + 2)  # lags 0 .. max_lag, then the rest
    lag_sum = 0.0
    for lag, n in lags.items():
        counts[lag if 0 <= lag <= max_lag else max_lag + 1] += n
        lag_sum += lag * n
    totals = torch.tensor([*counts, lag_sum], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    *counts, lag_sum = totals.tolist()
    out = {f"off_policy/tokens_lag_{k}": counts[k] for k in range(max_lag + 1)}
    if counts[-1]:
        out["off_policy/tokens_lag_beyond"] = counts[-1]
    if sum(counts):
        out["off_policy/version_lag_mean"] = lag_sum / sum(counts)
    return out


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
