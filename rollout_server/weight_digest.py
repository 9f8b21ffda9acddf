"""The weights' digest: one float64 number that the learner and a rollout server compute alike,
to show that the server holds exactly the weights the learner sent.

A plain sum (or sum of squares) cannot see values that moved: layer 0's ``up_proj`` swapped
with layer 1's, or a tensor's rows permuted, leave it unchanged. Here every element is weighted
by a deterministic function of its position, and every tensor (or bucket) by a function of its
name, so a value in the wrong place changes the number. Two forms:

- ``flat_checksum``: of the flat buffers an update travels in (NCCL and CUDA IPC buckets);
  an element's position is (bucket index, offset in the bucket), which the announced bucket
  layout ties to a tensor name. Both ends hold the same buffers.
- ``params_checksum`` / ``named_checksum``: of the parameters, by name, combined in name order.
  vLLM serves q/k/v and gate/up fused into one parameter (``qkv_proj``, ``gate_up_proj``,
  parts stacked by rows): the digest is defined in that fused name space, a part's elements
  weighted by their position in the fused tensor, so the learner's separate Hugging Face
  tensors and vLLM's fused parameter give the same number. vLLM's vocabulary padding rows are
  zeros and add nothing.

Equality: the position weights come from correctly rounded float64 element-wise operations, so
the same values in the same layout on the same device give the same bits. Sums taken on another
device, or over the same bytes cut differently (the learner's NCCL segments against the
server's whole buckets), differ only by float64 rounding: compare those at a relative 1e-9.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

import torch

# vLLM's usual fusions (fused name -> its parts, in row order). The digest's name space, and
# the copy plans' default for a model class without ``packed_modules_mapping``.
COMMON_PACKED: Mapping[str, Sequence[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

# Elements per float64 pass: bounds the transient memory (a few float64 copies of a chunk)
CHECKSUM_CHUNK = 1 << 24
# Irrational steps: frac(i * step) never repeats, so no two positions share a weight pattern
_STEP_LINEAR = 0.6180339887498949  # golden ratio - 1
_STEP_SQUARE = 0.41421356237309515  # sqrt(2) - 1


def name_weight(name: str) -> float:
    """A weight in [1, 2) from a stable hash of ``name`` (not Python's salted ``hash``)."""
    h = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return 1.0 + int.from_bytes(h, "little") / 2.0**64


def positional_sum(flat: torch.Tensor, start: int = 0, chunk: int = CHECKSUM_CHUNK) -> torch.Tensor:
    """Float64 ``sum(x[i] * a(i) + x[i]**2 * b(i))`` of a 1-D tensor whose first element sits
    at position ``start``, with ``a``, ``b`` in [1, 2) functions of the position only; a 0-d
    tensor on ``flat``'s device (no host sync)."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for lo in range(0, flat.numel(), chunk):
        part = flat[lo : lo + chunk].double()  # [<=chunk]
        pos = torch.arange(
            start + lo, start + lo + part.numel(), dtype=torch.float64, device=flat.device
        )
        a = torch.frac(pos * _STEP_LINEAR).add_(1.0)
        b = torch.frac(pos.mul_(_STEP_SQUARE)).add_(1.0)
        total += (part * a).sum() + (part.square() * b).sum()
    return total


def flat_checksum(
    flat: torch.Tensor, bucket: int = 0, start: int = 0, chunk: int = CHECKSUM_CHUNK
) -> torch.Tensor:
    """The digest of bucket ``bucket``'s elements from offset ``start`` on (``flat``, 1-D), as a
    0-d float64 tensor. Linear: the digests of a bucket's segments add up to the bucket's."""
    return positional_sum(flat, start, chunk) * name_weight(f"bucket {bucket}")


def fused_place(name: str, shapes: Mapping[str, Sequence[int]]) -> tuple[str, int]:
    """(name in the digest's fused name space, element offset in the fused tensor) of the
    tensor ``name``; ``shapes`` holds every tensor's shape. A part whose siblings are not all
    there keeps its own name."""
    for fused, parts in COMMON_PACKED.items():
        for k, part in enumerate(parts):
            segment = f".{part}."
            if segment not in name:
                continue
            siblings = [name.replace(segment, f".{p}.", 1) for p in parts]
            if not all(s in shapes and len(shapes[s]) > 0 for s in siblings):
                return name, 0
            row = math.prod(shapes[name][1:])
            return name.replace(segment, f".{fused}.", 1), row * sum(
                shapes[s][0] for s in siblings[:k]
            )
    return name, 0


def named_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """The digest of named tensors (``named_parameters()``, a state dict): per tensor the
    ``positional_sum`` at its place in the fused name space, times its fused name's
    ``name_weight``, summed in name order."""
    tensors = dict(named)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    placed = sorted((*fused_place(n, shapes), n) for n in tensors)
    with torch.no_grad():
        sums: dict[str, torch.Tensor] = {}
        for fused, start, name in placed:
            part = positional_sum(tensors[name].detach().reshape(-1), start)
            sums[fused] = part if fused not in sums else sums[fused] + part
        total = sum(s * name_weight(n) for n, s in sorted(sums.items()))  # on the device
    return float(total)


def params_checksum(model: torch.nn.Module) -> float:
    """``named_checksum`` of a model's parameters (shared ones once, under their first name)."""
    return named_checksum(model.named_parameters())
