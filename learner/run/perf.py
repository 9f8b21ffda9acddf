"""Throughput helpers: model FLOPs per token (for MFU), the GPU peak, and the profiler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment; MFU is reported against these.
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_tflops(override: float | None = None) -> float | None:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def train_flops_per_token(config: Any, seq_len: float) -> float:
    """Model FLOPs of one trained token (forward + backward = 3x forward), from the architecture.

    Forward per token: 2 FLOPs per weight of every matmul (attention projections, MLP, LM head)
    plus attention scores and values, 4 * layers * seq_len * (heads * head_dim), averaged over
    causal positions (seq_len / 2 keys on average)."""
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads)
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    attn_proj = h * heads * hd * 2 + h * kv * hd * 2  # q, o and k, v
    mlp = 3 * h * inter  # gate, up, down (SwiGLU)
    matmul_weights = layers * (attn_proj + mlp) + config.vocab_size * h
    attention = 4 * layers * heads * hd * (seq_len / 2)
    return 3 * (2 * matmul_weights + attention)


def train_flops(config: Any, lengths: list[int], passes: int = 1) -> float:
    """Model FLOPs of training on sequences of ``lengths`` tokens (prompt and completion: the
    model runs over both), ``passes`` times (``grpo.num_iterations``). Not counted: padding, the
    recomputation of gradient checkpointing, a KL reference's forward.

    Attention costs each token in proportion to its sequence's length, so the token-weighted
    mean length, sum(L^2) / sum(L), gives the exact total (not a micro-batch's padded size)."""
    tokens = sum(lengths)
    if tokens == 0:
        return 0.0
    seq_len = sum(n * n for n in lengths) / tokens
    return passes * tokens * train_flops_per_token(config, seq_len)


@contextlib.contextmanager
def profiled(out_dir: Path | None, name: str, *, trace: bool = False) -> Iterator[None]:
    """Run the block under ``torch.profiler`` (host ops, and CUDA kernels on a GPU) and write
    ``out_dir/name.txt``: the ops by total host time and by device time, with shapes grouped
    out. ``out_dir`` None: no profiling. ``trace``: also ``name.trace.json`` for Perfetto."""
    if out_dir is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False) as prof:
        yield
    out_dir.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages()
    parts = [f"# {name}: torch.profiler, activities {[a.name for a in activities]}", ""]
    parts += ["## by host time (total)", table.table(sort_by="cpu_time_total", row_limit=40)]
    if len(activities) > 1:
        parts += ["", "## by device time (total)"]
        parts.append(table.table(sort_by="device_time_total", row_limit=40))
    (out_dir / f"{name}.txt").write_text("\n".join(parts) + "\n")
    if trace:
        prof.export_chrome_trace(str(out_dir / f"{name}.trace.json"))
