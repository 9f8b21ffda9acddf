"""Weight updates before they touch the model: parse safetensors, validate, stage buckets.

An update is validated whole — every name known, every dtype and shape exactly the model's —
before anything is copied, so a bad update is refused while the old weights keep serving.
Dtypes must match exactly (no silent casts): the sender knows the model's dtype from
``/info`` and casting there is cheap; casting here would hide a mixed-up checkpoint.

Multi-bucket HTTP updates are staged on CPU bucket by bucket (each validated on arrival) and
applied only at commit. One update is open at a time: a new ``begin`` supersedes an older one,
so a learner that crashed mid-update cannot wedge the server.
"""

from __future__ import annotations

import difflib
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_server.engine.base import TensorMeta, WeightsError
from rollout_server.errors import Conflict, NotFound

if TYPE_CHECKING:
    import torch

    from rollout_server.nccl_wire import Bucket
    from rollout_server.protocol import IpcUpdateRequest, NcclUpdateRequest

log = logging.getLogger(__name__)
_MAX_LISTED = 5


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


def read_safetensors_path(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file, or of every .safetensors file in a directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.exists():
        raise WeightsError(f"cannot read {path}: no such file or directory on the server")
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise WeightsError(f"no .safetensors files in the directory {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
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
        more = len(problems) - _MAX_LISTED
        suffix = f"; and {more} more problems" if more > 0 else ""
        raise WeightsError("; ".join(problems[:_MAX_LISTED]) + suffix)


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
        _raise_problems([p for name, t in tensors.items() if (p := _non_finite(name, t))])
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _non_finite(name: str, t: torch.Tensor) -> str:
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
        if flat.element_size() == 1:  # float8: see _non_finite
            flat = flat.to(torch.float16)
        sums.append(torch.sum(flat.to(device, non_blocking=True), dtype=torch.float32))
    if not sums or bool(torch.stack(sums).isfinite().all()):
        return ""
    problems = [p for f, b in pairs for name, t in unflatten(f, b) if (p := _non_finite(name, t))]
    if not problems:
        return ""  # a float32 overflow of finite values
    more = len(problems) - _MAX_LISTED
    return "; ".join(problems[:_MAX_LISTED]) + (f"; and {more} more problems" if more > 0 else "")


def validate_nccl_announce(
    request: NcclUpdateRequest, metadata: Mapping[str, TensorMeta], itemsize: Mapping[str, int]
) -> int:
    """Check an NCCL announce (names, dtypes, shapes, bucket layout); return its bytes."""
    specs = request.tensors
    if not specs:
        raise WeightsError("the update carries no tensors")
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


@dataclass
class StagedUpdate:
    update_id: str
    version: int | None
    buckets: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)  # tensor name -> bucket index

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t for bucket in self.buckets.values() for name, t in bucket.items()}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class WeightStager:
    """Holds the one open multi-bucket update until it is committed or aborted.

    The bucket count is only known at commit (the learner streams buckets out of a ZeRO-3
    gather). Re-sending a bucket index replaces it, so a client may retry an upload whose
    answer was lost."""

    def __init__(self) -> None:
        self._open: StagedUpdate | None = None

    def begin(self, version: int | None) -> str:
        if self._open is not None:
            log.warning("weight update %s superseded by a new one", self._open.update_id)
        self._open = StagedUpdate(uuid.uuid4().hex, version)
        return self._open.update_id

    def get(self, update_id: str) -> StagedUpdate:
        if self._open is None or self._open.update_id != update_id:
            raise NotFound(
                f"no open weight update {update_id!r} (it was committed, aborted, or superseded "
                f"by a newer POST /weights/begin); start again with /weights/begin"
            )
        return self._open

    def add_bucket(
        self,
        update_id: str,
        index: int,
        tensors: dict[str, torch.Tensor],
        metadata: Mapping[str, TensorMeta],
    ) -> None:
        update = self.get(update_id)
        validate_tensors(tensors, metadata)
        for name in tensors:
            if update.owner.get(name, index) != index:
                raise WeightsError(
                    f"tensor {name!r} was already sent in bucket {update.owner[name]}"
                )
        for name in update.buckets.pop(index, {}):  # a re-sent bucket replaces the old one
            del update.owner[name]
        update.buckets[index] = tensors
        update.owner.update(dict.fromkeys(tensors, index))

    def take_complete(self, update_id: str, num_buckets: int) -> StagedUpdate:
        """Close the update for commit; buckets 0..num_buckets-1, and only those, must be in."""
        update = self.get(update_id)
        missing = sorted(set(range(num_buckets)) - update.buckets.keys())
        extra = sorted(i for i in update.buckets if i >= num_buckets)
        if missing or extra:
            problem = (
                f"is missing buckets {_short(missing)}"
                if missing
                else f"holds buckets {_short(extra)} beyond num_buckets"
            )
            raise Conflict(
                f"update {update_id} {problem} (commit says num_buckets={num_buckets}); "
                f"send the missing buckets or fix num_buckets, then commit again"
            )
        self._open = None
        return update

    def abort(self, update_id: str) -> None:
        self.get(update_id)
        self._open = None


def _short(indices: list[int]) -> str:
    return "[" + ", ".join(map(str, indices[:10])) + (" ..." if len(indices) > 10 else "") + "]"
