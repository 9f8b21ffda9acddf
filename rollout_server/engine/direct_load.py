"""Loading a received update by copying it straight into vLLM's parameters.

vLLM's ``load_weights`` renames every checkpoint tensor in Python and routes it through its
parameter's ``weight_loader``: 7-15 ms for a 0.6B model, several times the NCCL wire time of the
whole update. For an unquantized model on one GPU every checkpoint tensor lands in one
contiguous row range of one parameter (``q_proj`` in the first rows of ``qkv_proj``, ``up_proj``
after ``gate_proj`` in ``gate_up_proj``), so a *copy plan* of destination views, built once per
update layout, turns each later load into one fused multi-tensor copy (``nccl_wire.copy_all``).

Plans are made only for updates that cover every parameter (what the learner sends each step),
and trusted only once vLLM agrees: the first update of a layout is loaded with ``load_weights``,
and the plan is kept only if then every destination equals its source bit for bit (``verify``).
Otherwise that layout keeps ``load_weights``. Pure torch, no vLLM import: tests run it on CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rollout_server.nccl_wire import copy_all

# vLLM pads the vocabulary rows of these (to a multiple of 64); the checkpoint rows come first.
_VOCAB_PADDED = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class CopyPlan:
    """``dests[k]`` (a view into a parameter) receives the update's tensor ``sources[k]``."""

    sources: tuple[int, ...]
    dests: tuple[torch.Tensor, ...]


def plan_copies(
    params: Mapping[str, torch.Tensor],
    tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    packed: Mapping[str, Sequence[str]],
    skip: frozenset[str] = frozenset(),
) -> CopyPlan | str:
    """A copy plan for an update of ``tensors`` (name, shape, dtype) into ``params`` (vLLM's
    ``named_parameters``), or the reason there is none.

    ``packed`` is the model's ``packed_modules_mapping`` (fused name -> its parts, in row
    order, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``); names in ``skip`` are ones
    ``load_weights`` ignores too (a tied ``lm_head.weight``)."""
    shapes = {name: tuple(shape) for name, shape, _ in tensors}
    sources: list[int] = []
    dests: list[torch.Tensor] = []
    rows: dict[str, list[tuple[int, int]]] = {}
    for i, (name, shape, dtype) in enumerate(tensors):
        if name in skip:
            continue
        target = _destination(name, tuple(shape), params, packed, shapes)
        if isinstance(target, str):
            return target
        pname, start = target
        param = params[pname]
        if param.dtype != dtype:
            return f"{name}: {dtype} where vLLM's {pname} is {param.dtype}"
        if not param.is_contiguous():
            return f"{pname} is not contiguous"
        n = shape[0] if shape else 1
        rows.setdefault(pname, []).append((start, start + n))
        dests.append(param.narrow(0, start, n) if shape else param)
        sources.append(i)
    for pname, spans in rows.items():
        spans.sort()
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            return f"two tensors of the update overlap in {pname}"
    if outside := sorted(set(params) - set(rows)):
        return f"the update leaves out {len(outside)} of vLLM's parameters, e.g. {outside[0]}"
    return CopyPlan(tuple(sources), tuple(dests))


def _destination(
    name: str,
    shape: tuple[int, ...],
    params: Mapping[str, torch.Tensor],
    packed: Mapping[str, Sequence[str]],
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[str, int] | str:
    """(parameter name, first row) where ``name`` lands, or why it cannot be placed."""
    if name in params:
        have = tuple(params[name].shape)
        if have == shape:
            return name, 0
        padded = name.endswith(_VOCAB_PADDED) and len(have) == len(shape) == 2
        if padded and have[1] == shape[1] and have[0] >= shape[0]:
            return name, 0
        return f"{name}: shape {list(shape)} where vLLM's parameter is {list(have)}"
    for fused, parts in packed.items():
        for k, part in enumerate(parts):
            segment = f".{part}."
            if segment not in name:
                continue
            fused_name = name.replace(segment, f".{fused}.", 1)
            if fused_name not in params:
                continue
            sizes = []
            for other in parts:
                sibling = name.replace(segment, f".{other}.", 1)
                if sibling not in shapes or not shapes[sibling]:
                    return f"{name}: its sibling {sibling} of {fused_name} is not in the update"
                sizes.append(shapes[sibling][0])
            have = tuple(params[fused_name].shape)
            if sum(sizes) != have[0] or have[1:] != shape[1:]:
                return (
                    f"{name}: the parts of {fused_name} are {sizes} rows x {list(shape[1:])}, "
                    f"vLLM's parameter is {list(have)}"
                )
            return fused_name, sum(sizes[:k])
    return f"{name}: no vLLM parameter has that name or is fused from it"


def verify(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> str | None:
    """After ``load_weights`` loaded ``tensors``: None if the plan would have done the same
    (every destination, a copy, equals its source exactly), else what differs."""
    for i, dest in zip(plan.sources, plan.dests, strict=True):
        src = tensors[i]
        if dest.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
            return f"load_weights kept update tensor {i} itself as a parameter (no copy)"
        if not torch.equal(dest, src.to(dest.device)):
            return f"update tensor {i} is not where the plan puts it"
    return None


def copy_in(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the update into the parameters: one fused multi-tensor copy where torch has it."""
    copy_all(plan.dests, [tensors[i] for i in plan.sources])
