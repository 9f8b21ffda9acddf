"""Our weight sync against vLLM's native weight-transfer engine, in one run, same model and GPUs.

    python bench/bench_native_sync.py --model DIR --transport nccl --out bench/results/native_sync_nccl.json
    python bench/bench_native_sync.py --model DIR --transport ipc --out bench/results/native_sync_ipc.json

The learner's side is this process, on GPU 0, with the model in bf16 and the learner's own
transports (``learner.sync``), so what is timed is what a training run pays per sync:

- **ours**: ``python -m rollout_server --engine vllm`` and ``[rollout.sync] type = "nccl"``
  (flat buckets of ``--bucket-mb``, broadcast from rank 0, one commit word) or ``"ipc"``;
- **vllm**: a stock ``vllm serve --weight-transfer-config '{"backend": ...}'`` and ``[rollout.sync]
  type = "vllm"`` (vLLM's ``trainer_send_weights``, packed, over its RL routes).

NCCL puts the server on GPU 1, IPC on GPU 0 beside the learner. Each side pushes ``--syncs``
times after one warm-up push (which forms the group); the table gives the median wall time per
push and bytes ÷ time. The two servers run one after the other on the same GPU, both eager by
default (``--enforce-eager``: a sync copies into the same weight tensors either way; the
servers start without compiling). A missing vLLM or GPU fails the benchmark (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


async def _pushes(transport: Any, model: Any, syncs: int, prepared: bool = False) -> list[float]:
    """Wall seconds of each of ``syncs`` pushes after a warm-up one; ``prepared``: each push
    follows a ``prepare`` (untimed: the learner overlaps it with its optimizer step)."""
    await transport.connect()
    await transport.push(model)  # warm-up: the first layout, caches, the group
    times = []
    for _ in range(syncs):
        if prepared:
            await transport.prepare(model)
        start = time.perf_counter()
        await transport.push(model)
        times.append(time.perf_counter() - start)
    return times


def _ours(args: argparse.Namespace, model: Any, gpu: str) -> dict[str, list[float]]:
    from gpu_common import API_KEY, ServerProcess

    from learner.config.rollout import RolloutConfig
    from learner.config.sync import IpcSyncConfig, NcclSyncConfig
    from learner.sync import make_transport
    from rollout_server.client import RolloutClient

    sync = (NcclSyncConfig(bucket_mb=args.bucket_mb) if args.transport == "nccl"
            else IpcSyncConfig(bucket_mb=args.bucket_mb))  # fmt: skip
    eager = ["--vllm-arg", "enforce_eager=true"] if args.enforce_eager else []
    with ServerProcess(
        args.model, gpu=gpu, gpu_memory_utilization=args.gpu_memory_utilization, extra_args=eager
    ) as server:

        async def run() -> dict[str, list[float]]:
            async with RolloutClient(server.url, api_key=API_KEY) as client:
                rollout = RolloutConfig(servers=[server.url], sync=sync)
                transport = make_transport(rollout, client, device=0)
                try:
                    times = {"ours": await _pushes(transport, model, args.syncs)}
                    if args.transport == "nccl":  # the learner's path: receives queued early
                        times["ours_prepared"] = await _pushes(
                            transport, model, args.syncs, prepared=True
                        )
                    return times
                finally:
                    transport.close()

        return asyncio.run(run())


def _vllm(args: argparse.Namespace, model: Any, gpu: str) -> dict[str, list[float]]:
    from gpu_common import VllmServeProcess

    from learner.config.rollout import RolloutConfig
    from learner.config.sync import VllmSyncConfig
    from learner.sync import make_transport
    from rollout_server.client_vllm import VllmServeClient

    with VllmServeProcess(
        args.model, backend=args.transport, gpu=gpu,
        gpu_memory_utilization=args.gpu_memory_utilization,
        extra_args=["--enforce-eager"] if args.enforce_eager else [],
    ) as server:  # fmt: skip

        async def run() -> dict[str, list[float]]:
            facts = {"dtype": "bfloat16", "vocab_size": model.config.vocab_size,
                     "eos_token_ids": []}  # fmt: skip
            async with VllmServeClient(server.url, **facts) as client:
                sync = VllmSyncConfig(backend=args.transport)
                rollout = RolloutConfig(servers=[server.url], server_api="vllm", sync=sync)
                transport = make_transport(rollout, client, device=0)
                try:
                    return {"vllm": await _pushes(transport, model, args.syncs)}
                finally:
                    transport.close()

        return asyncio.run(run())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory (bf16 safetensors)")
    p.add_argument("--transport", choices=["nccl", "ipc"], default="nccl")
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=1024, help="ours: the bucket size")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
        help="both servers without CUDA graphs or compilation (starts faster; sync unchanged)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from gpu_common import gpu_count, require_modules

    needed = {"vllm": "vllm", "torch": "torch"}
    if args.transport == "ipc":  # vLLM 0.24's IPC weight-transfer engine imports it
        needed["ray"] = "ray"
    require_modules("bench_native_sync", needed)
    need = 2 if args.transport == "nccl" else 1
    if gpu_count() < need:
        print(f"bench_native_sync: {args.transport} needs {need} GPU(s), found {gpu_count()}")
        return 2
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gpu = "1" if args.transport == "nccl" else "0"
    rows = {}
    for side in (_ours, _vllm):
        for name, times in side(args, model, gpu).items():
            median = statistics.median(times)
            rows[name] = {"times_s": times, "median_s": median, "gb_per_s": nbytes / median / 1e9}
    print(f"{'side':<14} {'s/sync':>8} {'GB/s':>8}   ({args.transport}, {nbytes / 1e9:.2f} GB)")
    for name, r in rows.items():
        print(f"{name:<14} {r['median_s']:>8.3f} {r['gb_per_s']:>8.1f}")
    result = {
        "benchmark": "native_sync", "transport": args.transport, "model": args.model,
        "bytes": nbytes, "syncs": args.syncs, "bucket_mb": args.bucket_mb,
        "enforce_eager": args.enforce_eager,
        "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
        "ours_over_vllm": rows["ours"]["median_s"] / rows["vllm"]["median_s"], **rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
