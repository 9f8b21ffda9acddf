"""Weight sync of a LoRA policy, adapter against merged: bytes and time per sync, and the
server's generation throughput with what each sync left it serving.

    python bench/bench_lora_sync.py --out bench/results/lora_sync_cpu.json
    CUDA_VISIBLE_DEVICES=0,1 python bench/bench_lora_sync.py --model /models/Qwen3-4B \
        --device cuda:0 --server-gpu 1 --transports nccl,http --server-arg=--engine=vllm \
        --server-arg=--enable-lora --server-arg=--max-lora-rank=64 --r 64 --out ...

Method: one rollout server (``python -m rollout_server``, its flags from ``--server-arg``) serves
``--model`` (default: the tiny random Qwen3, CPU). The learner's side is in this process: the
model wrapped in PEFT LoRA (rank ``--r``, every linear layer, random adapters; on ``--device``)
and the learner's own transports (``learner.sync.make_transport``: http, file, nccl, ipc; the
server on GPU ``--server-gpu`` for nccl, on the learner's for ipc) with ``rollout.sync.lora`` =
"merged" and "adapter". Each (transport, mode) pushes ``--syncs`` times; bytes are the server's
count of what it loaded, times the median of the learner's wall time per push and of the
server's load time. After the pushes, the server generates ``--prompts`` prompts of
``--tokens`` tokens each (seeded sampling, EOS ignored) ``--repeats`` times: tokens per second,
median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _start_server(
    model: str, args: list[str], weights_dir: str, gpu: str | None
) -> tuple[subprocess.Popen, str]:
    import httpx
    from gpu_common import visible_gpus

    from grpo_common.net import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "rollout_server", "--model", model, "--port", str(port)]
    env = dict(os.environ)
    if gpu is not None:  # counted among this process's GPUs, as --device is
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus(gpu)
    proc = subprocess.Popen([*cmd, "--weights-dir", weights_dir, *args], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the rollout server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the rollout server did not get ready in 900 s")


def _policy(model: str, r: int, dtype: str, device: str) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config).to(device).eval()


def _transport(url: str, client: Any, transport: str, mode: str, a: argparse.Namespace) -> Any:
    """The learner's own transport for ``[rollout.sync] type = transport, lora = mode``."""
    from learner.config import RolloutConfig
    from learner.config.sync import SYNC_SECTIONS
    from learner.sync import make_transport

    fields: dict[str, Any] = {"lora": mode}
    if transport == "file":
        fields["dir"] = a.sync_dir
    sync = SYNC_SECTIONS[transport](**fields)
    return make_transport(RolloutConfig(servers=[url], sync=sync), client, device=a.device)


async def _measure(url: str, policy: Any, transport: str, mode: str, a: argparse.Namespace) -> dict:
    from e2e_common import median_of

    from rollout_server.client import RolloutClient
    from rollout_server.protocol import GenerateRequest

    async with RolloutClient(url) as client:
        sync = _transport(url, client, transport, mode, a)
        walls, loads, sizes, stages = [], [], [], []
        try:
            await sync.connect()  # NCCL forms its group here, outside the timed pushes
            for _ in range(a.syncs):
                start = time.perf_counter()
                (answer,) = await sync.push(policy)
                walls.append(time.perf_counter() - start)
                loads.append(answer.seconds)
                sizes.append(answer.num_bytes)
                stages.append(_stages(answer) | _sender_stages(sync.last_stats))
        finally:
            sync.close()
        (info,) = await client.info()
        request = GenerateRequest(
            prompts=[f"prompt {i}" for i in range(a.prompts)],
            max_tokens=a.tokens,
            seed=0,
            ignore_eos=True,
        )
        await client.generate(request)  # warm-up
        rates = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            response = await client.generate(request)
            seconds = time.perf_counter() - start
            tokens = sum(len(s.token_ids) for r in response.results for s in r.samples)
            rates.append(tokens / seconds)
    return {
        "transport": transport,
        "mode": mode,
        "bytes_per_sync": statistics.median(sizes),
        "sync_wall_s": statistics.median(walls),
        "server_load_s": statistics.median(loads),
        "gen_tokens_per_s": statistics.median(rates),
        "received_s": median_of(stages, "received_s"),
        "loaded_s": median_of(stages, "loaded_s"),
        "sync_wall_s_each": walls,  # the spread behind the medians
        "gen_tokens_per_s_each": rates,
        "server_stages_each": stages,  # where each push's server time went (NCCL, CUDA IPC)
        "served_lora_rank": info.lora_rank,
        "engine": info.engine,
        "device": info.device,
    }


def _stages(answer: Any) -> dict[str, Any]:
    """The server's account of one push, as the NCCL and CUDA IPC transports report it: the
    receive and the load (or, for an adapter, the write for vLLM), how it loaded, and each
    stage of its timeline in seconds after the first. Empty for HTTP and file pushes."""
    if answer.timeline is None:
        return {}
    first = min(answer.timeline.values())
    stages = sorted(answer.timeline.items(), key=lambda kv: kv[1])
    return {
        "received_s": answer.received_s,
        "loaded_s": answer.loaded_s,
        "loader": answer.loader,
        "timeline_s": {k: round(t - first, 4) for k, t in stages},
    }


def _sender_stages(stats: dict[str, Any]) -> dict[str, Any]:
    """The learner side of one push, where the transport keeps an account (NCCL: the
    broadcast thread's marks in ms since the push began, and when every worker acknowledged
    the load); empty otherwise."""
    if not stats:
        return {}
    marks = stats.get("sender_ms") or {}
    return {
        "sender_loaded_s": stats.get("loaded_s"),
        "sender_ms": {k: round(v, 1) for k, v in marks.items() if not k.startswith("launched")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="model directory (default: the tiny random Qwen3)")
    p.add_argument("--dtype", default="float32", help="the learner's dtype")
    p.add_argument("--r", type=int, default=8, help="LoRA rank")
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="http,file", help="of http, file, nccl, ipc")
    p.add_argument("--device", default="cpu", help="the learner's device (nccl, ipc: a GPU)")
    p.add_argument("--server-gpu", help="the server's GPU, among this process's (nccl: another)")
    p.add_argument("--server-arg", action="append", default=[], help="a rollout-server flag")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a.sync_dir = str(Path(tmp) / "sync")
        model = a.model
        if model is None:
            from rollout_server.tiny import save_tiny_model

            model = str(save_tiny_model(Path(tmp) / "tiny", seed=0))
        policy = _policy(model, a.r, a.dtype, a.device)
        server, url = _start_server(model, a.server_arg, tmp, a.server_gpu)
        try:
            rows = [
                asyncio.run(_measure(url, policy, transport, mode, a))
                for transport in a.transports.split(",")
                for mode in ("merged", "adapter")
            ]
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(
        f"{'transport':9} {'mode':8} {'MB/sync':>10} {'sync s':>8} {'load s':>8} "
        f"{'recv s':>8} {'loaded s':>8} {'gen tok/s':>10}"
    )
    for row in rows:
        split = [f"{row[k]:8.3f}" if row[k] is not None else f"{'-':>8}" for k in
                 ("received_s", "loaded_s")]  # fmt: skip
        print(
            f"{row['transport']:9} {row['mode']:8} {row['bytes_per_sync'] / 1e6:10.3f} "
            f"{row['sync_wall_s']:8.3f} {row['server_load_s']:8.3f} {' '.join(split)} "
            f"{row['gen_tokens_per_s']:10.1f}"
        )
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        setup = {k: v for k, v in vars(a).items() if k not in ("out", "sync_dir")}
        setup |= {"model": model, "date": time.strftime("%Y-%m-%d")}
        a.out.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
