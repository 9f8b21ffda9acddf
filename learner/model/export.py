"""The model a run leaves behind (``RUN_DIR/final``, ``RUN_DIR/sft/final``): a plain Hugging
Face model directory that ``from_pretrained``, vLLM, the rollout server and ``python -m learner
eval --model`` load as any base model.

- Under DeepSpeed ZeRO-3 every parameter is gathered first, a bucket at a time (each rank holds
  only a shard: ``save_pretrained`` on the engine's module would write empty tensors).
- With (Q)LoRA the adapters are merged into the weights (QLoRA's 4-bit base dequantized to the
  compute dtype), and the adapter alone is written too, under ``adapter/`` (PEFT's format).
- It is written under a temporary name, fsynced and renamed: a complete directory appears at
  once, or none, and a rerun replaces it.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from learner.model.policy import is_peft
from learner.run.checkpoint import fsync_path, fsync_tree
from rollout_server.tiny import portable_tokenizer_class

ADAPTER_SUBDIR = "adapter"


def save_model(accelerator: Accelerator, policy: nn.Module, tokenizer: Any, path: Path) -> None:
    """Write the policy's model (see the module docstring) and the tokenizer to ``path``. Every
    rank must call it: under ZeRO-3 the gathers are collective."""
    from learner.sync.zero3 import is_partitioned, iter_gathered_params

    model = accelerator.unwrap_model(policy).model
    tmp = path.with_name(f".tmp-{path.name}")
    main = accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    if any(is_partitioned(p) for p in model.parameters()):
        if is_peft(model):
            raise ValueError("saving a LoRA model under ZeRO-3 is not supported: use ZeRO-2")
        state = {}
        with torch.no_grad():
            for name, t in iter_gathered_params(model):  # every rank gathers; main keeps
                if main:
                    state[name] = t.cpu()
        if main:
            model.save_pretrained(tmp, state_dict=state)
    elif main:
        if is_peft(model):
            model.save_pretrained(tmp / ADAPTER_SUBDIR)  # the adapter alone, before merging
        if is_peft(model) and getattr(model.config, "quantization_config", None) is not None:
            _save_dense(model, tmp)  # QLoRA: a plain model, not a re-quantized one
        else:
            if is_peft(model):
                model = model.merge_and_unload()  # the run is over: merging in place is fine
            model.save_pretrained(tmp)
    if main:
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_class(tmp / "tokenizer_config.json")
        fsync_tree(tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        fsync_path(path.parent)
    accelerator.wait_for_everyone()


def _save_dense(model: nn.Module, path: Path) -> None:
    """QLoRA: the 4-bit base dequantized with the adapters merged (what the rollout servers
    get), written as a plain checkpoint in the compute dtype, without the quantization config:
    GRPO, vLLM and the transformers engine load it as any base model."""
    from safetensors.torch import save_file

    from learner.sync.tensors import merged_lora_weights

    config = copy.deepcopy(model.get_base_model().config)
    del config.quantization_config
    state = {n: t.detach().contiguous().cpu() for n, t in merged_lora_weights(model)}
    config.dtype = next(iter(state.values())).dtype
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
