"""Activation offloading on a CUDA GPU: the same loss and gradients as without it.

The CPU tests run the hooks' CPU path only. The GPU path copies on a side stream, and its first
GPU run (bench_memory_options.py, 2026-11-21) computed NaN: the copies back were allocated on
the side stream, so a freed copy's memory went to the next copy while the compute stream still
read it. This test takes the path that exposed it: several micro-batches of different lengths
accumulated into one set of gradients, so the caching allocator hands freed blocks out again.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from rollout_server.tiny import tiny_qwen3_config

    torch.manual_seed(0)
    config = tiny_qwen3_config(
        vocab_size=32000, hidden=512, layers=6, heads=8, kv_heads=4, head_dim=64,
        intermediate=1536, attn_implementation="sdpa",
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).cuda().train()


def _accumulate(model: torch.nn.Module, batches: list[torch.Tensor], offload) -> tuple:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for ids in batches:
        with offload():
            logits = model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            )
        loss.backward()
        total += float(loss)
    torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return total, grads


def test_offloading_gives_the_same_gradients_on_the_gpu():
    import contextlib

    from learner.model.offload import ActivationOffload

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _model()
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        torch.randint(0, 32000, (b, t), device="cuda", generator=gen)
        for b, t in ((8, 512), (4, 1024), (16, 256), (8, 768), (2, 2048))
    ]
    plain_loss, plain = _accumulate(model, batches, contextlib.nullcontext)
    offload = ActivationOffload(keep=model.parameters())
    calls = []
    pack = offload._pack
    offload._pack = lambda t: calls.append(t.numel()) or pack(t)
    host_chunks = []
    for _ in range(2):  # the second pass reuses the pinned chunks and the device blocks
        loss, grads = _accumulate(model, batches, offload)
        host_chunks.append(len(offload.arena.chunks))
        assert host_chunks[-1] == host_chunks[0]  # every micro-batch reused the same chunks
        assert len(calls) > 100 and max(calls) * 4 >= 1 << 20  # large tensors really went out
        assert loss == pytest.approx(plain_loss, rel=1e-5)
        for name, g in grads.items():
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, plain[name], rtol=1e-4, atol=1e-6, msg=name)


def _forward_peak_reserved(model: torch.nn.Module, ids: torch.Tensor, offload) -> int:
    """Reserved memory at its highest during one forward (the backward runs after, untimed)."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with offload():
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    loss.backward()
    return peak


def test_offloading_lowers_reserved_memory_not_only_allocated():
    """The forward makes activations faster than PCIe drains them: unless the queue of copies is
    bounded, the allocator takes new blocks while the old ones wait, and what the process holds
    does not go down (53.5 GB reserved for 6.0 GB allocated in the first fixed run)."""
    import contextlib

    from learner.model.offload import ActivationOffload

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _model()
    ids = torch.randint(0, 32000, (8, 2048), device="cuda", generator=torch.Generator("cuda"))
    plain = _forward_peak_reserved(model, ids, contextlib.nullcontext)
    offload = ActivationOffload(keep=model.parameters(), max_in_flight_bytes=256 << 20)
    offloaded = _forward_peak_reserved(model, ids, offload)
    print(
        f"forward peak reserved: plain {plain / 1e9:.2f} GB, offloaded {offloaded / 1e9:.2f} GB,"
        f" copies queued at most {offload.peak_in_flight_bytes / 1e9:.2f} GB"
    )
    assert offload.peak_in_flight_bytes <= (256 << 20) + 8 * 2048 * 32000 * 4  # + one tensor
    # H200, 2026-11-21: plain 19.33 GB, offloaded 9.70 GB (the two 2.1 GB fp32 logits-sized
    # tensors the loss makes last are still on the GPU when the forward ends).
    assert offloaded < 0.6 * plain
