"""NaN/inf checks of weights: they would load fine and then make every log-prob NaN, so every
update refuses them (the server's validation, and the vLLM workers for NCCL and CUDA IPC)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rollout_server.nccl_wire import Bucket

MAX_LISTED = 5


def summarize_problems(problems: Sequence[str]) -> str:
    """The first ``MAX_LISTED`` problems, and how many more there are."""
    more = len(problems) - MAX_LISTED
    return "; ".join(problems[:MAX_LISTED]) + (f"; and {more} more problems" if more > 0 else "")


def non_finite_tensor(name: str, t: torch.Tensor) -> str:
    """ "" when every value of ``t`` is finite (or it is not floating), else the problem."""
    import torch

    if not t.is_floating_point():
        return ""
    if t.element_size() == 1:  # isfinite is not implemented for float8_e4m3fn; fp16 is exact
        t = t.to(torch.float16)
    # One read, no mask: a NaN or inf makes the float32 sum non-finite. A finite sum proves
    # every value finite; a non-finite one (an overflow, rarely) is counted exactly below.
    if bool(torch.sum(t, dtype=torch.float32).isfinite()):
        return ""
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return ""
    bad = t.numel() - int(finite.sum())
    return f"tensor {name!r} holds {bad} non-finite values (NaN or inf) of {t.numel()}"


NON_FINITE_REFUSED = "non-finite weights refused"
"""Starts the error a worker raises for NaN/inf in an NCCL or CUDA IPC update; the engine
turns it back into a ``WeightsError`` (the message is all that crosses vLLM's RPC)."""


def non_finite_buckets(
    flats: Sequence[torch.Tensor], layout: Sequence[Bucket], device: torch.device | None = None
) -> str:
    """ "" when every floating value of an update's buckets is finite, else its problems, naming
    the tensors. One float32 sum per bucket (CPU-staged buckets are summed on ``device``) and one
    host read for all of them; tensor by tensor only when a sum is not finite."""
    import torch

    from rollout_server.nccl_wire import unflatten

    pairs = [(f, b) for f, b in zip(flats, layout, strict=True) if b.dtype.is_floating_point]
    sums = []
    for flat, _ in pairs:
        if flat.element_size() == 1:  # float8: see non_finite_tensor
            flat = flat.to(torch.float16)
        sums.append(torch.sum(flat.to(device, non_blocking=True), dtype=torch.float32))
    if not sums or bool(torch.stack(sums).isfinite().all()):
        return ""
    problems = [
        p for f, b in pairs for name, t in unflatten(f, b) if (p := non_finite_tensor(name, t))
    ]
    if not problems:
        return ""  # a float32 overflow of finite values
    return summarize_problems(problems)
