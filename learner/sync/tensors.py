"""What every transport sends: the policy's weights under their checkpoint names, full (ZeRO-3
gathered bucket by bucket) or with the LoRA deltas merged in, their specs, and the device and
dtype they go out in.

Only the main process sends, but under ZeRO-3 every rank takes part in the parameter gathers:
the other ranks run the same gathers (``follow``) and drop the tensors, so the whole model is
never gathered at once on any rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from learner.sync.zero3 import is_partitioned, iter_gathered_params, param_specs

if TYPE_CHECKING:
    from rollout_server.protocol import LoraAdapterSpec


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


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _unpartitioned_base(model: nn.Module) -> nn.Module:
    base = model.get_base_model()  # type: ignore[operator]
    if any(is_partitioned(p) for p in base.parameters()):
        raise ValueError("LoRA weight sync under ZeRO-3 is not supported: use ZeRO-2 with LoRA")
    return base


def _lora_entries(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Any]]:
    """(base checkpoint name, base parameter, its LoRA layer or None) for every weight the
    servers need: the adapters themselves are skipped, they are merged into their base weight."""
    from peft.tuners.lora import LoraLayer

    base = _unpartitioned_base(model)
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
    return merged_lora_weights(model) if is_peft(model) else iter_gathered_params(model)


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """The active adapter's lora_A/lora_B tensors under PEFT's names (what
    ``get_peft_model_state_dict`` saves: ``base_model.model.<module>.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    _unpartitioned_base(model)
    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    return ((n, t.detach()) for n, t in state.items())


def adapter_spec(model: nn.Module) -> LoraAdapterSpec:
    """What the servers need to serve the active adapter: rank, alpha, the adapted modules
    (PEFT's resolved names) and the whole PEFT config as JSON."""
    from rollout_server.protocol import LoraAdapterSpec

    config = model.peft_config[model.active_adapter]  # type: ignore[index]
    as_json = json.loads(
        json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    )
    targets = config.target_modules
    return LoraAdapterSpec(
        r=config.r,
        lora_alpha=config.lora_alpha,
        target_modules=[targets] if isinstance(targets, str) else sorted(targets),
        peft_config=as_json,
    )


def sync_payload(model: nn.Module, lora: str) -> tuple[Iterator[tuple[str, Any]], Any]:
    """(tensors, adapter spec or None) of one sync: with ``lora = "adapter"`` the adapter
    alone, else ``sync_tensors``."""
    if lora != "adapter":
        return sync_tensors(model), None
    if not is_peft(model):
        raise ValueError('rollout.sync.lora = "adapter" needs a LoRA model (model.lora)')
    return adapter_tensors(model), adapter_spec(model)


def announced_payload(model: nn.Module, lora: str, dtype: str) -> tuple[list[Any], Any, Any]:
    """(specs in the servers' ``dtype``, tensors, adapter spec or None) of one NCCL or CUDA
    IPC push: with ``lora = "adapter"`` the active adapter alone (MBs, held as a list), served
    on the servers' base weights; else ``sync_specs`` and ``sync_tensors`` (shapes only until
    the tensors are consumed)."""
    from rollout_server.protocol import TensorSpec

    tensors, adapter = sync_payload(model, lora)
    if adapter is None:
        return sync_specs(model, dtype), tensors, None
    held = list(tensors)
    specs = [TensorSpec(name=n, dtype=dtype, shape=list(t.shape)) for n, t in held]
    return specs, held, adapter


def sync_specs(model: nn.Module, dtype: str | None) -> list[Any]:
    if not is_peft(model):
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


def follow(model: nn.Module) -> None:
    """Non-main ranks: run the same ZeRO-3 gathers as the main process (no-op otherwise)."""
    if not is_peft(model):
        for _ in iter_gathered_params(model):
            pass


def in_dtype(tensors: Iterable[tuple[str, Any]], dtype_name: str) -> Iterable[tuple[str, Any]]:
    """The floating-point tensors cast to ``dtype_name`` (the servers' dtype), one at a time as
    they are consumed: a learner in bf16 under DeepSpeed, a server in float32, and the server
    refuses other dtypes. An unknown name leaves them as they are."""
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return tensors
    return (
        (n, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t) for n, t in tensors
    )
