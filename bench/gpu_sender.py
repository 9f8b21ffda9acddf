"""The learner side of an NCCL or CUDA IPC weight sync, for the GPU tests and benchmarks.

Loads a model on this process's first GPU and sends it once. NCCL: joins the rollout server's
weight group as rank 0 (or dies right after the first bucket, to test interrupted syncs). IPC
(the server on this same GPU): shares the packed buckets (``--corrupt-handle`` sends a garbled
handle, to test refused updates; ``--nan-tensor NAME`` puts a NaN into a parameter, either way):

    CUDA_VISIBLE_DEVICES=0 python bench/gpu_sender.py --url http://127.0.0.1:8000 \
        --model DIR --master-port 29612 [--perturb-seed 1] [--die-after-first-bucket]
    CUDA_VISIBLE_DEVICES=0 python bench/gpu_sender.py --transport ipc --url URL --model DIR

``--prepare`` prepares the NCCL update first (``NcclWeightSender.prepare``), then asks for a
generation (it must wait behind the prepared update) and a sleep (refused), then sends
(recorded under ``while_prepared``);
``--die-after-prepare`` exits right after preparing, once its commit (posted at prepare) is on
the wire (a learner that crashed in its step: the server's workers wait for the bytes).
``--early`` sends without checksums and ``wait_answers=False``: it returns on the workers' NCCL
acknowledgement of the load, asks for a generation at once (recorded under ``early``: it must
run on the new weights), then collects the HTTP answers (``answers()``).
``--broken-stream-first`` first sends from a tensor stream that fails after its first tensor
(the learner sends commit word 0, the workers acknowledge 0 and keep their weights), records
the error, then sends properly over the same group.

The last line of stdout is a JSON summary (responses, checksums of the parameters and of the
buckets, timings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import API_KEY


def load_model(model_dir: str, perturb_seed: int | None = None) -> Any:
    """The model in bf16 on cuda:0; with a seed, every weight moved by N(0, 0.02) noise."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    if perturb_seed is not None:
        gen = torch.Generator(device="cuda").manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype) * 0.02)
    return model


def reference_checksum(model: Any) -> float:
    """The digest of the model's parameters by name and position (``params_checksum``: in
    vLLM's fused name space, so ``GET /weights/checksum`` of vLLM serving them is the same)."""
    from rollout_server.weight_digest import params_checksum

    return params_checksum(model)


def bucket_checksum(model: Any, specs: Any, bucket_bytes: int) -> float:
    """The digest of the update's buckets packed here, apart from the sender (``flat_checksum``
    of each bucket, in order): what a server reports that received every byte in its place."""
    import torch

    from learner.sync.nccl_buckets import fill_bucket, plan_buckets
    from learner.sync.zero3 import iter_gathered_params
    from rollout_server.nccl_wire import bucket_layout
    from rollout_server.weight_digest import flat_checksum

    plan = plan_buckets(specs, bucket_bytes)
    layout = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
    it = iter_gathered_params(model)
    total = 0.0
    for b, bucket in enumerate(layout):
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device="cuda")
        fill_bucket(flat, bucket, it)
        total += float(flat_checksum(flat, b))
    return total


async def connect(url: str, master_port: int, timeout_s: float) -> tuple[Any, Any]:
    from learner.sync.nccl_sender import NcclWeightSender
    from rollout_server.client import RolloutClient

    client = RolloutClient(url, api_key=API_KEY, timeout_s=600.0)
    sender = NcclWeightSender()
    await sender.init(
        client, master_address="127.0.0.1", master_port=master_port, device=0, timeout_s=timeout_s
    )
    return client, sender


def garble_ipc_handles() -> None:
    """Every IPC handle the sender shares from now on is garbled (a refused update)."""
    import rollout_server.cuda_ipc as cuda_ipc

    share = cuda_ipc.share

    def garbled(flat: Any) -> Any:
        h = share(flat)
        return h.model_copy(update={"handle": "A" * len(h.handle)})

    cuda_ipc.share = garbled  # the sender looks it up at call time


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from learner.sync.zero3 import iter_gathered_params, param_specs
    from rollout_server.client import RolloutClient, WeightSyncError

    model = load_model(args.model, args.perturb_seed)
    if args.nan_tensor:  # a refused update: one NaN in that parameter
        with torch.no_grad():
            dict(model.named_parameters())[args.nan_tensor].view(-1)[0] = float("nan")
    extra: dict[str, Any] = {}
    if args.transport == "ipc":
        from learner.sync.ipc import IpcWeightSender

        if args.corrupt_handle:
            garble_ipc_handles()
        client = RolloutClient(args.url, api_key=API_KEY, timeout_s=600.0)
        sender: Any = IpcWeightSender(client, 0)
    else:
        client, sender = await connect(args.url, args.master_port, args.timeout_s)

        def on_bucket(b: int) -> None:
            if args.die_after_first_bucket and b == 0:
                print(json.dumps({"died_after_bucket": b}), flush=True)
                os._exit(3)

        extra["on_bucket"] = on_bucket
    if args.early:  # NCCL only (the IPC sender has no early return)
        extra["wait_answers"] = False
    specs = param_specs(model, dtype=torch.bfloat16)
    checksum = not args.early
    extra_out: dict[str, Any] = {}
    if args.broken_stream_first:
        extra_out["broken_stream_error"] = await send_broken_stream(sender, specs, model, args)
    if args.prepare:
        probe_out, waiting = await prepare_and_probe(client, sender, specs, args, checksum)
        extra_out.update(probe_out, prepare_s=sender.last_prepare_s)
    try:
        responses = await sender.send(
            specs,
            iter_gathered_params(model),
            bucket_bytes=args.bucket_mb << 20,
            checksum=checksum,
            **extra,
        )
        if args.early:  # loaded, acknowledged: a generation asked now runs on the new weights
            from rollout_server.protocol import GenerateRequest

            returned, loaded_s = responses is not None, sender.last_stats["loaded_s"]
            request = GenerateRequest(prompts=[[1, 2, 3, 4]], n=1, max_tokens=4, ignore_eos=True)
            generated = await client.generate(request)
            responses = await sender.answers()
            extra_out["early"] = {
                "returned": returned,
                "loaded_s": loaded_s,
                "generated_version": generated.weight_version,
            }
        if args.prepare:  # the generation that waited ran after the commit, on the new weights
            out = await waiting
            extra_out["while_prepared"]["generated_version"] = out.weight_version
    except WeightSyncError as e:
        return {"error": str(e), **extra_out}
    finally:
        await client.aclose()
    return {
        "responses": [r.model_dump() for r in responses],
        "reference_checksum": reference_checksum(model),
        "bucket_checksum": bucket_checksum(model, specs, args.bucket_mb << 20),
        "stats": sender.last_stats,
        **extra_out,
    }


async def send_broken_stream(sender: Any, specs: Any, model: Any, args: Any) -> str:
    """A send whose tensor stream fails after its first tensor must raise (the servers keep
    their weights) and leave the group usable; returns the error."""
    from learner.sync.zero3 import iter_gathered_params

    def broken() -> Any:
        it = iter_gathered_params(model)
        yield next(it)
        raise RuntimeError("the learner's tensor stream broke on purpose")

    try:
        await sender.send(specs, broken(), bucket_bytes=args.bucket_mb << 20)
    except Exception as exc:  # the stream's own error
        assert sender.ready, "the group was dropped after a clean commit word 0"
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("a send from a broken tensor stream succeeded")


async def prepare_and_probe(
    client: Any, sender: Any, specs: Any, args: Any, checksum: bool
) -> tuple[dict[str, Any], Any]:
    """Prepare the update; while it waits, a generation must wait too (returned, to be awaited
    after the send) and sleep must be refused."""
    import httpx

    from rollout_server.protocol import GenerateRequest

    assert await sender.prepare(specs, bucket_bytes=args.bucket_mb << 20, checksum=checksum)
    if args.die_after_prepare:
        await asyncio.sleep(1.0)  # the commit task posts its request meanwhile
        print(json.dumps({"died_after_prepare": True}), flush=True)
        os._exit(3)
    request = GenerateRequest(prompts=[[1, 2, 3, 4]], n=2, max_tokens=16, ignore_eos=True)
    waiting = asyncio.ensure_future(client.generate(request))
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        sleep = await http.post(f"{args.url}/sleep", json={"level": 1})
    probe = {
        "generate_waited": not waiting.done(),
        "sleep_status": sleep.status_code,
        "sleep_detail": sleep.json().get("detail", ""),
    }
    return {"while_prepared": probe}, waiting


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--transport", choices=["nccl", "ipc"], default="nccl")
    p.add_argument("--master-port", type=int, default=0, help="NCCL: the group's TCP port")
    p.add_argument("--corrupt-handle", action="store_true", help="IPC: send garbled handles")
    p.add_argument("--perturb-seed", type=int)
    p.add_argument("--nan-tensor", help="put one NaN into this parameter (a refused update)")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--die-after-first-bucket", action="store_true")
    p.add_argument("--prepare", action="store_true", help="NCCL: prepare, probe, then send")
    p.add_argument("--die-after-prepare", action="store_true")
    p.add_argument("--early", action="store_true", help="NCCL: return on the load's ack")
    p.add_argument("--broken-stream-first", action="store_true")
    args = p.parse_args()
    nccl_only = ("prepare", "die_after_prepare", "early", "broken_stream_first", "master_port",
                 "die_after_first_bucket")  # fmt: skip
    if args.transport == "ipc" and any(getattr(args, k) for k in nccl_only):
        flags = ", ".join("--" + k.replace("_", "-") for k in nccl_only)
        p.error(f"{flags} are for --transport nccl")
    if args.transport == "nccl" and args.corrupt_handle:
        p.error("--corrupt-handle is for --transport ipc")
    if args.die_after_prepare and not args.prepare:
        p.error("--die-after-prepare needs --prepare")
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
