"""Loading a received weight update into a vLLM worker's model (``vllm_worker``).

``WorkerLoader`` owns the copy plans: the first update of a layout goes through vLLM's
``load_weights`` and verifies a copy plan against it (``rollout_server.engine.direct_load``);
later updates of that layout are copied straight into the parameters. Every transport loads
through it: NCCL (``nccl_receiver``), CUDA IPC buckets from a colocated learner, and a
safetensors file. The checks every received update passes before it is loaded live here too.

Import-safe without vLLM or a GPU: vLLM's objects are only reached through the worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

from rollout_server.nccl_wire import Bucket, bucket_layout, unflatten
from rollout_server.weight_digest import COMMON_PACKED, flat_checksum

log = logging.getLogger(__name__)

# vLLM's LoRA support (``--enable-lora``) wraps every layer an adapter may target: ``X.weight``
# becomes ``X.base_layer.weight``, a name no checkpoint (and no full update) carries.
_LORA_WRAPPER = re.compile(r"(^|\.)base_layer\.")


def checkpoint_name(name: str) -> str:
    """A parameter's name as a checkpoint spells it: without LoRA's ``base_layer`` segment."""
    return _LORA_WRAPPER.sub(r"\1", name)


def checkpoint_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters by their checkpoint names (``checkpoint_name``)."""
    return {checkpoint_name(n): p for n, p in model.named_parameters()}


def _checkpoint_named_parameters(
    self: torch.nn.Module, *args: Any, **kwargs: Any
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for name, p in type(self).named_parameters(self, *args, **kwargs):
        yield checkpoint_name(name), p


@contextlib.contextmanager
def checkpoint_names(model: torch.nn.Module) -> Iterator[None]:
    """While it is open, every module of ``model`` lists its parameters by checkpoint name.

    A model's own ``load_weights`` looks parameters up by the (fused) checkpoint names
    (``layers.0.mlp.gate_up_proj.weight``); on a LoRA-enabled server that lookup fails
    (``KeyError``) and no full update could load. The wrapped layer's ``base_layer`` parameter
    is the one the adapters add to, so loading into it is what a full update means. Only
    the instances are patched (nothing else in the process sees it), only for the load."""
    if not any(_LORA_WRAPPER.search(n) for n, _ in model.named_parameters()):
        yield
        return
    modules = list(model.modules())
    for module in modules:
        module.named_parameters = types.MethodType(_checkpoint_named_parameters, module)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            module.__dict__.pop("named_parameters", None)


def refuse_non_finite(
    flats: list[torch.Tensor], layout: list[Bucket], device: torch.device
) -> None:
    """Before anything is loaded (or, for copies overlapped with the wire, before they commit):
    NaN/inf would load fine and then make every log-prob NaN."""
    from rollout_server.engine.base import WeightsError
    from rollout_server.finite import NON_FINITE_REFUSED, non_finite_buckets

    problem = non_finite_buckets(flats, layout, device)
    if problem:
        raise WeightsError(f"{NON_FINITE_REFUSED}: {problem}")


def tensor_key(weights: list[tuple[str, torch.Tensor]]) -> tuple:
    """What a copy plan depends on: every tensor's name, shape and dtype, in order."""
    return tuple((n, tuple(t.shape), t.dtype) for n, t in weights)


class WorkerLoader:
    """Loads updates into ``worker``'s model (vLLM's GPU worker: ``model_runner``,
    ``vllm_config`` and ``device`` are its)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.plans: dict[Any, Any] | None = None  # layout key -> verified CopyPlan, or None

    def model(self) -> torch.nn.Module:
        runner = self.worker.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def device(self) -> torch.device:
        device = getattr(self.worker, "device", None)
        return device if device is not None else torch.device("cuda", torch.cuda.current_device())

    def verified_plan(self, key: tuple) -> Any:
        """The verified copy plan of the layout ``key`` (a ``tensor_key``), or None."""
        return (self.plans or {}).get(key)

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        model = self.model()
        with torch.no_grad(), checkpoint_names(model):
            model.load_weights(weights=weights)
        torch.cuda.synchronize()

    def load_update(
        self, weights: list[tuple[str, torch.Tensor]], direct: bool, key: tuple | None = None
    ) -> str:
        """Load one received update; returns how ("direct", "load_weights", or
        "load_weights+verify" for the first update of a layout). ``key``: ``tensor_key`` of
        ``weights``, when the caller has it."""
        from rollout_server.engine import direct_load

        if not direct:
            self.load(weights)
            return "load_weights"
        if self.plans is None or len(self.plans) > 64:  # many partial layouts
            self.plans = {}
        if key is None:
            key = tensor_key(weights)
        tensors = [t for _, t in weights]
        if key in self.plans:
            plan = self.plans[key]
            if plan is None:
                self.load(weights)
                return "load_weights"
            direct_load.copy_in(plan, tensors)
            torch.cuda.current_stream().synchronize()  # the forwards' stream, not the device
            return "direct"
        plan = self._copy_plan(key)
        if isinstance(plan, str):
            log.info("weight updates go through load_weights: %s", plan)
            self.plans[key] = None
            self.load(weights)
            return "load_weights"
        self.load(weights)
        problem = direct_load.verify(plan, tensors)
        if problem:
            log.warning("direct weight copies disagree with load_weights (%s); kept off", problem)
        else:
            log.info("direct weight copies verified for this layout (%d tensors)", len(key))
        self.plans[key] = None if problem else plan
        return "load_weights" if problem else "load_weights+verify"

    def _copy_plan(self, key: tuple) -> Any:
        """A copy plan for this layout, or why there is none (quantized or sharded models,
        updates of part of the model)."""
        from rollout_server.engine import direct_load

        config = self.worker.vllm_config
        if getattr(config.model_config, "quantization", None):
            return "the model is quantized"
        if int(config.parallel_config.tensor_parallel_size) > 1:
            return "tensor parallelism shards the parameters"
        model = self.model()
        hf = getattr(config.model_config, "hf_config", None)
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        return direct_load.plan_copies(
            checkpoint_parameters(model),
            [(n, s, d) for n, s, d in key],
            getattr(model, "packed_modules_mapping", None)
            or COMMON_PACKED,  # verify decides whether these fusions are right
            skip=frozenset({"lm_head.weight"}) if tied else frozenset(),
        )

    def load_ipc(
        self,
        tensors: list[dict[str, Any]],
        buckets: list[list[int]],
        bucket_dtypes: list[str],
        checksum: bool,
        handles: list[dict[str, Any]],
        gpu_uuid: str,
        direct: bool = True,
        adapter_dir: str | None = None,
    ) -> dict[str, Any]:
        """Open every bucket's IPC handle (all of them before loading anything), then load
        straight from the learner's memory (``adapter_dir``: write the LoRA adapter there). The
        learner keeps the buffers until we answer."""
        from rollout_server.cuda_ipc import local_device, open_handle
        from rollout_server.protocol import IpcHandle

        layout = bucket_layout(tensors, buckets, bucket_dtypes)
        index = local_device(gpu_uuid)
        device = self.device()
        if device.index is not None and device.index != index:
            log.warning("IPC buckets live on GPU %d, this worker runs on %s", index, device)
        start = time.perf_counter()
        flats = [open_handle(IpcHandle(**h), index) for h in handles]
        try:
            for flat, b in zip(flats, layout, strict=True):
                if flat.numel() != b.numel or flat.dtype != b.dtype:
                    raise ValueError(f"an IPC bucket is {flat.numel()} x {flat.dtype}, not {b}")
            total = (
                float(sum(flat_checksum(f, b) for b, f in enumerate(flats))) if checksum else None
            )
            refuse_non_finite(flats, layout, device)
            received_s = time.perf_counter() - start
            weights = [w for f, b in zip(flats, layout, strict=True) for w in unflatten(f, b)]
            # synchronizes: the learner may free its buffers after
            if adapter_dir is not None:
                loader = self.save_adapter(weights, adapter_dir)
            else:
                loader = self.load_update(weights, direct)
            del weights
        finally:
            del flats
        return {
            "checksum": total,
            "received_s": received_s,
            "loaded_s": time.perf_counter() - start - received_s,
            "staged_on": "learner's gpu (ipc)",
            "loader": loader,
        }

    def save_adapter(self, weights: list[tuple[str, torch.Tensor]], directory: str) -> str:
        """A LoRA adapter received whole (PEFT's names), written into ``directory`` for vLLM to
        load it from (``vllm_lora``; vLLM loads adapters from disk only). Every worker received
        the same bytes; the first one writes them (the engine's RPC returns once all have
        answered). Returns how it was "loaded"."""
        from safetensors.torch import save_file

        from rollout_server.engine.vllm_lora import ADAPTER_FILE

        if int(getattr(self.worker, "rank", 0)) == 0:
            tensors = {name: t.detach().to("cpu", copy=True) for name, t in weights}
            part = os.path.join(directory, f".{ADAPTER_FILE}.part")
            save_file(tensors, part)
            os.replace(part, os.path.join(directory, ADAPTER_FILE))  # whole, or not there
        return "adapter-file"

    def load_file(self, path: str) -> int:
        """Load every tensor of a safetensors file (read whole before loading: all or none)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            weights = [(n, f.get_tensor(n)) for n in names]
        self.load(weights)
        return len(weights)
