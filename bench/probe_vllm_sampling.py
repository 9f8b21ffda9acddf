"""What the rollout server's per-request options cost vLLM at the end-to-end GRPO batch size.

    python bench/probe_vllm_sampling.py --model DIR --out probe.json [--vllm-arg K=V ...]

One offline ``vllm.LLM`` built from the server's own engine arguments
(``rollout_server.engine.vllm_engine.engine_kwargs``, plus any ``--vllm-arg``, e.g.
``async_scheduling=true``, read as ``rollout-server --vllm-arg`` reads it), then the e2e
workload (16 prompts × n=8 × 256 tokens, ignore_eos so every run generates the same 32,768
tokens; random 40-token prompts) with the server's sampling parameters (``sampling_kwargs``: the
sampled token's log-prob in vLLM's flat form, detokenized text) and with one thing changed:
``dict-logprobs`` (a dict and a ``Logprob`` per token, as the server asked before),
``detokenize=False`` (token ids only; the text would be decoded once at the end),
``logprobs=None``, or both of the last two. Each variant runs with the startup heap frozen out
of the garbage collector (as the server runs) and not (as a plain script runs): one warm-up,
then ``--repeats`` timed runs, interleaved (round robin) so that clock and host drift spread
over all of them. Prints a table of median seconds per batch and tokens/s, and writes the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS: dict[str, dict[str, Any]] = {
    "server": {},
    "dict-logprobs": {"flat_logprobs": False},  # the server before it asked for flat log-probs
    "no-detokenize": {"detokenize": False},
    "no-logprobs": {"logprobs": None},
    "neither": {"detokenize": False, "logprobs": None},
}
GC_MODES = ("frozen", "unfrozen")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="K=V", help="as rollout-server's"
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument(
        "--gc",
        choices=[*GC_MODES, "both"],
        default="both",
        help="frozen: the startup heap kept out of the garbage collector (gc.freeze, as the "
        "server does); unfrozen: as a plain script; both: each variant both ways, interleaved",
    )
    args = p.parse_args(argv)

    from vllm import LLM, EngineArgs, SamplingParams

    from rollout_server.cli import vllm_arg
    from rollout_server.engine.vllm_engine import (
        engine_kwargs,
        served_sampling_kwargs,
        supported_kwargs,
    )
    from rollout_server.protocol import SamplingParams as OurParams
    from rollout_server.settings import ServerSettings

    extra = dict(vllm_arg(item) for item in args.vllm_arg)
    settings = ServerSettings(
        model=args.model,
        engine="vllm",
        gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_engine_args=extra,
    )
    kwargs = engine_kwargs(settings)
    kwargs.pop("worker_extension_cls", None)  # no weight sync here
    unknown = sorted(set(extra) - set(supported_kwargs(EngineArgs, kwargs)))
    if unknown:
        p.error(f"this vLLM has no engine argument(s) {unknown}")
    llm = LLM(**kwargs)
    base = served_sampling_kwargs(
        OurParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0), args.n
    )
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(40)]}
        for _ in range(args.prompts)
    ]
    tokens = args.prompts * args.n * args.max_tokens
    variants = {
        n: o for n, o in VARIANTS.items() if "flat_logprobs" not in o or "flat_logprobs" in base
    }
    params = {name: SamplingParams(**(base | over)) for name, over in variants.items()}
    gc_modes = GC_MODES if args.gc == "both" else (args.gc,)
    runs = [(name, mode) for mode in gc_modes for name in params]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for sp in params.values():  # warm-up
        llm.generate(prompts, sp, use_tqdm=False)
    for _ in range(args.repeats):
        for name, mode in runs:
            _set_gc(mode)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params[name], use_tqdm=False)
            times[name, mode].append(time.perf_counter() - t0)
            got = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if got != tokens:
                raise SystemExit(f"{name}: {got} tokens generated, expected {tokens}")
    _set_gc("unfrozen")
    rows = []
    for (name, mode), ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "gc": mode, "sampling": variants[name], "median_s": med,
                     "all_s": ts, "tokens_per_s": tokens / med})  # fmt: skip
    print(f"engine args: {extra or 'the server defaults'}; {tokens} tokens a batch")
    print(f"server sampling: {base}")
    print(f"{'variant':16} {'gc':9} {'median s':>9} {'tokens/s':>9} {'vs server':>9}")
    ref = rows[0]["median_s"]
    for r in rows:
        print(
            f"{r['variant']:16} {r['gc']:9} {r['median_s']:>9.3f} {r['tokens_per_s']:>9.0f} "
            f"{ref / r['median_s']:>8.2f}x"
        )
    import torch
    import vllm

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "engine_args": extra,
                "server_sampling": base,
                "tokens_per_batch": tokens,
                "rows": rows,
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
            },
            indent=2,
        )
    )
    return 0


def _set_gc(mode: str) -> None:
    """Frozen: what the server does once its engine is ready (``ServerSettings.gc_freeze``)."""
    if mode == "frozen":
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()


if __name__ == "__main__":
    raise SystemExit(main())
