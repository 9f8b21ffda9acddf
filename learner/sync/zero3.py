"""Full parameters out of a (possibly ZeRO-3 partitioned) model, a bucket at a time.

Under DeepSpeed ZeRO-3 each rank holds a shard of every parameter and ``p.numel()`` is 0 outside
a gather; the real size is ``p.ds_numel`` and the real shape ``p.ds_shape``. Gathering the whole
model at once would need its full size on every GPU, so parameters are gathered in buckets of
about ``bucket_numel`` elements, and each bucket is cloned out before the gather is released
(the gathered storage is freed on exit). Nothing is yielded from inside a gather: a consumer that
stops early must not leave one rank inside a collective the others have left.

Every rank must iterate to the end (the gathers are collective); only the main process uses
the tensors. Without ZeRO-3 this is ``named_parameters()`` with wrapper prefixes stripped.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from rollout_server.protocol import TensorSpec

# Added by DeepSpeed / DDP (``module.``) and torch.compile (``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_wrappers(name: str) -> str:
    """``module._orig_mod.model.layers.0...`` -> ``model.layers.0...`` (checkpoint names)."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def is_partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (DeepSpeed marks them with ``ds_numel``/``ds_shape``)."""
    return hasattr(p, "ds_numel")


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape)


def full_numel(p: torch.Tensor) -> int:
    return int(p.ds_numel) if is_partitioned(p) else p.numel()


def param_specs(model: nn.Module, dtype: str | torch.dtype | None = None) -> list[TensorSpec]:
    """What ``iter_gathered_params`` will yield, in the same order, without gathering anything.

    ``dtype`` is the dtype to send (the server's, from ``/info``); default: each parameter's."""
    out = []
    for name, p in model.named_parameters():
        d = dtype if dtype is not None else p.dtype
        out.append(
            TensorSpec(
                name=strip_wrappers(name),
                dtype=str(d).removeprefix("torch."),
                shape=list(full_shape(p)),
            )
        )
    return out


def iter_gathered_params(
    model: nn.Module, bucket_numel: int = 1 << 28
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint name, full tensor)`` for every parameter, in ``named_parameters``
    order, lazily (the first comes at once: a sync starts sending it while the rest are
    listed). ZeRO-3 parameters are gathered about ``bucket_numel`` elements at a time and
    yielded as fresh clones (safe to keep); the others are the detached parameters themselves
    (copy them if the model will change while you hold them)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, p in model.named_parameters():
        name = strip_wrappers(name)
        if not is_partitioned(p):
            if bucket:  # keep the order: what is waiting to be gathered goes first
                yield from _gather_bucket(bucket)
                bucket, size = [], 0
            yield name, p.detach()
            continue
        n = full_numel(p)
        if bucket and size + n > bucket_numel:
            yield from _gather_bucket(bucket)
            bucket, size = [], 0
        bucket.append((name, p))
        size += n
    if bucket:
        yield from _gather_bucket(bucket)


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
        return [(name, p.detach().clone()) for name, p in bucket]
