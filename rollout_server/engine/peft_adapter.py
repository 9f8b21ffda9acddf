"""The LoRA adapter the transformers engine serves, through PEFT.

The base model is wrapped in PEFT on the first adapter update (its targeted linear modules become
PEFT ``LoraLayer``s in place, so the engine keeps decoding with the same model object). Each
update is loaded as a new named adapter (``v<version>``) next to the one serving; the engine
switches to it only once all of it loaded, then deletes the old one, so a failed load leaves the
previous adapter serving. A full weight update serves the base weights alone again (the adapter
layers are disabled).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rollout_server.engine.base import WeightsError

if TYPE_CHECKING:
    from rollout_server.protocol import LoraAdapterSpec


class ServedAdapter:
    """Owns the PEFT wrapping of one model: which adapter serves, and its tensors (a CPU copy,
    small, kept to restore the adapter after its memory was freed by a level-2 sleep)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.peft: Any = None  # the PeftModel around ``model`` once an adapter was loaded
        self.name: str | None = None  # the adapter serving, None: the base weights alone
        self.spec: LoraAdapterSpec | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._paths: dict[str, str] = {}  # base checkpoint name -> parameter path once wrapped

    @property
    def rank(self) -> int | None:
        return self.spec.r if self.name is not None and self.spec is not None else None

    def param_path(self, name: str) -> str:
        """Where the checkpoint's tensor ``name`` lives in the (maybe wrapped) model."""
        return self._paths.get(name, name)

    def load(self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load ``tensors`` (PEFT names, validated) as adapter ``v<version>`` and serve it."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config = LoraConfig(
            r=spec.r,
            lora_alpha=spec.lora_alpha,
            target_modules=list(spec.target_modules),
            lora_dropout=0.0,
            inference_mode=True,
        )
        name = f"v{version}"
        if self.peft is None:
            self.peft = get_peft_model(self.model, config, adapter_name=name)
            self._paths = {
                n.replace(".base_layer.", "."): n
                for n, _ in self.model.named_parameters()
                if ".base_layer." in n
            }
        else:
            self.peft.add_adapter(name, config)
        try:
            result = set_peft_model_state_dict(self.peft, tensors, adapter_name=name)
            if result.unexpected_keys:
                raise WeightsError(f"the adapter's tensors {result.unexpected_keys} fit no module")
        except BaseException:
            self._discard(name)
            raise
        self.peft.base_model.set_adapter(name)
        self.peft.base_model.enable_adapter_layers()
        if self.name is not None and self.name != name:
            self.peft.delete_adapter(self.name)
        self.model.eval().requires_grad_(False)
        self.name, self.spec = name, spec
        self.tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}

    def _discard(self, name: str) -> None:
        """Drop a half-loaded adapter: the one serving before (or the base alone) serves on."""
        if self.name is not None:
            self.peft.delete_adapter(name)
            self.peft.base_model.set_adapter(self.name)
        else:
            self.peft.base_model.disable_adapter_layers()

    def drop(self) -> None:
        """Serve the base weights alone (a full weight update loaded)."""
        if self.peft is not None and self.name is not None:
            self.peft.base_model.disable_adapter_layers()
        self.name, self.spec, self.tensors = None, None, {}

    def restore(self) -> None:
        """Copy the kept adapter tensors back (after a level-2 sleep zero-filled them)."""
        if self.name is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.peft, self.tensors, adapter_name=self.name)

    def effective_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the model serves with, under the base checkpoint's names: each adapted
        weight with the serving adapter's delta added (``W + scale * B @ A``), as the learner
        merges it; the base weights alone without an adapter."""
        layers = self._lora_layers()
        for name, p in self.model.named_parameters():
            if ".lora_" in name:
                continue
            if ".base_layer." not in name:
                yield name, p.detach()
                continue
            owner, leaf = name.split(".base_layer.")
            t = p.detach()
            layer = layers.get(owner)
            if leaf == "weight" and self.name is not None and layer is not None:
                t = t + layer.get_delta_weight(self.name).to(t.dtype)
            yield f"{owner}.{leaf}", t

    def _lora_layers(self) -> dict[str, Any]:
        if self.peft is None:
            return {}
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in self.model.named_modules() if isinstance(m, LoraLayer)}
