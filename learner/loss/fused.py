"""The GRPO loss fused with the LM head: three N·H·V products instead of four.

`token_logprobs` keeps no `[tokens, vocab]` values between forward and backward, so its
backward must recompute the logits (softmax needs each token's final log-sum-exp): four
N·H·V products. But the GRPO loss is *separable*: a sum over tokens of a function of that
token's (log-prob, entropy) with weights (the normalisers) fixed by the mask. So once a chunk
of tokens has all its V logits in memory, everything is known inside the chunk: log-prob,
entropy, the loss's per-token gradients (autograd through `grpo_loss` itself), hence
∂loss/∂logits, ∂loss/∂hidden = G @ W and this chunk's share of ∂loss/∂W = Gᵀ @ hidden, all
in the forward (Liger's approach). The backward only scales the stored gradients by the
incoming (scalar) grad_output.

    logp_t = z_t - lse,  entropy = lse - Σ_j p_j z_j        (z = logits / T, p = softmax(z))
    G_tj   = (g_logp_t (1[j = t] - p_j) - g_ent_t p_j (log p_j + entropy_t)) / T

Memory: one chunk's logits (`chunk_size` × V; 2 bytes an entry on the Triton path, which
stores — bf16 weights — tiles anchored at the target logit, whose row scaling is G (applied
inside the two products) or, with the entropy differentiated, which one pass overwrites with
G; fp16 weights: softmax tiles overwritten in place with G; see
`learner.loss.kernels.triton_fused`) plus the two gradients,
which exist from the forward on (dW is [V, H] in the weight's dtype, the same tensor the
4-product path allocates in its backward); with anchored tiles and no entropy gradient also
`chunk_size` × H fp32 rows (grad_hidden's product before its row scaling).

Accuracy of dW: it is summed over ceil(N / chunk_size) chunks. Each chunk's product
accumulates in fp32 inside cuBLAS, but the running sum lives in the weight's dtype: one bf16
rounding per chunk. Measured on CPU (N=16384, H=256, V=8192, DAPO-like per-token gradients,
relative error of dW vs float64): 0.29 % for one chunk, 0.47 % for 16, 0.58 % for 32, 0.71 % for
64 (an fp32 accumulator stays at 0.24 %, the floor set by bf16 G). `fp32_weight_grad=True`
accumulates in an fp32 [V, H] buffer instead: 4·V·H bytes instead of 2·V·H (0.62 GB instead of
0.31 GB for the Qwen3 head at H=1024), plus the bf16 copy made at the end.

`token_loss` (`learner.loss.token`) must be separable as above: its gradient w.r.t. one token's
(log-prob, entropy) may depend only on that token's values. Tokens of later chunks hold zeros
while earlier chunks differentiate it; the returned loss and metrics come from one last call
with every token filled. `GRPOTokenLoss` gives its per-token gradients in closed form
(`token_grads`: ~15 elementwise ops on the chunk's tokens); any other token loss is
differentiated by autograd, ~180 small kernels a chunk (on CUDA captured in a graph and replayed
per chunk: `cuda_graph`). A token loss whose gradient does not depend on the values at all sets
`constant_grads = True` and is differentiated once instead of once per chunk (`GRPOTokenLoss`
with μ = 1, no KL and no IS weight: the ratio exp(logp - logp.detach()) is 1 whatever logp is,
and the entropy bonus is linear). A token loss may also say `entropy_grad = False` (it never
differentiates the entropy; `GRPOTokenLoss` without an entropy bonus), which lets the Triton
engine apply G as a row scaling of its anchored tiles, with no pass over them; without the
attribute it is assumed True.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from learner.loss.logprobs import check_head_inputs, check_target_range, logits_grad, scaled_logits
from learner.loss.numerics import Impl, compute_dtype, fp16_grad_scale, triton_importable
from learner.loss.products import grad_hidden_rows, grad_weight_add
from learner.loss.token import TokenLoss
from learner.loss.token_grads import GraphedTokenGrads, autograd_token_grads


def fused_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    token_loss: TokenLoss,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = False,
    impl: Impl = "auto",
    cuda_graph: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """`token_loss(logp, entropy)` of `softmax(hidden @ weight.T / temperature)` at `targets`.

    hidden `[N, H]`, weight `[V, H]`, targets `[N]` in `[0, V)`. Returns `(loss, logp [N],
    entropy [N])`; only the loss is differentiable (w.r.t. hidden and weight), and both
    gradients are computed here, in the forward. `chunk_size` tokens have their logits in
    memory at a time; None: `auto_chunk_size(hidden size)`. `impl="auto"` takes the Triton
    kernels for CUDA bf16/fp16 inputs when triton imports, else the PyTorch path (the
    reference; float64 works). A token loss with `token_grads(logp, entropy, s, e)` (as
    `GRPOTokenLoss`) gives its per-token gradients in closed form; any other is differentiated
    by autograd chunk by chunk, which `cuda_graph` (on CUDA) captures in a CUDA graph replayed
    for every chunk (one launch instead of ~180 small ones a chunk; captured before the first
    chunk, or after an eager first chunk for the process's first capture, see
    `GraphedTokenGrads`); a token loss that cannot be captured (a host sync, say) falls back
    to eager, with one warning.
    """
    if chunk_size is None:
        chunk_size = auto_chunk_size(weight.shape[-1])
    # On CUDA the targets' range is checked in the forward without a host sync (it would hold
    # the host until the GPU has run everything queued before this loss, the model's forward
    # say, and then leave the GPU idle while the host launches the loss's first kernels).
    check_head_inputs(
        hidden, weight, targets, temperature, chunk_size, target_range=not targets.is_cuda
    )
    if impl == "auto":
        impl = "triton" if _triton_usable(hidden, weight) else "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    opts = (float(temperature), int(chunk_size), bool(fp32_weight_grad), impl, need)
    opts += (bool(cuda_graph),)
    return FusedLinearLoss.apply(hidden, weight, targets, token_loss, opts)


def auto_chunk_size(hidden_size: int) -> int:
    """Tokens a chunk: 1.5 × the hidden size, between 1024 and 4096, a multiple of 256.

    The chunk's logits buffer (`chunk × V` 2-byte values on the GPU) then takes at most 1.5×
    the LM head's own bytes (`V × H`): 0.47 GB for the Qwen3-0.6B head (1536 tokens), 1.24 GB
    for the Qwen3-8B one (4096). Larger chunks amortise the per-chunk read-modify-write of
    grad_weight and the per-chunk small kernels: measured on an H100 (docs/benchmarks.md), the
    8B head took 188.8, 186.0 and 185.8 ms at 2048, 3072 and 4096 tokens a chunk (the forward
    kernel runs in launches of at most `triton_fused.FWD_ROWS` = 2048 tokens, whose hidden rows
    stay in L2: 195.9 ms at 4096 as one launch).
    """
    chunk = (3 * hidden_size // 2) // 256 * 256
    return max(1024, min(4096, chunk))


def _triton_usable(hidden: Tensor, weight: Tensor) -> bool:
    if not hidden.is_cuda or hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    if weight.dtype != hidden.dtype or hidden.shape[1] * 2 % 16:  # 16-byte rows for TMA
        return False
    return triton_importable()


class FusedLinearLoss(torch.autograd.Function):
    """Loss, log-probs and entropy in the forward, with both gradients; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, token_loss, opts):
        temperature, chunk, fp32_dw, impl, (need_h, need_w), cuda_graph = opts
        n = hidden.shape[0]
        cdtype = compute_dtype(hidden.dtype)
        in_range = _TargetRange(targets, weight.shape[0]) if targets.is_cuda and n else None
        if in_range is not None:  # the kernels read clamped targets: no out-of-bounds access
            targets = in_range.clamped
        grads = _ChunkTokenGrads(token_loss, hidden, chunk, need_h or need_w, cuda_graph)
        if impl == "triton":
            from learner.loss.kernels.triton_fused import TritonChunks

            ent_grad = getattr(token_loss, "entropy_grad", True)
            chunks = TritonChunks(hidden, weight, targets, temperature, chunk, ent_grad)
        else:
            chunks = TorchChunks(hidden, weight, targets, temperature)
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H], every chunk's rows set
        dw_dtype = torch.float32 if fp32_dw and weight.dtype != cdtype else weight.dtype
        grad_w = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if need_w else None
        grads.prepare_constant()
        loss = _chunk_pass(chunks, grads, grad_h, grad_w, in_range, chunk)
        logp, ent = grads.logp, grads.ent
        del grads  # frees the graph's memory pool
        if in_range is not None:  # its copy has long landed: no wait
            in_range.check()
        ctx.grads = (grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(logp, ent)
        return loss.detach(), logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_grpo_loss: backward ran twice; its gradients are computed once in the "
                "forward (call fused_grpo_loss again instead of retain_graph=True)"
            )
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # free them with the graph's first use
        for g in (grad_h, grad_w):  # in place: no second buffer
            if g is not None:
                _scale_by(g, g_loss)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def _chunk_pass(
    chunks: TorchChunks, grads: _ChunkTokenGrads, grad_h: Tensor | None,
    grad_w: Tensor | None, in_range: _TargetRange | None, chunk: int,
) -> Tensor:  # fmt: skip
    """Every chunk's log-probs and entropies (into `grads.logp`, `grads.ent`) and, where
    gradients are asked for, its per-token gradients and the two products into `grad_h` and
    `grad_w`. Returns the loss, its value and metrics from one call with every token filled."""
    token_loss, logp, ent = grads.token_loss, grads.logp, grads.ent
    n = logp.shape[0]
    need = grad_h is not None or grad_w is not None
    dw_empty = True  # grad_w holds no chunk yet: the first product writes it (no memset)
    loss = None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        chunks.stats(s, e, logp[s:e], ent[s:e])
        if in_range is not None and s == 0:  # after the first launches: off their path
            in_range.start()
        if not need:
            continue
        g_lp, g_ent = grads(s, e)
        if e == n:  # every token filled: the exact loss and metrics, queued before the
            with torch.no_grad():  # last chunk's two products (the host runs ahead)
                loss = token_loss(logp, ent)
        if g_lp is None and g_ent is None:
            if grad_h is not None:
                grad_h[s:e].zero_()
            continue
        # [C, V] ∂loss/∂logits in the matmul dtype, times `scale` (a power of two, fp16
        # only), or such that ∂loss/∂logits = diag(scale) @ g (scale [C], anchored tiles)
        g, scale = chunks.logits_grad(g_lp, g_ent)
        grad_hidden_rows(g, scale, chunks.w, grad_h, s, e, getattr(chunks, "fp32_rows", None))
        if grad_w is not None:
            grad_weight_add(g, scale, chunks.h[s:e], grad_w, first=dw_empty)
            dw_empty = False
        del g
    if grad_w is not None and dw_empty:
        grad_w.zero_()
    if loss is None:  # no gradients were asked for
        with torch.no_grad():
            loss = token_loss(logp, ent)  # exact value and metrics: every token filled now
    return loss


class _ChunkTokenGrads:
    """Where one fused-loss call takes each chunk's ∂loss/∂logp and ∂loss/∂entropy from, in
    this order: computed once for all chunks (`constant_grads`), the token loss's closed form
    (`token_grads`), its autograd captured in a CUDA graph (`GraphedTokenGrads`), eager
    autograd. Owns the [N] log-prob and entropy buffers the chunks fill (where a graph reads
    them)."""

    def __init__(
        self, token_loss: TokenLoss, hidden: Tensor, chunk: int, need_grads: bool,
        cuda_graph: bool,
    ) -> None:  # fmt: skip
        n = hidden.shape[0]
        self.token_loss = token_loss
        self.closed = getattr(token_loss, "token_grads", None)  # closed-form per-token grads
        constant = getattr(token_loss, "constant_grads", False)
        cuda_graph = (
            cuda_graph
            and self.closed is None
            and hidden.is_cuda
            and need_grads
            and not constant
            and not torch.cuda.is_current_stream_capturing()
        )
        self.graphed = (
            GraphedTokenGrads.for_call(token_loss, n, chunk, hidden) if cuda_graph else None
        )
        if self.graphed is not None:  # [N] each, where the graph reads them
            self.logp, self.ent = self.graphed.logp.zero_(), self.graphed.ent.zero_()
        else:
            cdtype = compute_dtype(hidden.dtype)
            self.logp = hidden.new_empty(n, dtype=cdtype)  # [N], every chunk's `stats` fills it
            self.ent = hidden.new_empty(n, dtype=cdtype)  # [N]
        self.const = need_grads and constant
        self.all: tuple[Tensor | None, Tensor | None] = (None, None)

    def prepare_constant(self) -> None:
        """Gradients independent of the values: once, at any values (zeros); the closed form
        needs no host sync."""
        if self.const:
            n = self.logp.shape[0]
            zeros = self.logp.new_zeros(n)
            grads = self.closed or partial(autograd_token_grads, self.token_loss)
            self.all = grads(zeros, zeros, 0, n)

    def __call__(self, s: int, e: int) -> tuple[Tensor | None, Tensor | None]:
        """∂loss/∂logp and ∂loss/∂entropy of tokens `[s, e)`, once `logp[:e]` is filled."""
        graphed = self.graphed
        if self.const:
            g_lp_all, g_ent_all = self.all
            g_lp = None if g_lp_all is None else g_lp_all[s:e]
            g_ent = None if g_ent_all is None else g_ent_all[s:e]
            return g_lp, g_ent
        if self.closed is not None:
            return self.closed(self.logp, self.ent, s, e)
        if graphed is not None and (s > 0 or graphed.ready):
            return graphed(s, e)
        if graphed is not None:  # eager: the warm-up, which also looks for host syncs
            return graphed.warm_up(s, e)
        return autograd_token_grads(self.token_loss, self.logp, self.ent, s, e)


class _TargetRange:
    """The targets' range on CUDA without a host sync. The kernels read `clamped`, the
    targets clamped into [0, V) (nothing reads out of bounds); `start`, called once the first
    chunk's kernels are queued, copies min and max to the host asynchronously; `check`, at
    the end of the forward, reads them (a ValueError, as `check_head_inputs` gives)."""

    def __init__(self, targets: Tensor, vocab: int) -> None:
        self.targets, self.vocab = targets, vocab
        self.clamped = targets.clamp(0, vocab - 1)
        self.ready: torch.cuda.Event | None = None

    def start(self) -> None:
        lo_hi = torch.stack(torch.aminmax(self.targets)).long()
        self.host = torch.empty(2, dtype=torch.long, pin_memory=True)
        self.host.copy_(lo_hi, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def check(self) -> None:
        if self.ready is None:
            self.start()
        assert self.ready is not None
        self.ready.synchronize()
        lo, hi = self.host.tolist()
        check_target_range(lo, hi, self.vocab)


def _scale_by(x: Tensor, s: Tensor) -> None:
    """`x *= s` (s: the 0-dim incoming gradient). On CUDA a Triton kernel that reads the
    scalar on the device and does nothing when it is 1 (no host sync); PyTorch's `mul_` by a
    0-dim CUDA tensor broadcasts it (3.3 ms on an 8B head's 1.2 GB grad_weight)."""
    if x.is_cuda and s.is_cuda and x.is_contiguous() and triton_importable():
        from learner.loss.kernels.triton_fused import scale_

        scale_(x, s.reshape(1).float())
    else:
        x.mul_(s)


class TorchChunks:
    """The PyTorch chunk engine (reference, CPU, float64): logits in the compute dtype."""

    def __init__(self, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float):
        self.h, self.w, self.tgt = hidden, weight, targets
        self.inv_t = 1.0 / temperature
        self.cdtype = compute_dtype(hidden.dtype)
        self._state: tuple | None = None

    def stats(self, s: int, e: int, logp: Tensor, ent: Tensor) -> None:
        """Log-probs and entropies of tokens `[s, e)`, written into `logp` and `ent`."""
        z = scaled_logits(self.h[s:e], self.w, self.inv_t, self.cdtype)  # [C, V]
        lse = torch.logsumexp(z, dim=-1)  # [C]
        torch.sub(z.gather(1, self.tgt[s:e, None]).squeeze(1), lse, out=logp)
        p = (z - lse[:, None]).exp_()  # [C, V]
        torch.sub(lse, p.mul_(z).sum(-1), out=ent)
        del p
        self._state = (z, lse, ent, s, e)

    def logits_grad(self, g_lp: Tensor | None, g_ent: Tensor | None) -> Tensor:
        assert self._state is not None
        z, lse, ent, s, e = self._state
        self._state = None
        g = logits_grad(z, lse, ent, self.tgt[s:e], g_lp, g_ent, self.inv_t)  # [C, V], z consumed
        scale = fp16_grad_scale(
            self.w.dtype,
            None if g_lp is None else g_lp * self.inv_t,
            None if g_ent is None else g_ent * self.inv_t,
            self.w.shape[0],
        )
        return (g if scale == 1.0 else g.mul_(scale)).to(self.w.dtype), scale


__all__ = [
    "FusedLinearLoss",
    "TorchChunks",
    "auto_chunk_size",
    "fused_grpo_loss",
]
