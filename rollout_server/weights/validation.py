"""Weight updates before they touch the model: parse safetensors, validate.

An update is validated whole — every name known, every dtype and shape exactly the model's —
before anything is copied, so a bad update is refused while the old weights keep serving.
Dtypes must match exactly (no silent casts): the sender knows the model's dtype from
``/info`` and casting there is cheap; casting here would hide a mixed-up checkpoint.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_server.engine.base import TensorMeta, WeightsError
from rollout_server.finite import non_finite_tensor, summarize_problems

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import IpcUpdateRequest, LoraAdapterSpec, NcclUpdateRequest
    from rollout_server.weights.paths import WeightDirs


def parse_safetensors(blob: bytes, *, what: str = "the request body") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors blob; a truncated or garbled one is a ``WeightsError``."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not blob:
        raise WeightsError(f"{what} is empty; send a safetensors blob")
    try:
        return load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise WeightsError(f"{what} is not a valid safetensors blob ({exc})") from exc


def read_safetensors_path(path: str, dirs: WeightDirs | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file, or of every .safetensors file in a directory; with
    ``dirs``, only inside those directories (each file's resolved path checked)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = dirs.check(path) if dirs is not None else Path(path)
    if not p.exists():
        raise WeightsError(f"cannot read {path}: no such file or directory on the server")
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise WeightsError(f"no .safetensors files in the directory {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if dirs is not None:  # a link inside the directory may point outside it
            f = dirs.check(f)
        try:
            loaded = load_file(f)
        except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
            raise WeightsError(f"cannot read {f}: {exc}") from exc
        for name in loaded.keys() & tensors.keys():
            raise WeightsError(f"tensor {name!r} appears in more than one file under {path}")
        tensors.update(loaded)
    return tensors


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _unknown(name: str, metadata: Mapping[str, TensorMeta]) -> str:
    close = difflib.get_close_matches(name, list(metadata), n=1)
    return f"unknown tensor {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _check(name: str, dtype: str, shape: tuple[int, ...], meta: TensorMeta | None, md) -> str:
    if meta is None:
        return _unknown(name, md)
    if dtype != meta.dtype:
        return f"tensor {name!r} has dtype {dtype}, the model's is {meta.dtype} (cast it before sending)"
    if shape != tuple(meta.shape):
        return f"tensor {name!r} has shape {list(shape)}, the model's is {list(meta.shape)}"
    return ""


def _raise_problems(problems: list[str]) -> None:
    if problems:
        raise WeightsError(summarize_problems(problems))


def validate_tensors(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, TensorMeta],
    *,
    check_values: bool = True,
) -> int:
    """Raise ``WeightsError`` naming every bad tensor; return the update's size in bytes.

    ``check_values``: also refuse NaN/inf, which would load fine and then make every log-prob
    NaN (one ``isfinite`` pass per floating tensor; off for tensors already checked)."""
    if not tensors:
        raise WeightsError("the update carries no tensors")
    problems = []
    for name, t in tensors.items():
        problem = _check(name, _dtype_name(t.dtype), tuple(t.shape), metadata.get(name), metadata)
        if problem:
            problems.append(problem)
    _raise_problems(problems)
    if check_values:
        _raise_problems([p for name, t in tensors.items() if (p := non_finite_tensor(name, t))])
    return sum(t.numel() * t.element_size() for t in tensors.values())


def validate_nccl_announce(
    request: NcclUpdateRequest, metadata: Mapping[str, TensorMeta], itemsize: Mapping[str, int]
) -> int:
    """Check an NCCL announce (names, dtypes, shapes, bucket layout; an adapter's as
    ``validate_adapter`` does, its values once received); return its bytes."""
    specs = request.tensors
    if not specs:
        raise WeightsError("the update carries no tensors")
    if request.adapter is not None:
        shapes = {s.name: (s.dtype, tuple(s.shape)) for s in specs}
        if len(shapes) != len(specs):
            raise WeightsError("the adapter update announces a tensor twice")
        validate_adapter_shapes(shapes, request.adapter, metadata)
        problems = []
    else:
        problems = [
            p
            for s in specs
            if (p := _check(s.name, s.dtype, tuple(s.shape), metadata.get(s.name), metadata))
        ]
    if len(request.bucket_dtypes) != len(request.buckets):
        problems.append(
            f"bucket_dtypes has {len(request.bucket_dtypes)} entries for {len(request.buckets)} buckets"
        )
    placed = sorted(i for bucket in request.buckets for i in bucket)
    if placed != list(range(len(specs))):
        problems.append("buckets must list every tensor index exactly once")
    for b, (bucket, dtype) in enumerate(zip(request.buckets, request.bucket_dtypes, strict=False)):
        for i in bucket:
            if 0 <= i < len(specs) and specs[i].dtype != dtype:
                problems.append(
                    f"tensor {specs[i].name!r} ({specs[i].dtype}) is in bucket {b} of {dtype}"
                )
    _raise_problems(problems)
    total = 0
    for s in specs:
        numel = 1
        for d in s.shape:
            numel *= d
        total += numel * itemsize.get(s.dtype, 0)
    return total


def validate_ipc_announce(
    request: IpcUpdateRequest, metadata: Mapping[str, TensorMeta], itemsize: Mapping[str, int]
) -> int:
    """An NCCL-style announce whose buckets are IPC handles: one handle per bucket, each of
    the bucket's dtype and exact element count."""
    total = validate_nccl_announce(request, metadata, itemsize)
    problems = []
    if len(request.handles) != len(request.buckets):
        problems.append(f"{len(request.handles)} IPC handles for {len(request.buckets)} buckets")
    for b, (bucket, dtype, h) in enumerate(
        zip(request.buckets, request.bucket_dtypes, request.handles, strict=False)
    ):
        numel = 0
        for i in bucket:
            n = 1
            for d in request.tensors[i].shape:  # indices were checked above
                n *= d
            numel += n
        if h.dtype != dtype or h.numel != numel:
            problems.append(
                f"handle {b} is {h.numel} x {h.dtype}; bucket {b} needs {numel} x {dtype}"
            )
    _raise_problems(problems)
    return total


PEFT_PREFIX = "base_model.model."
# PEFT options the servers cannot serve (vLLM's LoRA has none of them): value when off
_UNSERVABLE = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
               "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False, "fan_in_fan_out": False}  # fmt: skip


def adapter_module(name: str) -> tuple[str, str] | None:
    """(base module, "lora_A" or "lora_B") of a PEFT adapter tensor name, or None."""
    if not name.startswith(PEFT_PREFIX):
        return None
    for part in ("lora_A", "lora_B"):
        if name.endswith(f".{part}.weight"):
            return name[len(PEFT_PREFIX) : -len(f".{part}.weight")], part
    return None


def is_targeted(module: str, targets: list[str]) -> bool:
    """PEFT's match: a target is the full module name or its trailing components."""
    return any(module == t or module.endswith(f".{t}") for t in targets)


def _adapter_problem(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    spec: LoraAdapterSpec,
    md: Mapping[str, TensorMeta],
) -> str:
    where = adapter_module(name)
    if where is None:
        return (
            f"tensor {name!r} is not a LoRA adapter tensor: an adapter update carries "
            f"'{PEFT_PREFIX}<module>.lora_A.weight' and '.lora_B.weight' only"
        )
    module, part = where
    base = md.get(f"{module}.weight")
    if base is None or len(base.shape) != 2:
        return f"tensor {name!r} adapts {module!r}, which is no linear module of the model"
    if not is_targeted(module, spec.target_modules):
        return f"tensor {name!r} adapts {module!r}, which target_modules does not name"
    out_f, in_f = base.shape
    want = (spec.r, in_f) if part == "lora_A" else (out_f, spec.r)
    if shape != want:
        return f"tensor {name!r} has shape {list(shape)}; rank {spec.r} on {module!r} needs {list(want)}"
    if dtype != base.dtype:
        return f"tensor {name!r} has dtype {dtype}, the model's is {base.dtype} (cast it before sending)"
    return ""


def validate_adapter_tensors(
    tensors: Mapping[str, torch.Tensor], spec: LoraAdapterSpec, metadata: Mapping[str, TensorMeta]
) -> None:
    """Each tensor (a bucket's) is a lora_A/lora_B of a targeted linear module, of the rank's
    shape and the model's dtype; ``WeightsError`` naming every bad one."""
    _raise_adapter_problems(_shapes(tensors), spec, metadata)


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (_dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}


def _raise_adapter_problems(
    shapes: Mapping[str, tuple[str, tuple[int, ...]]],
    spec: LoraAdapterSpec,
    metadata: Mapping[str, TensorMeta],
) -> None:
    _raise_problems(
        [
            p
            for name, (dtype, shape) in shapes.items()
            if (p := _adapter_problem(name, dtype, shape, spec, metadata))
        ]
    )


def validate_adapter(
    tensors: Mapping[str, torch.Tensor],
    spec: LoraAdapterSpec,
    metadata: Mapping[str, TensorMeta],
    *,
    check_values: bool = True,
) -> int:
    """A whole adapter update: options the servers can serve, every tensor valid, both halves
    of every targeted linear module there; returns its bytes."""
    if not tensors:
        raise WeightsError("the update carries no tensors")
    validate_adapter_shapes(_shapes(tensors), spec, metadata)
    if check_values:
        _raise_problems([p for name, t in tensors.items() if (p := non_finite_tensor(name, t))])
    return sum(t.numel() * t.element_size() for t in tensors.values())


def validate_adapter_shapes(
    shapes: Mapping[str, tuple[str, tuple[int, ...]]],
    spec: LoraAdapterSpec,
    metadata: Mapping[str, TensorMeta],
) -> None:
    """An adapter update by its tensors' (dtype, shape): options the servers can serve, every
    tensor a lora_A/lora_B of the rank's shape, both halves of every targeted module there."""
    cfg = spec.peft_config
    off = [k for k, v in _UNSERVABLE.items() if cfg.get(k, v) not in (v, None, {}, False)]
    if off:
        raise WeightsError(f"the adapter's PEFT config sets {off}, which the server cannot serve")
    _raise_adapter_problems(shapes, spec, metadata)
    wanted = {
        name[: -len(".weight")]
        for name, meta in metadata.items()
        if name.endswith(".weight")
        and len(meta.shape) == 2
        and meta.tied_to is None
        and is_targeted(name[: -len(".weight")], spec.target_modules)
    }
    missing = [
        f"{PEFT_PREFIX}{m}.{part}.weight"
        for m in sorted(wanted)
        for part in ("lora_A", "lora_B")
        if f"{PEFT_PREFIX}{m}.{part}.weight" not in shapes
    ]
    _raise_problems([f"the adapter lacks tensor {n!r}" for n in missing])
