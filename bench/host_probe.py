"""How fast this host drives its GPUs: the facts to compare two benchmark runs' machines by.

A small model's GRPO step is largely bound by the host: Python and torch's dispatcher issuing
kernels (DeepSpeed ZeRO-3's per-module hooks most of all), and vLLM's scheduler. Two runs of
the same code on two hosts of the same GPU can differ by a third (docs/benchmarks.md: the e2e
step's generation phase on different hosts). This records, in a fresh subprocess (so the bench's own process never holds a
CUDA context on the GPUs its servers use):

- CPUs: ``os.cpu_count()``, the ones this process may run on, the cgroup quota, load average;
- ``python_call_ns``: one pure-Python function call (what a module hook costs, at least);
- ``torch_cpu_op_us``: one ``add_`` on a 1-element CPU tensor (the dispatcher);
- ``cuda_launch_us`` per visible GPU: one ``add_`` on a 1-element GPU tensor, issued
  back to back and synchronised once (launch throughput: the bound of a launch-bound step).

    python bench/host_probe.py            # prints the JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_PROBE = r"""
import json, os, time
import torch

def best(fn, n, reps=5):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(n)
        times.append((time.perf_counter() - t0) / n)
    return min(times)

def py_calls(n):
    f = lambda x: x
    for i in range(n):
        f(i)

x = torch.zeros(1)
def cpu_ops(n):
    for _ in range(n):
        x.add_(1)

out = {"python_call_ns": best(py_calls, 200_000) * 1e9,
       "torch_cpu_op_us": best(cpu_ops, 20_000) * 1e6, "cuda_launch_us": {}}
if torch.cuda.is_available():
    for d in range(torch.cuda.device_count()):
        y = torch.zeros(1, device=f"cuda:{d}")
        def gpu_ops(n, y=y, d=d):
            for _ in range(n):
                y.add_(1)
            torch.cuda.synchronize(d)
        gpu_ops(1000)  # warm-up: context, kernel load
        out["cuda_launch_us"][str(d)] = best(gpu_ops, 5_000) * 1e6
print(json.dumps(out))
"""


def _cgroup_cpu_quota() -> float | None:
    """CPUs the cgroup (v2 ``cpu.max``, else v1 ``cfs_quota``) allows, or None if unbounded."""
    v2 = Path("/sys/fs/cgroup/cpu.max")
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        q = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
        p = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if q.is_file() and p.is_file():
            quota_us = int(q.read_text())
            return None if quota_us < 0 else quota_us / int(p.read_text())
    except (OSError, ValueError):
        pass
    return None


def host_facts(timeout_s: float = 120.0) -> dict[str, Any]:
    """The host's CPU facts and its launch speeds (see the module's docstring); a probe that
    fails or times out is reported under ``probe_error`` rather than raised."""
    facts: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cgroup_cpu_quota": _cgroup_cpu_quota(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "CUDA_MODULE_LOADING": "LAZY"},
        )
        if proc.returncode != 0:
            facts["probe_error"] = proc.stderr.strip()[-500:] or f"exit {proc.returncode}"
        else:
            facts.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        facts["probe_error"] = f"{type(e).__name__}: {e}"
    return facts


if __name__ == "__main__":
    print(json.dumps(host_facts(), indent=2))
