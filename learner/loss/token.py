"""Token losses for the fused loss (`learner.loss.fused`): the loss as a function of flat
per-token (log-prob, entropy), with the per-token gradients the fused loss differentiates with.

`GRPOTokenLoss` is `grpo_loss` seen that way (every loss type, KL, truncated IS, entropy
bonus), with its gradients in closed form (`token_grads`); `learner.loss.nll.NLLTokenLoss` is
the SFT loss.
A token loss must be *separable*: its gradient w.r.t. one token's values may depend only on
that token's values (the normalisers, fixed by the mask, are constants).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from learner.loss.grpo import LossConfig, LossInputs, global_factor, grpo_loss, row_weights
from learner.loss.numerics import triton_importable
from learner.loss.off_policy import correction_weights
from learner.loss.policy import token_grad

TokenLoss = Callable[[Tensor, Tensor], Tensor]  # (logp [N], entropy [N]) -> scalar loss


class MicroBatch(Protocol):
    """What `GRPOTokenLoss.for_batch` reads of a micro-batch (the learner's `TrainBatch`)."""

    advantages: Tensor  # [B]
    loss_mask: Tensor  # [B, T'] 1 at the loss tokens
    sampling_logprobs: Tensor  # [B, T'] aligned with loss_mask
    seq_weights: Tensor | None  # [B] `LossInputs.seq_weights`


class GRPOTokenLoss:
    """`grpo_loss` as a function of flat per-token (log-prob, entropy): a `TokenLoss`.

    Takes what the learner already builds for `grpo_loss`: `seq` [N] is the rollout (row of
    `advantages`) of every loss token, each sequence's tokens contiguous and in order
    (`learner.step.update.seq_index`); the per-token inputs are `[B, L]` as `update.regroup`
    makes them, or flat `[N]`. Every call regroups the flat values the same way and calls
    `grpo_loss`, so all loss types, KL, truncated IS and the entropy bonus are exactly its own.
    `metrics` holds the metrics of the last call. A plain class, not a dataclass: DDP's
    forward rebuilds dataclass arguments field by field.

    Construction launches nothing on the GPU (so the fused loss's first kernels start at
    once): the token index is built on first use (`token_grads`, once the fused loss's first
    forward kernel is queued), and what needs the host (rollout ids within `advantages`, the
    [B, L] layout's L, which a [B, L] input must match) is checked from a copy started then,
    when the loss value is computed (`__call__`, after the last chunk's forward) — the
    ValueError comes from the fused loss's forward, before it returns anything. Until then
    the gathers read clamped indices: nothing reads out of bounds.
    """

    def __init__(
        self,
        cfg: LossConfig,
        seq: Tensor,  # [N] int
        advantages: Tensor,  # [B]
        *,
        old_logprobs: Tensor | None = None,  # [B, L] or [N]; None: current log-probs (μ = 1)
        sampling_logprobs: Tensor | None = None,  # [B, L] or [N]
        ref_logprobs: Tensor | None = None,  # [B, L] or [N]
        num_items_in_batch: float | Tensor | None = None,
        dp_world_size: int = 1,
        num_micro_batches: int = 1,
        seq_weights: Tensor | None = None,  # [B] `LossInputs.seq_weights`
    ) -> None:
        if cfg.importance_sampling_level != "token":
            raise ValueError(
                "a token loss must be separable, and a sequence-level ratio (GSPO) is not: use "
                "the unfused loss (grpo.fused_loss = false) with importance_sampling_level "
                f"{cfg.importance_sampling_level!r}"
            )
        if not cfg.separable:
            raise ValueError(
                "a token loss must be separable, and this one ties each token's gradient to its "
                f"completion (policy_loss {cfg.policy_loss!r}, correction_level "
                f"{cfg.correction_level!r}, rejection band {(cfg.reject_low, cfg.reject_high)}): "
                "use the unfused loss (grpo.fused_loss = false)"
            )
        if seq.dim() != 1 or seq.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"seq must be an integer [N] tensor, got {tuple(seq.shape)} {seq.dtype}"
            )
        num_seqs = advantages.shape[0]
        n = seq.numel()
        if n and not num_seqs:
            raise ValueError(f"{n} loss tokens but no rollouts: advantages is empty")
        self.num_tokens = n
        self.cfg = cfg
        self.advantages = advantages
        self._seq = seq
        self._device = seq.device
        self._prep: tuple[Tensor, Tensor, Tensor] | None = None  # `_prepared`
        self._facts_host: Tensor | None = None
        self._facts_ready: torch.cuda.Event | None = None
        self._shape_v: tuple[int, int] | None = None
        self._inputs: dict[str, Tensor | None] = {}
        for name, x in (
            ("old_logprobs", old_logprobs),
            ("sampling_logprobs", sampling_logprobs),
            ("ref_logprobs", ref_logprobs),
        ):
            if x is not None and x.shape != (n,) and (x.dim() != 2 or x.shape[0] != num_seqs):
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}: pass [B, L] = [{num_seqs}, L] "
                    f"(regrouped as learner.step.update.regroup does) or flat [N] = [{n}]"
                )
            self._inputs[name] = x
        self._grids: dict[str, Tensor | None] = {}
        if isinstance(num_items_in_batch, Tensor):  # a float: no host sync in every call
            num_items_in_batch = float(num_items_in_batch)
        if num_items_in_batch is not None and not num_items_in_batch > 0:
            raise ValueError(
                f"num_items_in_batch must be > 0 (the step's loss tokens), got {num_items_in_batch}"
            )
        self.num_items_in_batch = num_items_in_batch
        self.dp_world_size = dp_world_size
        self.num_micro_batches = num_micro_batches
        if seq_weights is not None and seq_weights.shape != (num_seqs,):
            raise ValueError(f"seq_weights must be [B]={num_seqs}, got {tuple(seq_weights.shape)}")
        self.seq_weights = seq_weights
        self.metrics: dict[str, Tensor] = {}
        self._consts: tuple[Any, ...] | None = None  # token_grads' constants (built once)
        # Gradients independent of the values (see the module docstring): the fused loss
        # differentiates once for all chunks. With μ > 1 (ratio != 1), the KL term or the IS
        # weight (exp(old - sampling) with old = logp) they depend on logp.
        no_is = sampling_logprobs is None or not cfg.correction.active
        self.constant_grads = old_logprobs is None and cfg.beta == 0.0 and no_is
        # Whether the loss differentiates the entropy (else it is a metric): without it the
        # Triton engine stores the logits tiles so that no second pass over them is needed.
        self.entropy_grad = cfg.entropy_coef != 0.0

    @classmethod
    def for_batch(
        cls,
        cfg: LossConfig,
        batch: MicroBatch,
        seq: Tensor,  # [N] `learner.step.update.seq_index(batch)`
        *,
        old_logprobs: Tensor | None,
        ref_logprobs: Tensor | None,
        num_items_in_batch: float | None,
        dp_world_size: int,
        num_micro_batches: int,
    ) -> GRPOTokenLoss:
        """The token loss of one micro-batch, from what `learner.step.update.train_on` holds."""
        mask = batch.loss_mask.bool()
        sampling = batch.sampling_logprobs[mask] if cfg.uses_sampling_logprobs else None
        return cls(
            cfg,
            seq,
            batch.advantages,
            old_logprobs=old_logprobs,
            sampling_logprobs=sampling,
            ref_logprobs=ref_logprobs,
            num_items_in_batch=num_items_in_batch,
            dp_world_size=dp_world_size,
            num_micro_batches=num_micro_batches,
            seq_weights=batch.seq_weights,
        )

    def _prepared(self) -> tuple[Tensor, Tensor, Tensor]:
        """(rollout id, position in its rollout) of every token and the tokens per rollout,
        built on first use without a host sync: the counts by a scatter-add over ids clamped
        into [0, B); the facts that need the host (the ids' range, the longest rollout L)
        copied back asynchronously, read by `_shape`."""
        if self._prep is None:
            seq, n, num_seqs = self._seq, self.num_tokens, self.advantages.shape[0]
            ids = seq.long().clamp(0, max(num_seqs - 1, 0))
            counts = torch.zeros(num_seqs, dtype=torch.long, device=self._device)
            counts.index_add_(0, ids, torch.ones_like(ids))  # [B]
            starts = torch.cumsum(counts, 0) - counts  # [B]
            col = torch.arange(n, device=self._device) - starts[ids]  # [N]
            self._prep = (ids, col, counts)
            facts = torch.stack([*torch.aminmax(seq), counts.max()]).long() if n else counts[:0]
            self._facts_host = torch.empty(facts.shape, dtype=torch.long, pin_memory=seq.is_cuda)
            self._facts_host.copy_(facts, non_blocking=True)
            if seq.is_cuda:
                self._facts_ready = torch.cuda.Event()
                self._facts_ready.record()
        return self._prep

    @property
    def _index(self) -> tuple[Tensor, Tensor]:
        ids, col, _ = self._prepared()
        return ids, col

    @property
    def _shape(self) -> tuple[int, int]:
        """[B, L]: the rollouts and the longest one's tokens (checks the rollout ids first)."""
        if self._shape_v is None:
            self._prepared()
            if self._facts_ready is not None:
                self._facts_ready.synchronize()  # long done when first asked for (`__call__`)
            num_seqs = self.advantages.shape[0]
            if self.num_tokens:
                assert self._facts_host is not None
                lo, hi, longest = self._facts_host.tolist()
                if lo < 0 or hi >= num_seqs:
                    raise ValueError(
                        f"seq holds rollout ids outside [0, len(advantages) = {num_seqs}): "
                        f"min {lo}, max {hi}"
                    )
                self._shape_v = (num_seqs, longest)
            else:
                self._shape_v = (num_seqs, 1)
        return self._shape_v

    @property
    def mask(self) -> Tensor:
        """[B, L] 1 at every loss token."""
        if "mask" not in self._grids:
            self._grids["mask"] = self.regroup(torch.ones(self.num_tokens, device=self._device))
        return self._grids["mask"]  # type: ignore[return-value]

    @property
    def old(self) -> Tensor | None:
        return self._grid("old_logprobs")

    @property
    def sampling(self) -> Tensor | None:
        return self._grid("sampling_logprobs")

    @property
    def ref(self) -> Tensor | None:
        return self._grid("ref_logprobs")

    def regroup(self, flat: Tensor) -> Tensor:
        """Flat `[N]` -> `[B, L]`, right-padded with zeros (as `learner.step.update.regroup`)."""
        return flat.new_zeros(self._shape).index_put(self._index, flat)

    def _grid(self, name: str) -> Tensor | None:
        """A per-token input as [B, L] (regrouped once if it came flat)."""
        if name not in self._grids:
            x = self._inputs[name]
            if x is not None and x.shape == (self.num_tokens,):  # flat [N]
                x = self.regroup(x)
            elif x is not None and x.shape != self._shape:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}: pass [B, L] = {self._shape} (regrouped "
                    f"as learner.step.update.regroup does) or flat [N] = [{self.num_tokens}]"
                )
            self._grids[name] = x
        return self._grids[name]

    def _flat(self, name: str, dtype: torch.dtype) -> Tensor | None:
        """A per-token input as flat [N] (gathered from [B, L] if it came so). No host sync:
        the gather clamps positions into the input's L, whose match with the batch's is
        checked by `__call__` (`_grid`)."""
        x = self._inputs[name]
        if x is None:
            return None
        if x.shape != (self.num_tokens,):  # [B, L]: B checked at construction
            ids, col = self._index
            x = x[ids, col.clamp(max=max(x.shape[1] - 1, 0))]
        return x.to(dtype)

    def token_grads(
        self, logp: Tensor, entropy: Tensor, s: int, e: int
    ) -> tuple[Tensor, Tensor | None]:
        """∂loss/∂logp and ∂loss/∂entropy of tokens `[s, e)` in closed form: what autograd
        through `__call__` gives (`autograd_token_grads`), from `logp[s:e]` and per-token constants
        prepared once, in ~15 elementwise ops on the chunk instead of ~180 kernels over all N
        tokens (on CUDA in fp32 one Triton launch, `triton_fused.grpo_token_grads`: the fused
        loss runs this once a chunk, between its forward kernel and the products). The
        derivative follows `grpo_loss` term by term, with PyTorch's conventions where it is
        not smooth: `torch.min` splits the gradient evenly on a tie (the ratio
        inside the clip range, or a zero advantage) and `clamp` passes it at the bounds."""
        dtype = torch.promote_types(logp.dtype, torch.float32)  # grpo_loss's
        if self._consts is None or self._consts[1].dtype != dtype:
            self._consts = self._grad_consts(dtype)
        adv, w, old, ref, samp, g_ent = (x if x is None else x[s:e] for x in self._consts)
        lp = logp[s:e].to(dtype)
        cfg = self.cfg
        lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
        plain = cfg.policy_loss == "ppo" and (
            samp is None or (cfg.correction_mode == "truncate" and cfg.correction_level == "token")
        )  # what the Triton kernel computes: the clipped surrogate, TIS at most
        if (
            plain
            and lp.is_cuda
            and dtype == torch.float32
            and lp.is_contiguous()
            and triton_importable()
        ):
            from learner.loss.kernels.triton_fused import grpo_token_grads

            g = grpo_token_grads(lp, adv, w, old, ref, samp, (lo, hi), cfg.beta, cfg.tis_cap)
            return g, g_ent
        old = lp if old is None else old  # μ = 1: logp.detach(), as `__call__` passes
        g = token_grad(lp, old, adv, cfg)  # the policy term's, `learner.loss.policy`
        if samp is not None:  # the correction weight multiplies the policy-gradient term
            # a token-level weight of this token's own old and sampling log-probs
            mask = torch.ones_like(lp)[:, None]
            g = (
                g
                * correction_weights(old[:, None], samp[:, None], mask, cfg.correction).weight[:, 0]
            )
        if ref is not None:  # β·(exp(ref - logp) - (ref - logp) - 1)
            g = g + cfg.beta * (1.0 - torch.exp(ref - lp))
        return g * w, g_ent

    def _grad_consts(self, dtype: torch.dtype) -> tuple[Tensor | None, ...]:
        """Flat [N] per-token constants of `token_grads`: advantage, the reduction's weight
        ∂loss/∂per_token, old / reference / sampling log-probs (None where unused), and
        ∂loss/∂entropy (None without an entropy bonus)."""
        seq, _, counts = self._prepared()
        rows = self.seq_weights  # [B]
        if rows is None:
            global_tokens = self.num_items_in_batch is not None
            rows = row_weights(
                counts.to(dtype), self.cfg, self.num_micro_batches, global_tokens=global_tokens
            )
        scale = global_factor(self.cfg, self.num_items_in_batch, self.dp_world_size)
        w = rows.to(dtype)[seq] * scale  # [N] ∂loss/∂per_token
        active = self.cfg.correction.active
        samp = self._flat("sampling_logprobs", dtype) if active else None
        ref = self._flat("ref_logprobs", dtype) if self.cfg.beta != 0.0 else None
        coef = self.cfg.entropy_coef
        g_ent = -coef * w if coef != 0.0 else None
        old = self._flat("old_logprobs", dtype)
        return self.advantages.to(dtype)[seq], w, old, ref, samp, g_ent

    def __call__(self, logp: Tensor, entropy: Tensor) -> Tensor:
        lp = self.regroup(logp)  # [B, L]
        inputs = LossInputs(
            logprobs=lp,
            old_logprobs=self.old if self.old is not None else lp.detach(),
            advantages=self.advantages,
            mask=self.mask,
            sampling_logprobs=self.sampling,
            ref_logprobs=self.ref,
            entropy=self.regroup(entropy),
            num_items_in_batch=self.num_items_in_batch,
            dp_world_size=self.dp_world_size,
            num_micro_batches=self.num_micro_batches,
            seq_weights=self.seq_weights,
        )
        loss, self.metrics = grpo_loss(inputs, self.cfg)
        return loss
