"""A token loss's per-token gradients by autograd, for the fused loss's token losses without
a closed form (`token_grads`): eager, or captured once in a CUDA graph and replayed for every
chunk (one launch instead of the ~180 small kernels of an eager pass)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from learner.loss.numerics import compute_dtype
from learner.loss.token import TokenLoss


def autograd_token_grads(
    token_loss: TokenLoss, logp: Tensor, ent: Tensor, s: int, e: int
) -> tuple[Tensor | None, Tensor | None]:
    """∂loss/∂logp and ∂loss/∂entropy of tokens `[s, e)` (None where the loss ignores it)."""
    lp = logp.detach().requires_grad_()
    en = ent.detach().requires_grad_()
    with torch.enable_grad():
        loss = token_loss(lp, en)
        if not loss.requires_grad:
            return None, None
        g_lp, g_ent = torch.autograd.grad(loss, (lp, en), allow_unused=True)
    return (None if g_lp is None else g_lp[s:e]), (None if g_ent is None else g_ent[s:e])


_GRAPH_WARNED: set[str] = set()  # token-loss types whose capture failed (warned once)
_GRAPH_WARM: set[tuple[type, torch.device]] = set()  # captured once in this process


class GraphedTokenGrads:
    """`autograd_token_grads` of all N tokens captured in a CUDA graph and replayed for each chunk:
    the graph reads `logp` and `ent` where they are (the chunks fill them in place) and writes
    the same two output tensors each time; a call returns chunk `[s, e)` of them, valid until
    the next call (stream order: its users run before the next replay). A failed capture
    leaves the caller on eager `autograd_token_grads`.

    `for_call` picks the capture's moment. The first call of a token-loss type in the process
    runs its first chunk eagerly (the warm-up: lazy initialisation cannot happen in a capture)
    and captures at the second. Later calls capture before the first chunk, on the host while
    the GPU still runs whatever produced `hidden`."""

    def __init__(self, token_loss: TokenLoss, logp: Tensor, ent: Tensor) -> None:
        self.token_loss, self.logp, self.ent = token_loss, logp, ent
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor | None, Tensor | None] = (None, None)
        self.failed = False

    @property
    def ready(self) -> bool:
        return self.graph is not None

    @classmethod
    def for_call(
        cls, token_loss: TokenLoss, n: int, chunk: int, hidden: Tensor
    ) -> GraphedTokenGrads | None:
        """The graph for a fused-loss call over `n` tokens (None: differentiate eagerly)."""
        dtype = compute_dtype(hidden.dtype)
        warm = (type(token_loss), hidden.device) in _GRAPH_WARM
        if n <= (chunk if warm else 2 * chunk):  # the capture would not pay for itself
            return None
        graphed = cls(
            token_loss, hidden.new_zeros(n, dtype=dtype), hidden.new_zeros(n, dtype=dtype)
        )
        if warm:
            graphed._capture()
        return graphed

    def warm_up(self, s: int, e: int) -> tuple[Tensor | None, Tensor | None]:
        """The eager first chunk, run with CUDA's sync debug mode on: a token loss that syncs
        with the host (``.item()``, ``.cpu()``, data-dependent shapes) cannot be captured, and
        a capture that fails part way leaves the process's CUDA RNG marked as capturing (every
        later ``torch.randint(device="cuda")`` raised "Offset increment outside graph capture")
        and its memory pool behind. Such a loss is found here, before any capture."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return autograd_token_grads(self.token_loss, self.logp, self.ent, s, e)
        except RuntimeError as err:
            if "synchronizing" not in str(err):
                raise
            self._give_up(err)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return autograd_token_grads(self.token_loss, self.logp, self.ent, s, e)

    def _give_up(self, err: BaseException) -> None:
        self.failed = True
        name = type(self.token_loss).__qualname__
        if name not in _GRAPH_WARNED:
            _GRAPH_WARNED.add(name)
            warnings.warn(
                f"fused_grpo_loss: {name} could not be captured in a CUDA graph ({err}); "
                "differentiating it eagerly once per chunk (slower; cuda_graph=False "
                "silences this)",
                stacklevel=7,  # the fused_grpo_loss call, from the warm-up's chunk
            )

    def __call__(self, s: int, e: int) -> tuple[Tensor | None, Tensor | None]:
        if self.graph is None and not self.failed:
            self._capture()
        if self.graph is None:  # the capture failed
            return autograd_token_grads(self.token_loss, self.logp, self.ent, s, e)
        self.graph.replay()
        g_lp, g_ent = self.out
        return (None if g_lp is None else g_lp[s:e]), (None if g_ent is None else g_ent[s:e])

    def _capture(self) -> None:
        token_loss, logp, ent = self.token_loss, self.logp, self.ent
        n = logp.shape[0]
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device=logp.device)
        side.wait_stream(torch.cuda.current_stream(logp.device))
        try:  # not `torch.cuda.graph`: its gc.collect() and empty_cache() cost a training step
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = autograd_token_grads(token_loss, logp, ent, 0, n)
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            self._give_up(err)
            return
        finally:
            torch.cuda.current_stream(logp.device).wait_stream(side)
        self.graph, self.out = graph, out
        _GRAPH_WARM.add((type(token_loss), logp.device))


__all__ = ["GraphedTokenGrads", "autograd_token_grads"]
