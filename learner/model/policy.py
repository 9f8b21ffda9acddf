"""The policy's forward for GRPO: per-token log-probs through a chunked LM head.

``PolicyLogprobs`` wraps a Hugging Face causal LM (optionally a PEFT LoRA model). Its ``forward``
runs the decoder to hidden states and then computes log-probs of the target tokens directly from
hidden states and the LM-head weight (``learner.loss.logprobs.token_logprobs``), only at loss
positions, chunk by chunk: the ``[tokens, vocab]`` logits never exist.

Why a wrapper module and not a function on the unwrapped model: under DeepSpeed ZeRO-3 the LM-head
weight is partitioned. It is registered as an *external parameter* of this module, so DeepSpeed
gathers it for this module's forward and reduce-scatters its gradient in backward; a loss called on
the unwrapped model would silently see an empty shard or skip the gradient all-reduce.

With LoRA, ``reference=True`` runs the same model with its adapters disabled: the KL reference
costs no second copy of the weights.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from learner.loss.fused import fused_grpo_loss
from learner.loss.logprobs import token_logprobs
from learner.loss.token import TokenLoss
from learner.model.routing import replay_routes


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class PolicyLogprobs(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        *,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        fused_chunk_size: int | None = None,
    ):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.fused_chunk_size = fused_chunk_size  # None: `learner.loss.fused.auto_chunk_size`
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
        if _is_zero3(head.weight):
            import deepspeed

            deepspeed.zero.register_external_parameter(self, head.weight)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T] padding mask, or [B, 1, T, T] bool (packed rows)
        loss_mask: torch.Tensor,  # [B, T-1]
        position_ids: torch.Tensor | None = None,  # [B, T], restarting per packed sequence
        with_entropy: bool = False,
        reference: bool = False,
        token_loss: TokenLoss | None = None,
        routes: torch.Tensor | None = None,  # [B, T, layers, k] experts to replay, -1: own
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of the targets at ``loss_mask``, flat ``[N]`` fp32 in
        row-major order of the mask. With ``token_loss`` (``grpo.fused_loss``): the fused head
        and loss instead, ``(loss, logp, entropy)`` (``learner.loss.fused``). With ``routes``
        a mixture-of-experts decoder routes as they say (``learner.model.routing``)."""
        if reference and not is_peft(self.model):
            raise ValueError("reference=True needs a PEFT model (adapters disabled = reference)")
        ctx = self.model.disable_adapter() if reference else contextlib.nullcontext()
        with ctx:
            decoder = self.model.get_decoder()
            with replay_routes(decoder, routes):
                hidden = decoder(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
                ).last_hidden_state
            hidden = hidden[:, :-1]  # [B, T-1, H]: position t predicts token t+1
            sel = loss_mask.bool()
            weight = self.model.get_output_embeddings().weight  # [V, H]
            if token_loss is not None:
                return fused_grpo_loss(
                    hidden[sel], weight, input_ids[:, 1:][sel], token_loss,
                    temperature=self.temperature, chunk_size=self.fused_chunk_size,
                )  # fmt: skip
            return token_logprobs(
                hidden[sel],  # [N, H]
                weight,
                input_ids[:, 1:][sel],  # [N]
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=with_entropy,
            )
