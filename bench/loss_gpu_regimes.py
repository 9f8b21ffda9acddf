"""How the loss bench's figures depend on the GPU's state (CUDA only): power cap, idle, host.

    python bench/loss_gpu_regimes.py regimes fused full-trl   # median ms four ways, both heads
    python bench/loss_gpu_regimes.py clocks 0.6b fused        # per-call ms + nvidia-smi samples
    python bench/loss_gpu_regimes.py prologue                 # fused: GPU idle before its work
    python bench/loss_gpu_regimes.py ab MODULE.FLAG [HEAD] [VARIANT]  # a module flag on / off

`regimes`: back to back (as bench_loss_gpu.py times), after 0.3 s of idle GPU, behind an 8 ms
`torch.cuda._sleep` queued first (the host's set-up hidden, as behind a model's forward), both.
`clocks`: 20 calls back to back while nvidia-smi samples SM clock, power and the clock event
reasons every 25 ms (0x4: software power cap). `prologue`: CUDA events around
`FusedLinearLoss.forward` and after the chunk engine's set-up: how long the GPU waits for the
host at the start of a call. `ab MODULE.FLAG`: the fused loss with a module-level boolean
True and False in turn (4 rounds of 3 calls each way, back to back and after 0.3 s idle), so
that both see the same machine and the same power cap; its "back to back" calls follow idle
ones, so they read lower than bench_loss_gpu.py's steady state (only the difference counts).
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_loss_gpu", ROOT / "bench/bench_loss_gpu.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)  # type: ignore[union-attr]
SHAPES = {"0.6b": (1024, 16, 2048), "8b": (4096, 8, 4096)}


def _timed(fn, inputs, prime_ms=0.0, cool=0.0):
    h, w = inputs[:2]
    h.grad = w.grad = None
    torch.cuda.synchronize()
    if cool:
        time.sleep(cool)
    if prime_ms:
        torch.cuda._sleep(int(prime_ms * 1.75e6))  # cycles at ~1.75 GHz
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def regimes(variants):
    ways = {
        "back-to-back": {}, "cooled 0.3 s": {"cool": 0.3}, "primed 8 ms": {"prime_ms": 8},
        "primed+cooled": {"prime_ms": 8, "cool": 0.3},
    }  # fmt: skip
    for head, (hd, b, t) in SHAPES.items():
        inputs = B.make_inputs(b, t, hd)
        for name in variants:
            fn = B.VARIANTS[name]
            _timed(fn, inputs)
            _timed(fn, inputs)
            ms = {k: statistics.median(_timed(fn, inputs, **kw) for _ in range(7))
                  for k, kw in ways.items()}  # fmt: skip
            print(f"{head} {name:9s} " + "  ".join(f"{k}: {v:.1f}" for k, v in ms.items()))
        del inputs
        torch.cuda.empty_cache()


def clocks(head, variants):
    hd, b, t = SHAPES[head]
    inputs = B.make_inputs(b, t, hd)
    query = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    for name in variants:
        fn = B.VARIANTS[name]
        _timed(fn, inputs)
        _timed(fn, inputs)
        time.sleep(1.0)
        cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "25"]
        mon = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        times = [round(_timed(fn, inputs), 1) for _ in range(20)]
        time.sleep(0.1)
        mon.terminate()
        samples = mon.communicate()[0].strip().splitlines()
        print(f"{head} {name} ms a call, back to back: {times}")
        for line in samples[:: max(1, len(samples) // 25)]:
            print("   ", line)


def prologue():
    import learner.loss.fused as fl
    import learner.loss.kernels.triton_fused as tf

    marks = {}
    init, forward = tf.TritonChunks.__init__, fl.FusedLinearLoss.forward

    def event():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def traced_init(self, *a, **k):
        init(self, *a, **k)
        marks["engine"] = event()

    def traced_forward(ctx, *a):
        marks["forward"] = event()
        out = forward(ctx, *a)
        marks["forward_end"] = event()
        return out

    tf.TritonChunks.__init__ = traced_init
    fl.FusedLinearLoss.forward = staticmethod(traced_forward)
    for head, (hd, b, t) in SHAPES.items():
        inputs = B.make_inputs(b, t, hd)
        h, w = inputs[:2]
        rows = []
        for i in range(9):
            h.grad = w.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start = event()
            B.run_fused(*inputs)
            end = event()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            if i >= 2:  # after warm-up and autotuning
                rows.append((
                    start.elapsed_time(marks["forward"]), start.elapsed_time(marks["engine"]),
                    marks["forward_end"].elapsed_time(end), start.elapsed_time(end), host * 1e3,
                ))  # fmt: skip
        fwd, engine, tail, total, host = (statistics.median(c) for c in zip(*rows, strict=True))
        print(f"{head}: GPU ms from the call's start to FusedLinearLoss.forward {fwd:.2f}, to the "
              f"chunk engine set up {engine:.2f}, from the forward's end to the call's "
              f"end {tail:.2f}; call {total:.1f} ms, host {host:.1f} ms")  # fmt: skip
        del inputs
        torch.cuda.empty_cache()


def ab(flag: str, heads: list[str], variant: str = "fused"):
    mod_name, attr = flag.rsplit(".", 1)
    mod = importlib.import_module(mod_name)
    if not isinstance(getattr(mod, attr), bool):
        raise SystemExit(f"{flag} is not a boolean flag")
    keep = getattr(mod, attr)
    fn = B.VARIANTS[variant]
    try:
        for head in heads:
            hd, b, t = SHAPES[head]
            inputs = B.make_inputs(b, t, hd)
            res = {(v, c): [] for v in (True, False) for c in (0.0, 0.3)}
            for _ in range(4):
                for value in (True, False):
                    setattr(mod, attr, value)
                    _timed(fn, inputs)
                    for cool in (0.0, 0.3):
                        res[value, cool] += [_timed(fn, inputs, cool=cool) for _ in range(3)]
            for value in (True, False):
                print(f"{head} {variant} {flag}={value}: back to back "
                      f"{statistics.median(res[value, 0.0]):.2f} ms, 0.3 s idle first "
                      f"{statistics.median(res[value, 0.3]):.2f} ms", flush=True)  # fmt: skip
            del inputs
            torch.cuda.empty_cache()
    finally:
        setattr(mod, attr, keep)


def main():
    what, args = sys.argv[1], sys.argv[2:]
    if what == "regimes":
        regimes(args or ["fused", "full-trl"])
    elif what == "clocks":
        clocks(args[0], args[1:] or ["fused", "full-trl"])
    elif what == "prologue":
        prologue()
    elif what == "ab":
        heads = [a for a in args[1:] if a in SHAPES] or list(SHAPES)
        variants = [a for a in args[1:] if a in B.VARIANTS] or ["fused"]
        ab(args[0], heads, variants[0])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
