"""Which process held which GPU, before and after a benchmark run, so that an orphan cannot hide.

``nvidia-smi --query-compute-apps`` lists every process with a CUDA context, by GPU UUID;
``--query-gpu=index,uuid`` maps the UUIDs to the indices the runs name. Each holder is
recorded with its pid, process name, memory and, where this host's /proc shows it, its
command line and run marker (``proc_tree``: whether one of the benchmark's own runs started
it). A run is measured on GPUs nobody else holds: a holder on one of the GPUs the run may use,
before it starts, or still there after it ended, makes the result not valid (``problems``).

    python3 bench/gpu_holders.py        # this machine's holders now, as JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_tree import describe

APPS_QUERY = ("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
              "--format=csv,noheader,nounits")  # fmt: skip
GPUS_QUERY = ("nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader")


def _csv(argv: tuple[str, ...]) -> list[list[str]]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])}: rc {out.returncode}: {out.stderr.strip()[:300]}")
    return [
        [c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()
    ]


def snapshot() -> dict[str, Any]:
    """Every GPU (index -> UUID) and every process holding one now; ``{"available": False,
    "error": why}`` where nvidia-smi cannot say (no GPU driver: the CPU runs)."""
    try:
        gpus = {uuid: index for index, uuid, *_ in _csv(GPUS_QUERY)}
        apps = _csv(APPS_QUERY)
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        return {"available": False, "error": f"{type(e).__name__}: {e}"}
    holders = []
    for row in apps:
        if len(row) < 4 or not row[0].isdigit():
            continue
        pid, name, mib, uuid = int(row[0]), row[1], row[2], row[3]
        seen = describe(pid)
        holders.append({
            "gpu": gpus.get(uuid, "?"), "gpu_uuid": uuid, "pid": pid, "process_name": name,
            "used_mib": int(mib) if mib.isdigit() else None,
            "cmd": seen["cmd"] or None, "run": seen["run"],
        })  # fmt: skip
    return {"available": True, "gpus": {i: u for u, i in gpus.items()}, "holders": holders}


def watched_gpus(gpus: dict[str, str]) -> set[str]:
    """The indices of ``gpus`` (index -> UUID) this process's children may use:
    ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) where set, else all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return set(gpus)
    names = [v.strip() for v in visible.split(",") if v.strip()]
    by_uuid = {u: i for i, u in gpus.items()}
    return {n if n in gpus else by_uuid.get(n, n) for n in names}


def _holder(h: dict[str, Any]) -> str:
    mem = f", {h['used_mib']} MiB" if h.get("used_mib") is not None else ""
    ours = f", run {h['run']}" if h.get("run") else ""
    return f"GPU {h['gpu']} held by pid {h['pid']} ({h['process_name']}{mem}{ours})"


def problems(before: dict[str, Any], after: dict[str, Any], *, on_gpus: bool) -> list[str]:
    """Why the run between the two snapshots is not valid: any process on a watched GPU
    before it started or after it ended; on a GPU run (``on_gpus``), a snapshot nvidia-smi
    could not take (the holders would be unknown)."""
    out: list[str] = []
    for when, snap in (("before the run", before), ("after the run", after)):
        if not snap.get("available"):
            if on_gpus:
                out.append(f"GPU holders unknown {when}: {snap.get('error')}")
            continue
        watched = watched_gpus(snap.get("gpus") or {})
        out += [f"{_holder(h)} {when}" for h in snap["holders"] if h["gpu"] in watched]
    return out


def record(before: dict[str, Any], after: dict[str, Any], *, on_gpus: bool) -> dict[str, Any]:
    """What a result keeps: the query, both snapshots and the problems they show."""
    return {
        "query": " ".join(APPS_QUERY),
        "before": before,
        "after": after,
        "problems": problems(before, after, on_gpus=on_gpus),
    }


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1))
