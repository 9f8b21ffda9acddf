"""Multi-bucket HTTP updates, staged on CPU bucket by bucket (each validated on arrival) and
applied only at commit.

One update is open at a time: a new ``begin`` supersedes an older one, so a learner that crashed
mid-update cannot wedge the server.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_server.engine.base import TensorMeta, WeightsError
from rollout_server.errors import Conflict, NotFound
from rollout_server.weights.validation import validate_adapter_tensors, validate_tensors

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import LoraAdapterSpec

log = logging.getLogger(__name__)


@dataclass
class StagedUpdate:
    update_id: str
    version: int | None
    adapter: LoraAdapterSpec | None = None  # the buckets hold a LoRA adapter
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

    def begin(self, version: int | None, adapter: LoraAdapterSpec | None = None) -> str:
        if self._open is not None:
            log.warning("weight update %s superseded by a new one", self._open.update_id)
        self._open = StagedUpdate(uuid.uuid4().hex, version, adapter)
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
        if update.adapter is not None:
            validate_adapter_tensors(tensors, update.adapter, metadata)
        else:
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
        missing = _first_missing(update.buckets.keys(), num_buckets)
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


def _first_missing(staged: Collection[int], num_buckets: int) -> list[int]:
    """Up to 11 of the indices below ``num_buckets`` not staged (enough for ``_short``). The
    scan stops there, so its cost follows the buckets staged, never the count a client named."""
    missing: list[int] = []
    for i in range(num_buckets):
        if i not in staged:
            missing.append(i)
            if len(missing) > 10:
                break
    return missing


def _short(indices: list[int]) -> str:
    return "[" + ", ".join(map(str, indices[:10])) + (" ..." if len(indices) > 10 else "") + "]"
