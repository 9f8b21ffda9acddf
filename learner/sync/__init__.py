"""Weight sync from the learner to the rollout servers: one protocol, four transports.

- ``http``: safetensors buckets in request bodies (CPU, tests, no NCCL);
- ``file``: one safetensors file on a shared disk, loaded by every server;
- ``nccl``: flat buckets broadcast from learner rank 0 to the servers' workers
  (``learner.sync.nccl``, GPU only);
- ``ipc``: flat buckets shared as CUDA IPC handles with servers on the learner's own GPU
  (``learner.sync.ipc``, colocated mode).

Every transport is atomic on the server side: the version moves only once every tensor loaded.
Only the main process talks to the servers. Under ZeRO-3 every rank takes part in the parameter
gathers (bucket by bucket, ``learner.sync.zero3``): the other ranks run the same gathers and
drop the tensors, so the whole model is never gathered at once on any rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from learner.sync.zero3 import is_partitioned, iter_gathered_params, param_specs

if TYPE_CHECKING:
    from learner.config import RolloutConfig
    from rollout_server.client import RolloutClient
    from rollout_server.protocol import WeightUpdateResponse


def learner_cuda_device(device: Any, sync: str, needs: str) -> Any:
    """The CUDA device a GPU-only transport sends from (an int is a CUDA index), or a
    ``RuntimeError`` saying what ``rollout.sync = sync`` needs and what to use instead."""
    import torch

    dev = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            f'rollout.sync = "{sync}" needs {needs} (the learner is on {dev}); without one '
            'use sync = "http" or "file"'
        )
    return dev


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_entries(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Any]]:
    """(base checkpoint name, base parameter, its LoRA layer or None) for every weight the
    servers need: the adapters themselves are skipped, they are merged into their base weight."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]
    if any(is_partitioned(p) for p in base.parameters()):
        raise ValueError("LoRA weight sync under ZeRO-3 is not supported: use ZeRO-2 with LoRA")
    layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, p, None
            continue
        owner, leaf = name.split(".base_layer.")
        yield f"{owner}.{leaf}", p, layers[owner] if leaf == "weight" else None


def _dense(p: nn.Parameter) -> Any:
    """The weight as a dense tensor: QLoRA's 4-bit base weights are dequantized."""
    if getattr(p, "quant_state", None) is None:
        return p.detach()
    from peft.utils.integrations import dequantize_bnb_weight

    return dequantize_bnb_weight(p, state=p.quant_state)


def merged_lora_weights(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """The base model's weights with the LoRA deltas merged in, module by module, under the
    base checkpoint's names (QLoRA's 4-bit weights dequantized first). The model is never
    modified (no merge/unmerge rounding drift): each merged weight is ``W + scale * B @ A``
    computed for that module alone, then sent."""
    import torch

    for name, p, layer in _lora_entries(model):
        with torch.no_grad():  # not around the yield: grad mode would leak to the consumer
            t = _dense(p)
            if layer is not None:
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        t = t + layer.get_delta_weight(adapter).to(t.dtype)
        yield name, t


def sync_tensors(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, full tensor) for every weight the servers need, in a stable order."""
    return merged_lora_weights(model) if _is_peft(model) else iter_gathered_params(model)


def sync_specs(model: nn.Module, dtype: str | None) -> list[Any]:
    if not _is_peft(model):
        return param_specs(model, dtype=dtype)
    from rollout_server.protocol import TensorSpec

    specs = []
    for name, p, _ in _lora_entries(model):  # shapes only: nothing is merged or dequantized
        q = getattr(p, "quant_state", None)
        shape, own = (p.shape, p.dtype) if q is None else (q.shape, q.dtype)
        specs.append(
            TensorSpec(name=name, dtype=dtype or str(own).removeprefix("torch."), shape=list(shape))
        )
    return specs


# One name, not one per process: a learner killed mid-write (a sync of a large model takes
# seconds of every step) leaves at most this file, which the next push overwrites; per-process
# names left one full copy of the weights on the shared disk per crash.
FILE_SYNC_TMP = ".weights.safetensors.tmp"


class WeightSyncer:
    """Pushes the policy's weights to every server with the configured transport."""

    def __init__(self, cfg: RolloutConfig, client: RolloutClient, *, device: Any = None) -> None:
        self.cfg = cfg
        self.client = client
        self.device = device
        self._nccl: Any = None
        self._ipc: Any = None
        self._server_dtype: str | None = None

    async def _nccl_sender(self) -> Any:
        if self._nccl is None:
            from learner.servers.embedded import free_port
            from learner.sync.nccl import NcclWeightSender

            infos = await self.client.info()
            self._server_dtype = infos[0].dtype
            sender = NcclWeightSender()
            await sender.init(
                self.client,
                master_address=self.cfg.nccl_master_address,
                master_port=self.cfg.nccl_master_port or free_port(),
                device=self.device,
            )
            self._nccl = sender
        return self._nccl

    async def _ipc_sender(self) -> Any:
        if self._ipc is None:
            from learner.sync.ipc import IpcWeightSender

            self._ipc = IpcWeightSender(self.client, self.device)
            self._server_dtype = (await self.client.info())[0].dtype
        return self._ipc

    async def _cast_for_server(
        self, tensors: Iterator[tuple[str, Any]]
    ) -> Iterator[tuple[str, Any]]:
        """HTTP and file syncs: the tensors in the servers' dtype, cast one at a time (a learner
        in bf16 under DeepSpeed, a server in float32: the server refuses other dtypes)."""
        import torch

        if self._server_dtype is None:
            self._server_dtype = (await self.client.info())[0].dtype
        dtype = getattr(torch, self._server_dtype, None)
        if not isinstance(dtype, torch.dtype):
            return tensors
        return (
            (n, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
            for n, t in tensors
        )

    async def connect(self) -> None:
        """NCCL: form the weight-sync group now rather than at the first sync. A new group also
        ends whatever a previous run of this learner left prepared or committing on the servers
        (a crash after preparing), which would otherwise hold their generation paused until the
        group's timeout. File: delete what a learner killed mid-write left. Other transports
        have nothing to form."""
        if self.cfg.sync == "nccl":
            await self._nccl_sender()
        if self.cfg.sync == "file":
            assert self.cfg.sync_dir is not None  # the config validator guarantees it
            (Path(self.cfg.sync_dir) / FILE_SYNC_TMP).unlink(missing_ok=True)

    async def prepare(self, model: nn.Module) -> bool:
        """NCCL only: have the servers queue the next ``push``'s receives now (they hold
        generation paused until it). Call it while the learner trains and nothing is asked of
        the servers. Returns whether the next push is prepared."""
        if self.cfg.sync != "nccl":
            return False
        sender = await self._nccl_sender()
        return await sender.prepare(
            sync_specs(model, self._server_dtype), bucket_bytes=self.cfg.bucket_mb << 20
        )

    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        """Main process only. ``model`` is the HF model (under ZeRO-3: still partitioned);
        ``version``: the weight version the servers are to serve (default: theirs + 1)."""
        cfg = self.cfg
        bucket_bytes = cfg.bucket_mb << 20
        if cfg.sync == "http":
            return await self.client.update_weights(
                await self._cast_for_server(sync_tensors(model)),
                version=version,
                bucket_bytes=bucket_bytes,
            )
        if cfg.sync == "file":
            from safetensors.torch import save_file

            assert cfg.sync_dir is not None  # the config validator guarantees it
            sync_dir = Path(cfg.sync_dir)
            sync_dir.mkdir(parents=True, exist_ok=True)
            final = sync_dir / "weights.safetensors"
            tmp = sync_dir / FILE_SYNC_TMP
            cast = await self._cast_for_server(sync_tensors(model))
            tensors = {n: t.contiguous().cpu() for n, t in cast}
            save_file(tensors, str(tmp))
            tmp.replace(final)  # the server never sees a half-written file
            return await self.client.load_weights_file(str(final.resolve()), version)
        sender = await (self._ipc_sender() if cfg.sync == "ipc" else self._nccl_sender())
        return await sender.send(
            sync_specs(model, self._server_dtype),
            sync_tensors(model),
            bucket_bytes=bucket_bytes,
            version=version,
        )

    def follow(self, model: nn.Module) -> None:
        """Non-main ranks: run the same ZeRO-3 gathers as the main process (no-op otherwise)."""
        if not _is_peft(model):
            for _ in iter_gathered_params(model):
                pass

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None
