"""The policy's forward for GRPO: per-token log-probs through a chunked LM head.

``PolicyLogprobs`` wraps a Hugging Face causal LM. Its ``forward`` runs the decoder to hidden states
and then computes log-probs of the target tokens directly from hidden states and the LM-head weight
(``learner.logprobs.token_logprobs``), only at loss positions, chunk by chunk: the
``[tokens, vocab]`` logits never exist.

Why a wrapper module and not a function on the unwrapped model: under DeepSpeed ZeRO-3 the LM-head
weight is partitioned. It is registered as an *external parameter* of this module, so DeepSpeed
gathers it for this module's forward and reduce-scatters its gradient in backward; a loss called on
the unwrapped model would silently see an empty shard or skip the gradient all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from learner.logprobs import token_logprobs


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


class PolicyLogprobs(nn.Module):
    def __init__(self, model: nn.Module, *, temperature: float = 1.0, chunk_size: int = 1024):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
        if _is_zero3(head.weight):
            import deepspeed

            deepspeed.zero.register_external_parameter(self, head.weight)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        loss_mask: torch.Tensor,  # [B, T-1]
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of tokens ``1..T-1``, as ``[B, T-1]`` fp32, zero off-mask."""
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = hidden[:, :-1]  # [B, T-1, H]: position t predicts token t+1
        targets = input_ids[:, 1:]  # [B, T-1]
        sel = loss_mask.bool()
        weight = self.model.get_output_embeddings().weight  # [V, H]
        lp, ent = token_logprobs(
            hidden[sel],  # [N, H]
            weight,
            targets[sel],  # [N]
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            with_entropy=with_entropy,
        )
        out = hidden.new_zeros(targets.shape, dtype=torch.float32)
        out = out.masked_scatter(sel, lp)
        ent_out = None
        if ent is not None:
            ent_out = hidden.new_zeros(targets.shape, dtype=torch.float32).masked_scatter(sel, ent)
        return out, ent_out
