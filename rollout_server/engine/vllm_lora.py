"""The LoRA adapter the vllm engine serves, through vLLM's LoRA support.

vLLM loads adapters from disk (``adapter_config.json`` and ``adapter_model.safetensors``, PEFT's
layout) by ``LoRARequest``. Each update is written to a directory of its own (by this process for
tensors sent over HTTP or in a file; by the first GPU worker for an adapter received over NCCL or
CUDA IPC, ``WorkerLoader.save_adapter``) and loaded into the engine (``add_lora``) before
generation switches to it, so a refused or failed load leaves the previous adapter serving;
generation then passes the served ``LoRARequest`` with every request. The engine must start
with ``enable_lora`` (``--enable-lora``) and a ``max_lora_rank`` at least the adapters' rank;
two adapter slots let the new one load while the old one serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_server.engine.base import UnsupportedError, WeightsError

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import LoraAdapterSpec
    from rollout_server.settings import ServerSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
ADAPTER_FILE = "adapter_model.safetensors"


def lora_engine_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """vLLM engine arguments for serving adapter updates (none without ``enable_lora``)."""
    if not settings.enable_lora:
        return {}
    return {"enable_lora": True, "max_lora_rank": settings.max_lora_rank, "max_loras": 2}


def adapter_config(spec: LoraAdapterSpec) -> dict[str, Any]:
    """``adapter_config.json``: the PEFT config sent, with the spec's rank and alpha, and its
    targets as the modules' last components (``q_proj``), the form vLLM matches against its
    model's LoRA modules; the server checked that the adapter covers every module targeted."""
    config = {k: v for k, v in spec.peft_config.items() if k != "base_model_name_or_path"}
    config.update(
        peft_type="LORA",
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        target_modules=sorted({t.rsplit(".", 1)[-1] for t in spec.target_modules}),
        bias="none",
    )
    return config


class VllmAdapters:
    """Which adapter the engine serves: its ``LoRARequest`` (None: the base weights alone) and
    the versioned directories vLLM loads adapters from."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.request: Any = None  # the LoRARequest generation passes, None: no adapter
        self.spec: LoraAdapterSpec | None = None
        self._root: Path | None = None
        self._next_id = 1  # vLLM's adapter ids: positive, never reused
        self._dirs = itertools.count(1)  # one directory per update, never reused

    @property
    def rank(self) -> int | None:
        return self.spec.r if self.request is not None and self.spec is not None else None

    def check(self, spec: LoraAdapterSpec) -> None:
        """Refuse before the pause what this engine cannot serve."""
        if not self.settings.enable_lora:
            raise UnsupportedError(
                "the vllm engine serves LoRA adapters only when started with --enable-lora "
                "(and --max-lora-rank at least the adapters' rank)"
            )
        if spec.r > self.settings.max_lora_rank:
            raise WeightsError(
                f"the adapter's rank {spec.r} exceeds the server's --max-lora-rank "
                f"{self.settings.max_lora_rank}; restart it with a larger one"
            )

    def directory(self, spec: LoraAdapterSpec) -> Path:
        """A new directory for one update, holding its ``adapter_config.json``; the tensors go
        beside it as ``ADAPTER_FILE``."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="grpo-lora-"))
        path = self._root / f"update-{next(self._dirs)}"
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text(json.dumps(adapter_config(spec)))
        return path

    def write(self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor]) -> Path:
        """The adapter in PEFT's layout, in a directory of its own."""
        from safetensors.torch import save_file

        path = self.directory(spec)
        save_file({k: t.contiguous() for k, t in tensors.items()}, path / ADAPTER_FILE)
        return path

    async def load(
        self, llm: Any, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        """Write, load into the engine, then switch: requests from now on use it; the old
        adapter is removed from the engine and the disk."""
        self.check(spec)
        path = await asyncio.to_thread(self.write, spec, tensors)
        await self._switch(llm, spec, path, f"v{version}")

    async def receive(
        self, llm: Any, spec: LoraAdapterSpec, receive: Callable[[Path], Awaitable[T]]
    ) -> T:
        """An adapter the GPU workers receive (NCCL, CUDA IPC): ``receive(path)`` has them
        write its tensors into a new directory, then it is loaded and switched to as ``load``
        does. Returns what ``receive`` returned."""
        self.check(spec)
        path = await asyncio.to_thread(self.directory, spec)
        try:
            received = await receive(path)
            if not (path / ADAPTER_FILE).is_file():
                raise WeightsError(f"the workers wrote no adapter tensors into {path}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        await self._switch(llm, spec, path, path.name)
        return received

    async def _switch(self, llm: Any, spec: LoraAdapterSpec, path: Path, name: str) -> None:
        """Load the adapter at ``path`` into the engine, then serve it (its directory is
        removed if vLLM refuses it)."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, self._next_id, str(path))
        self._next_id += 1
        try:
            if not await llm.add_lora(request):
                raise WeightsError(f"vLLM did not load the adapter {name}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, self.request, self.spec = self.request, request, spec
        await self._forget(llm, old)

    async def reload(self, llm: Any) -> None:
        """After a level-2 sleep discarded the engine's memory: the served adapter again from
        its directory, under a fresh id (vLLM's cached one would point at freed memory)."""
        from vllm.lora.request import LoRARequest

        if self.request is None:
            return
        old = self.request
        self.request = LoRARequest(old.lora_name, self._next_id, old.lora_path)
        self._next_id += 1
        with contextlib.suppress(Exception):
            await llm.remove_lora(old.lora_int_id)
        await llm.add_lora(self.request)

    async def drop(self, llm: Any) -> None:
        """Serve the base weights alone (a full weight update loaded)."""
        old, self.request, self.spec = self.request, None, None
        await self._forget(llm, old)

    async def _forget(self, llm: Any, old: Any) -> None:
        if old is None:
            return
        try:
            await llm.remove_lora(old.lora_int_id)
        except Exception as exc:  # a leftover slot costs memory, never correctness
            log.warning("could not remove LoRA adapter %s from vLLM: %s", old.lora_name, exc)
        shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
