"""The transformers engine's decode loop: KV-cached sampling for a batch of independent rows.

A row is one (prompt, sample) pair with its own sampling parameters, seed and token budget, so
rows of different requests share a batch. Prompts are left-padded and prefilled once each (rows
that share a prompt copy its KV cache), then every step feeds the last sampled token of each
unfinished row. Finished rows leave the batch, so a short answer does not pay for a long one;
so do cancelled rows (their client went away, or the server is stopping), between two steps.

Runs in a worker thread (it blocks on torch); nothing here touches the event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_server.engine.base import SampleOutput
from rollout_server.engine.routes import RouteLog, route_log
from rollout_server.engine.sampling import (
    apply_repetition_penalty,
    find_stop,
    sample_tokens,
    sampling_logprobs,
)
from rollout_server.protocol import FinishReason, SamplingParams

_SEED_MASK = (1 << 64) - 1


def _never() -> bool:
    return False


@dataclass
class Row:
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new: int  # completion budget, already capped by the context length
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # eos (unless ignored) + extra
    # polled from the decode thread between steps: True drops the row (its output is discarded)
    cancelled: Callable[[], bool] = _never


@dataclass
class _RowState:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str | None = None  # set when a stop string cut the text


def _param_tensors(rows: list[Row], device: torch.device) -> dict[str, torch.Tensor]:
    def col(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in rows], dtype=dtype, device=device)

    return {
        "temperature": col("temperature", torch.float32),
        "top_k": col("top_k", torch.long),
        "top_p": col("top_p", torch.float32),
        "min_p": col("min_p", torch.float32),
        "penalty": col("repetition_penalty", torch.float32),
    }


def _left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [P, T]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [P, T]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _forward(model: Any, ids, mask, positions, cache) -> torch.Tensor:
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :].float()  # [B, V]


def decode_rows(
    model: Any,
    rows: list[Row],
    *,
    pad_id: int,
    detokenize: Callable[[list[int]], str],
) -> list[SampleOutput]:
    """Sample every row to completion; returns one ``SampleOutput`` per row, in order."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    unique: dict[tuple[int, ...], int] = {}
    row_prompt = [unique.setdefault(tuple(r.prompt), len(unique)) for r in rows]
    ids, mask = _left_pad([list(p) for p in unique], pad_id, device)  # [P, T]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [P, T]
    cache = DynamicCache()
    routes = route_log(model, [r.params.return_routed_experts for r in rows])
    hooked = routes.hooked() if routes is not None else contextlib.nullcontext()
    with torch.inference_mode(), hooked:
        logits = _forward(model, ids, mask, positions, cache)  # [P, V]
        if routes is not None:
            routes.prefill(row_prompt, [len(p) for p in unique], ids.shape[1])
        expand = torch.tensor(row_prompt, device=device)  # [B]
        cache.reorder_cache(expand)
        logits, mask = logits[expand], mask[expand]  # [B, V], [B, T]
        next_pos = positions[expand, -1] + 1  # [B]
        return _sample_loop(model, rows, logits, mask, next_pos, cache, detokenize, routes)


def _sample_loop(
    model, rows, logits, mask, next_pos, cache, detokenize, routes: RouteLog | None = None
) -> list[SampleOutput]:
    device = logits.device
    vocab = logits.shape[-1]
    params = _param_tensors(rows, device)
    generators = [torch.Generator().manual_seed(r.seed & _SEED_MASK) for r in rows]
    states = [_RowState() for _ in rows]
    active = list(range(len(rows)))  # rows still decoding, in batch order
    seen = None
    if bool((params["penalty"] != 1).any()):
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)  # [B, V]
        for i, r in enumerate(rows):
            seen[i, torch.tensor([t for t in r.prompt if t < vocab], dtype=torch.long)] = True
    for _ in range(max(r.max_new for r in rows)):
        idx = torch.tensor(active, device=device)  # [A]
        p = {k: v[idx] for k, v in params.items()}
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen[idx], p["penalty"])
        logprobs = sampling_logprobs(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"])
        uniforms = torch.stack(
            [torch.rand((), generator=generators[i], dtype=torch.float64) for i in active]
        ).to(device)  # [A]
        tokens = sample_tokens(logprobs, p["temperature"] <= 0, uniforms)  # [A]
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # [A]
        for i, tok, lp in zip(active, tokens.tolist(), chosen.tolist(), strict=True):
            _advance(rows[i], states[i], tok, lp, detokenize)
            if seen is not None:
                seen[i, tok] = True
        keep = [
            j for j, i in enumerate(active) if states[i].finish is None and not rows[i].cancelled()
        ]
        if not keep:
            break
        if len(keep) < len(active):
            sel = torch.tensor(keep, device=device)
            cache.reorder_cache(sel)
            mask, next_pos, tokens = mask[sel], next_pos[sel], tokens[sel]
            active = [active[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)  # [A, T+1]
        logits = _forward(model, tokens[:, None], mask, next_pos[:, None], cache)  # [A, V]
        if routes is not None:
            routes.step(active)
        next_pos = next_pos + 1
    return [
        SampleOutput(
            token_ids=s.tokens,
            logprobs=s.logprobs,
            text=s.text if s.text is not None else detokenize(s.tokens),
            finish_reason=s.finish or "length",
            routed_experts=routes.of(i) if routes is not None else None,
        )
        for i, s in enumerate(states)
    ]


def _advance(row: Row, state: _RowState, token: int, logprob: float, detokenize) -> None:
    """Append a sampled token and decide whether the row is finished (and why)."""
    state.tokens.append(token)
    state.logprobs.append(logprob)
    if token in row.stop_ids:
        state.finish = "stop"
        return
    if row.params.stop:
        text = detokenize(state.tokens)
        cut = find_stop(text, row.params.stop)
        if cut is not None:
            state.finish, state.text = "stop", text[:cut]
            return
    if len(state.tokens) >= row.max_new:
        state.finish = "length"
