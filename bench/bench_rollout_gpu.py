"""Rollout server on GPUs, in one run: throughput, sleep mode and NCCL weight sync.

    python bench/bench_rollout_gpu.py --out bench/results/rollout_gpu.json [--model DIR]

Model: random-weight Qwen3-0.6B shape, bf16 (``$GRPO_GPU_MODEL`` or written once). With two GPUs
the server and the offline baseline run on GPU 1 and the learner side on GPU 0; with one GPU the
sync part is skipped.

1. Throughput (target: HTTP >= 95% of offline). 256 prompts of 128 random byte tokens, n=8,
   256 tokens each (ignore_eos, so every run generates the same 524,288 tokens), temperature 1,
   sampled-token log-probs. Offline: ``vllm.LLM.generate`` in a fresh process, built from the
   very engine arguments the server uses (``engine_kwargs``). HTTP: one ``POST /generate`` of
   the whole batch to a running ``rollout-server --engine vllm``, timed at the client (JSON
   both ways included). Each side: one warm-up, then ``--repeats`` timed runs; tokens/s of the
   best run and the mean are reported.
2. Sleep level 1 (targets: frees >= 90% of what the server holds, wake_up < 1 s). Held = free
   GPU memory before the server started minus free memory while it is awake; freed = free
   memory asleep minus awake. Wake-up time is the ``POST /wake_up`` round trip.
3. Weight sync (targets: within 2x of bytes / NCCL broadcast bandwidth; per-tensor >= 4x
   slower). Bandwidth: a 1 GiB bf16 ``ncclBroadcast`` between this process (GPU 0) and a peer
   process with ``CUDA_VISIBLE_DEVICES=1``, the same pairing as learner and server, through the
   same vLLM PyNccl wrapper. Ours: ``NcclWeightSender.send`` of the whole model (1 GiB buckets),
   end to end at the learner. The verdict is a prepared send with ``wait_answers=False``: from
   ``send()`` until every worker has acknowledged over NCCL that the update is in its
   parameters (after that any generation request runs on the new weights); the same sends'
   HTTP answers (version bump) are timed too (``answered``), and the announced mode waits for
   them. The server's own ``seconds`` are reported too. Per-tensor: the same sender used as
   TRL's classic protocol, one announce and one broadcast per parameter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (
    ROOT,
    ServerProcess,
    free_gpu_bytes,
    gpu_env,
    qwen3_model_dir,
    require_modules,
)

from grpo_common.net import free_port

GPU_MEMORY_UTILIZATION = 0.5
MAX_MODEL_LEN = 2048
PROMPT_LEN = 128
# what every part needs: the server (vLLM, its HTTP stack) and the learner side (torch, httpx)
DEPENDENCIES = {
    "torch": "torch",
    "vllm": "vllm",
    "pydantic": "pydantic",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httpx": "httpx",
}


def server_settings(model: str) -> Any:
    from rollout_server.settings import ServerSettings

    return ServerSettings(
        model=model,
        engine="vllm",
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        max_model_len=MAX_MODEL_LEN,
    )


def make_prompts(num: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(PROMPT_LEN)] for _ in range(num)]


def request_body(prompts: list[list[int]], n: int, tokens: int) -> dict[str, Any]:
    return {
        "prompts": prompts,
        "n": n,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 1.0,
    }


# -- 1. throughput -----------------------------------------------------------------------------


def offline_worker(args: argparse.Namespace) -> None:
    """Runs in its own process: vLLM's offline LLM with the server's engine arguments."""
    from vllm import LLM
    from vllm import SamplingParams as VSP
    from vllm.engine.arg_utils import EngineArgs

    from rollout_server.engine.vllm_engine import (
        engine_kwargs,
        served_sampling_kwargs,
        supported_kwargs,
    )
    from rollout_server.protocol import GenerateRequest

    kwargs = supported_kwargs(EngineArgs, engine_kwargs(server_settings(args.model)))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], n: int, tokens: int) -> tuple[int, float]:
        req = GenerateRequest.model_validate(request_body(prompts, n, tokens))
        sp = VSP(**served_sampling_kwargs(req.sampling(), n))
        inputs = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outs for c in o.outputs), seconds

    run(make_prompts(16, seed=1), 8, 16)
    prompts = make_prompts(args.prompts)
    runs = [run(prompts, args.n, args.tokens) for _ in range(args.repeats)]
    print(json.dumps({"load_s": load_s, "runs": runs, "engine_kwargs": kwargs}, default=str))


def measure_offline(args: argparse.Namespace, gpu: str, log: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        __file__,
        "--offline-worker",
        "--model",
        args.model,
        "--prompts",
        str(args.prompts),
        "--n",
        str(args.n),
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(
        argv, env=gpu_env(gpu), capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    log.write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"offline worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    return {**_rates(out.pop("runs")), **out}


def _rates(runs: list[tuple[int, float]]) -> dict[str, Any]:
    rates = [tokens / seconds for tokens, seconds in runs]
    return {
        "tokens": runs[0][0],
        "seconds": [s for _, s in runs],
        "tokens_per_s_best": max(rates),
        "tokens_per_s_mean": statistics.mean(rates),
    }


def measure_http(args: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    def run(prompts: list[list[int]], n: int, tokens: int) -> tuple[int, float]:
        start = time.perf_counter()
        out = server.generate(**request_body(prompts, n, tokens))
        seconds = time.perf_counter() - start
        return sum(len(s["token_ids"]) for r in out["results"] for s in r["samples"]), seconds

    run(make_prompts(16, seed=1), 8, 16)
    prompts = make_prompts(args.prompts)
    return _rates([run(prompts, args.n, args.tokens) for _ in range(args.repeats)])


# -- 2. sleep ----------------------------------------------------------------------------------


def measure_sleep(server: ServerProcess, device: int, baseline_free: int) -> dict[str, Any]:
    cycles = []
    for _ in range(2):
        awake = free_gpu_bytes(device)
        t0 = time.perf_counter()
        server.post("/sleep", {"level": 1}).raise_for_status()
        sleep_s = time.perf_counter() - t0
        asleep = free_gpu_bytes(device)
        t0 = time.perf_counter()
        server.post("/wake_up", {}).raise_for_status()
        wake_s = time.perf_counter() - t0
        held, freed = baseline_free - awake, asleep - awake
        cycles.append(
            {
                "held_gb": held / 1e9,
                "freed_gb": freed / 1e9,
                "freed_fraction": freed / held,
                "sleep_s": sleep_s,
                "wake_up_s": wake_s,
            }
        )
    server.generate(prompts=make_prompts(2), max_tokens=4)  # serving again after wake-up
    return {
        "cycles": cycles,
        "freed_fraction_min": min(c["freed_fraction"] for c in cycles),
        "wake_up_s_max": max(c["wake_up_s"] for c in cycles),
    }


# -- 3. weight sync ----------------------------------------------------------------------------


def nccl_peer(args: argparse.Namespace) -> None:
    """Runs in its own process on the server's GPU: rank 1 of a bandwidth-test group."""
    import torch

    from rollout_server.nccl_wire import join_group

    comm = join_group("127.0.0.1", args.port, 1, 2, torch.device("cuda:0"), 120.0)
    buf = torch.empty(args.nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
    stream = torch.cuda.current_stream()
    for _ in range(args.iters + 3):
        comm.broadcast(buf, src=0, stream=stream)
    torch.cuda.synchronize()
    print(json.dumps({"ok": True}))


def measure_bandwidth(nbytes: int = 1 << 30, iters: int = 10) -> dict[str, Any]:
    import torch

    from rollout_server.nccl_wire import join_group, nccl_abort

    port = free_port()
    peer = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--nccl-peer",
            "--port",
            str(port),
            "--nbytes",
            str(nbytes),
            "--iters",
            str(iters),
        ],
        env=gpu_env("1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        comm = join_group("127.0.0.1", port, 0, 2, torch.device("cuda:0"), 120.0)
        buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
        stream = torch.cuda.current_stream()
        for _ in range(3):
            comm.broadcast(buf, src=0, stream=stream)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(iters):
            comm.broadcast(buf, src=0, stream=stream)
        end.record(stream)
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        nccl_abort(comm)
    finally:
        try:
            _, err = peer.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            peer.kill()
            _, err = peer.communicate()
    if peer.returncode != 0:
        raise RuntimeError(f"NCCL peer failed: {err[-2000:]}")
    return {"bytes": nbytes, "iters": iters, "gb_per_s": nbytes * iters / seconds / 1e9}


def _sync_record(sender: Any, r: Any) -> dict[str, Any]:
    stats = sender.last_stats
    return {
        **stats,
        "answered_s": stats["answered_at"] - stats["sent_at"],  # the HTTP answers were in
        "server_s": r.seconds,  # announce (or commit) received -> loaded and prefix cache reset
        "server_received_s": r.received_s,
        "server_loaded_s": r.loaded_s,
        "loader": r.loader,
        # ms after the learner's send() began at which each stage happened (one host, one wall
        # clock): where the time between bytes/bandwidth and total goes
        "timeline_ms": {
            k: (t - sender.last_stats["sent_at"]) * 1e3
            for k, t in {
                **(r.timeline or {}),
                "learner_acked": stats["sent_at"] + stats["loaded_s"],
                "learner_answered": stats["answered_at"],
            }.items()
        },
    }


def _summary(records: list[dict[str, Any]], ideal: float) -> dict[str, Any]:
    totals = sorted(r["total_s"] for r in records)
    answered = sorted(r["answered_s"] for r in records)
    first = records[0]["timeline_ms"]
    timeline = {
        k: sorted(r["timeline_ms"][k] for r in records)[len(records) // 2]
        for k in sorted(first, key=lambda k: first[k])
    }
    sender = {
        k: sorted(r["sender_ms"][k] for r in records)[len(records) // 2]
        for k in records[0].get("sender_ms", {})
    }
    return {
        "sender_median_ms": sender,  # the learner's broadcast thread, ms after send() began
        "best_s": totals[0],
        "median_s": totals[len(totals) // 2],
        "best_vs_ideal": totals[0] / ideal,
        "median_vs_ideal": totals[len(totals) // 2] / ideal,
        "answered_best_s": answered[0],
        "answered_median_s": answered[len(answered) // 2],
        "timeline_median_ms": timeline,
    }


async def measure_sync(
    server: ServerProcess, model_dir: str, bw_gb_s: float, repeats: int = 8
) -> dict[str, Any]:
    """Full syncs, in turn: announced with the send, and prepared beforehand (``prepare`` while
    a simulated 50 ms optimizer step runs; ``send`` is the critical path) with the default
    segments and with 128 and 256 MiB ones. Also the HTTP round trip to the server (``/health``),
    the floor of the commit's answer."""
    import torch
    from gpu_sender import connect, load_model, reference_checksum

    from learner.sync.nccl_sender import SEGMENT_BYTES
    from learner.sync.zero3 import iter_gathered_params, param_specs

    model = load_model(model_dir)
    specs = param_specs(model, dtype=torch.bfloat16)
    client, sender = await connect(server.url, free_port(), 120.0)
    # mode -> segment size; "prepared" (the default segments) is the verdict, the other sizes
    # show what the default trades
    segments = {
        "announced": SEGMENT_BYTES,
        "prepared": SEGMENT_BYTES,
        "prepared_128mb": 128 << 20,
        "prepared_256mb": 256 << 20,
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in segments}
    try:
        for i in range(repeats + 1):
            for mode, records in runs.items():
                prepare_s = None
                kw = dict(bucket_bytes=1 << 30, segment_bytes=segments[mode])
                if mode != "announced":
                    t0 = time.perf_counter()
                    assert await sender.prepare(specs, **kw), "prepare refused"
                    prepare_s = time.perf_counter() - t0
                    await asyncio.sleep(0.05)  # the optimizer step the prepare overlaps
                # prepared: back on the workers' acknowledgement, then the HTTP answers
                wait = mode == "announced"
                it = iter_gathered_params(model)
                responses = await sender.send(specs, it, wait_answers=wait, **kw)
                if responses is None:
                    responses = await sender.answers()
                record = {**_sync_record(sender, responses[0]), "prepare_s": prepare_s}
                print(f"[bench] sync {mode} {i}: {json.dumps(record)}", flush=True)
                if i:  # the first one is a warm-up (and verifies the direct-copy plan)
                    records.append(record)
        # The bytes are right, not only fast: a prepared send of a perturbed model with checksums
        # (the server's of what it received equals the learner's of what it sent), then the
        # weights vLLM serves equal the learner's parameters.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        kw = dict(bucket_bytes=1 << 30, checksum=True)
        assert await sender.prepare(specs, **kw), "prepare refused"
        checked = await sender.send(specs, iter_gathered_params(model), **kw)
        (served,) = await client.weights_checksum()
        reference = reference_checksum(model)
        exact = abs(served.checksum - reference) <= 1e-9 * abs(reference)
        assert exact, f"served checksum {served.checksum} != the learner's {reference}"
        rtts = []
        for _ in range(21):
            t0 = time.perf_counter()
            await client.health()
            rtts.append(time.perf_counter() - t0)
        nbytes = runs["announced"][0]["bytes"]
        ideal = nbytes / (bw_gb_s * 1e9)
        modes = {mode: _summary(records, ideal) for mode, records in runs.items()}
        for mode in segments:
            if mode != "announced":
                prepares = sorted(r["prepare_s"] for r in runs[mode])
                modes[mode]["prepare_median_s"] = prepares[len(prepares) // 2]
            modes[mode]["segment_bytes"] = segments[mode]
            modes[mode]["loaders"] = sorted({r["loader"] for r in runs[mode]})
        for mode, m in modes.items():
            print(f"[bench] sync {mode}: timeline, median ms after send():", flush=True)
            for k, v in m["timeline_median_ms"].items():
                print(f"    {k:<14} {v:7.2f}", flush=True)
            print("  learner's broadcast thread: " + ", ".join(
                f"{k} {v:.2f}" for k, v in m["sender_median_ms"].items()), flush=True)  # fmt: skip
        t0 = time.perf_counter()
        for spec, (name, t) in zip(specs, iter_gathered_params(model), strict=True):
            await sender.send([spec], [(name, t)], bucket_bytes=1 << 40)
        per_tensor = time.perf_counter() - t0
    finally:
        await client.aclose()
    best = modes["prepared"]["best_s"]
    return {
        "bytes": nbytes,
        "tensors": len(specs),
        "ideal_s": ideal,
        "runs": runs,
        "modes": modes,
        # the verdict: the sync's critical path (prepared), the announced one beside it
        "ours_best_s": best,
        "ours_median_s": modes["prepared"]["median_s"],
        "ours_vs_ideal": best / ideal,
        "ours_median_vs_ideal": modes["prepared"]["median_s"] / ideal,
        "http_round_trip_median_ms": sorted(rtts)[len(rtts) // 2] * 1e3,
        "checked": {
            "loader": checked[0].loader,
            "served_checksum": served.checksum,
            "learner_checksum": reference,
            "equal": exact,
        },
        "per_tensor_s": per_tensor,
        "per_tensor_vs_ours": per_tensor / modes["announced"]["best_s"],
    }


# -- driver ------------------------------------------------------------------------------------


def run_part(results: dict[str, Any], name: str, fn: Any, *a: Any) -> Any:
    """Run one part; a failure is recorded (with its traceback) and the other parts go on."""
    print(f"[bench] {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
        results[name] = fn(*a)
    except Exception as exc:
        results[name] = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
        print(f"[bench] {name} FAILED: {exc}", flush=True)
    print(f"[bench] {name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    # each part's numbers as soon as they exist: a step cut by its time limit still reports them
    print(f"[bench] {name} result: {json.dumps(results[name], default=str)[:2000]}", flush=True)
    return results[name]


def verdicts(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []

    def ok(x: bool) -> str:
        return "PASS" if x else "FAIL"

    off, http = r.get("offline", {}), r.get("http", {})
    if "tokens_per_s_best" in off and "tokens_per_s_best" in http:
        ratio = http["tokens_per_s_best"] / off["tokens_per_s_best"]
        r["http_vs_offline"] = ratio
        rows.append(
            (
                "/generate vs LLM.generate",
                f"{http['tokens_per_s_best']:,.0f} vs {off['tokens_per_s_best']:,.0f} tok/s",
                f"{ratio:.1%}",
                ok(ratio >= 0.95),
            )
        )
    if "freed_fraction_min" in (s := r.get("sleep", {})):
        c = s["cycles"][0]
        rows.append(
            (
                "sleep(1) memory freed",
                f"{c['freed_gb']:.1f} of {c['held_gb']:.1f} GB",
                f"{s['freed_fraction_min']:.1%}",
                ok(s["freed_fraction_min"] >= 0.9),
            )
        )
        rows.append(
            ("wake_up time", f"{s['wake_up_s_max']:.3f} s", "< 1 s", ok(s["wake_up_s_max"] < 1.0))
        )
    if "ours_vs_ideal" in (y := r.get("sync", {})):
        bw = r["bandwidth"]["gb_per_s"]
        rows.append(
            (
                "NCCL sync (prepared, loaded: NCCL ack) vs bytes/bandwidth",
                f"best {y['ours_best_s'] * 1e3:.1f} ms (median {y['ours_median_s'] * 1e3:.1f}) "
                f"vs {y['ideal_s'] * 1e3:.1f} ms ({bw:.0f} GB/s)",
                f"{y['ours_vs_ideal']:.2f}x (median {y['ours_median_vs_ideal']:.2f}x)",
                ok(y["ours_vs_ideal"] <= 2.0),
            )
        )
        m, ideal = y["modes"]["prepared"], y["ideal_s"]
        rows.append(
            (
                "  same sends, until their HTTP answers",
                f"best {m['answered_best_s'] * 1e3:.1f} ms "
                f"(median {m['answered_median_s'] * 1e3:.1f})",
                f"{m['answered_best_s'] / ideal:.2f}x "
                f"(median {m['answered_median_s'] / ideal:.2f}x)",
                "-",
            )
        )
        for mode, m in y["modes"].items():
            if mode == "prepared":
                continue
            what = "announced with the send" if mode == "announced" else mode.replace("_", ", ")
            rows.append(
                (
                    f"  same, {what} ({m['segment_bytes'] >> 20} MiB segments)",
                    f"best {m['best_s'] * 1e3:.1f} ms (median {m['median_s'] * 1e3:.1f})",
                    f"{m['best_vs_ideal']:.2f}x (median {m['median_vs_ideal']:.2f}x)",
                    "-",
                )
            )
        rows.append(
            (
                "per-tensor protocol vs ours (announced)",
                f"{y['per_tensor_s']:.2f} s",
                f"{y['per_tensor_vs_ours']:.1f}x slower",
                ok(y["per_tensor_vs_ours"] >= 4),
            )
        )
    return rows


def failed_parts(r: dict[str, Any]) -> list[str]:
    """The parts that raised (each recorded with its error); any one fails the benchmark."""
    return [k for k, v in r.items() if isinstance(v, dict) and "error" in v]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout_gpu.json")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], choices=["offline", "http", "sleep", "sync"])
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nccl-peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.offline_worker:
        offline_worker(args)
        return 0
    if args.nccl_peer:
        nccl_peer(args)
        return 0
    require_modules("bench_rollout_gpu.py", DEPENDENCIES)
    import torch

    args.model = str(args.model or qwen3_model_dir())
    two = torch.cuda.device_count() >= 2
    device = 1 if two else 0  # the server's (and the offline baseline's) GPU
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    r: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "gpus": torch.cuda.device_count(),
        "model": args.model,
        "workload": {
            "prompts": args.prompts,
            "n": args.n,
            "tokens": args.tokens,
            "prompt_len": PROMPT_LEN,
            "repeats": args.repeats,
        },
    }
    if "offline" not in args.skip:
        run_part(r, "offline", measure_offline, args, str(device), out_dir / "bench_offline.log")
    baseline = free_gpu_bytes(device)
    server = ServerProcess(
        args.model,
        gpu=str(device),
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        max_model_len=MAX_MODEL_LEN,
        log_path=out_dir / "bench_server.log",
    )
    try:
        run_part(r, "server_start", lambda: {"ok": bool(server.start())})
        if "http" not in args.skip:
            run_part(r, "http", measure_http, args, server)
        if "sleep" not in args.skip:
            run_part(r, "sleep", measure_sleep, server, device, baseline)
        if "sync" not in args.skip and two:
            bw = run_part(r, "bandwidth", measure_bandwidth)
            if "gb_per_s" in bw:
                run_part(
                    r, "sync", lambda: asyncio.run(measure_sync(server, args.model, bw["gb_per_s"]))
                )
        elif not two:
            r["sync"] = {"skipped": "needs two GPUs"}
    finally:
        server.stop()
    rows = verdicts(r)
    r["verdicts"] = [
        dict(zip(("what", "measured", "ratio", "target"), row, strict=True)) for row in rows
    ]
    args.out.write_text(json.dumps(r, indent=2, default=str))
    print(f"\n{'what':34} {'measured':40} {'ratio':>16}  target")
    for what, measured, ratio, verdict in rows:
        print(f"{what:34} {measured:40} {ratio:>16}  {verdict}")
    print(f"\nwrote {args.out}")
    if failed := failed_parts(r):
        print(f"bench_rollout_gpu.py: failed parts: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
