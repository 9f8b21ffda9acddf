"""Whether the rollout servers served the learner's final weights, at the end of an e2e run.

The learner pushes its weights after every step, the last one included, so once its last step
is logged every server must serve exactly the weights the learner then saves as
``RUN_DIR/final``. Both sides are put into one number, ``rollout_server.weight_digest``'s
digest (every element weighted by its position and its tensor's name, in vLLM's fused name
space): the servers' ``GET /weights/checksum``, read while they still run, and the digest of
the saved ``final`` model's tensors, computed in a process of its own. They must agree to a
relative 1e-9 (float64 sums taken on different devices).

The servers a learner rank embeds (``rollout.embedded.per_rank``) are not known to the bench
by URL: they are found among the run's processes (``proc_tree``), by their command line
(``rollout_server ... --port N``); their key reaches them through their environment, where the
bench, which started the whole tree, reads it for this one read-only request. Such a rank
stops its server soon after its last step, so the ranks are held (SIGSTOP, then SIGCONT)
while the servers are read (``learner_paused``).

    python3 bench/weights_check.py digest MODEL_DIR [--device cuda]   # prints DIGEST {...}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_tree import PROC, descendants, env_value, run_pids

REL_TOL = 1e-9
API_KEY_ENV = "ROLLOUT_API_KEY"  # rollout_server.settings.API_KEY_ENV


def read_served(servers: list[tuple[str, str | None]], timeout_s: float = 120.0) -> list[dict]:
    """``GET /weights/checksum`` of each ``(url, api key)``: ``{url, weight_version, checksum}``
    or ``{url, error}``."""
    import httpx

    out: list[dict[str, Any]] = []
    for url, key in servers:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            r = httpx.get(f"{url}/weights/checksum", headers=headers, timeout=timeout_s)
            if r.status_code != 200:
                out.append({"url": url, "error": f"HTTP {r.status_code}: {r.text[:300]}"})
                continue
            body = r.json()
            out.append({"url": url, "weight_version": body["weight_version"],
                        "checksum": body["checksum"]})  # fmt: skip
        except (httpx.HTTPError, ValueError, KeyError) as e:
            out.append({"url": url, "error": f"{type(e).__name__}: {e}"})
    return out


def _argv(pid: int, proc: Path = PROC) -> list[str]:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def embedded_servers(tag: str, proc: Path = PROC) -> list[tuple[str, str | None]]:
    """``(url, api key)`` of every rollout server among run ``tag``'s processes: its process
    whose command line names the ``rollout_server`` module and a ``--port`` (the leader, not
    vLLM's engine and workers, which carry no such argv)."""
    found: dict[int, tuple[str, str | None]] = {}
    for pid in run_pids(tag, proc=proc):
        argv = _argv(pid, proc)
        if "rollout_server" not in argv or "--port" not in argv:
            continue
        i = argv.index("--port")
        if i + 1 >= len(argv) or not argv[i + 1].isdigit():
            continue
        port = int(argv[i + 1])
        found[port] = (f"http://127.0.0.1:{port}", env_value(pid, API_KEY_ENV, proc))
    return [found[p] for p in sorted(found)]


def server_trees(tag: str, proc: Path = PROC) -> set[int]:
    """Run ``tag``'s rollout servers (``embedded_servers``' processes) and all they started
    (vLLM's engine and workers)."""
    leaders = []
    for pid in run_pids(tag, proc=proc):
        argv = _argv(pid, proc)
        if "rollout_server" in argv and "--port" in argv:
            leaders.append(pid)
    return descendants(leaders, proc)


@contextlib.contextmanager
def learner_paused(tag: str) -> Iterator[list[int]]:
    """Every process of run ``tag`` but its rollout servers' stopped (SIGSTOP) for the block,
    then continued: a learner rank that starts its own server stops it right after its last
    step and checkpoint, so the served weights are read with the ranks held still."""
    paused = sorted(run_pids(tag) - server_trees(tag))
    for pid in paused:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield paused
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)


def final_digest(model_dir: Path, env: dict[str, str], device: str, timeout_s: float) -> dict:
    """The digest of the saved model in ``model_dir`` (``digest`` below, in a process of its
    own: its memory is gone when it ends): ``{"checksum": x}`` or ``{"error": why}``."""
    if not any(Path(model_dir).glob("*.safetensors")):
        return {"error": f"no *.safetensors in {model_dir}: the learner saved no final model"}
    try:
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "digest", str(model_dir),
             "--device", device],
            env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"the digest of {model_dir} took over {timeout_s:.0f} s"}
    for line in out.stdout.splitlines():
        if line.startswith("DIGEST "):
            return json.loads(line.removeprefix("DIGEST "))
    return {"error": f"digest: rc {out.returncode}: {out.stderr[-1000:]}"}


def compare(served: list[dict[str, Any]], learner: dict[str, Any]) -> dict[str, Any]:
    """The record kept with a run: both sides, ``match`` (every server's checksum the
    learner's) and, when not, ``problem`` saying why."""
    out: dict[str, Any] = {"served": served, "learner": learner, "match": False}
    if not served:
        out["problem"] = "no rollout server's weights were read"
    elif errors := [f"{s['url']}: {s['error']}" for s in served if "error" in s]:
        out["problem"] = "served weights not read: " + "; ".join(errors)
    elif "error" in learner:
        out["problem"] = f"learner's final weights: {learner['error']}"
    else:
        want = float(learner["checksum"])
        off = [s for s in served if abs(s["checksum"] - want) > REL_TOL * max(1.0, abs(want))]
        if off:
            out["problem"] = "served weights differ from the learner's final ones: " + "; ".join(
                f"{s['url']} serves {s['checksum']!r} (version {s['weight_version']}), the "
                f"learner saved {want!r}"
                for s in off
            )
        else:
            out["match"] = True
    return out


def learner_final_check(
    learner: subprocess.Popen | None,
    served: list[dict[str, Any]],
    final: Path,
    *,
    cpu: bool,
    timeout_s: float,
) -> dict[str, Any]:
    """``served`` against the learner's final weights (``compare``): the learner first ends by
    itself, saving its last checkpoint and ``final``, within ``timeout_s``; the digest of
    ``final`` is then taken on GPU 0 (free once the learners ended), or the CPU (``cpu``)."""
    from gpu_common import gpu_env

    t0 = time.monotonic()
    rc = None
    if learner is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = learner.wait(timeout=timeout_s)
    if rc is None:
        learner_side = {"error": f"the learner was still running {timeout_s:g} s after its last "
                        "step: its final weights were not saved in time"}  # fmt: skip
    elif rc != 0:
        learner_side = {"error": f"the learner exited with code {rc} after its last step"}
    else:
        env = gpu_env(None if cpu else "0")
        learner_side = final_digest(final, env, "cpu" if cpu else "cuda", timeout_s)
    out = compare(served, learner_side)
    out["learner_finish_s"] = round(time.monotonic() - t0, 3)
    return out


def digest(model_dir: Path, device: str) -> dict[str, Any]:
    """``named_checksum`` over every tensor of the model's safetensors files, on ``device``
    (the same name space and weights as the servers' ``GET /weights/checksum``)."""
    import torch
    from safetensors.torch import load_file

    from rollout_server.weight_digest import named_checksum

    dev = torch.device(device if device != "cuda" or torch.cuda.is_available() else "cpu")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors |= {k: v.to(dev) for k, v in load_file(str(f)).items()}
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return {"checksum": named_checksum(tensors.items()), "tensors": len(tensors),
            "dtypes": dtypes, "device": str(dev)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("digest", help="the digest of a saved model's weights")
    d.add_argument("model_dir", type=Path)
    d.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    print("DIGEST " + json.dumps(digest(args.model_dir, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
