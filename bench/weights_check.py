"""Whether the rollout servers served the learner's final weights, at the end of an e2e run.

The learner pushes its weights after every step, the last one included, so once its last step
is logged every server must serve exactly the weights the learner then saves as
``RUN_DIR/final``. Both sides are put into one number, ``rollout_server.weight_digest``'s
digest (every element weighted by its position and its tensor's name, in vLLM's fused name
space): the servers' ``GET /weights/checksum``, read while they still run, and the digest of
the saved ``final`` model's tensors, computed in a process of its own. They must agree to a
relative 1e-9 (float64 sums taken on different devices).

The servers a learner rank embeds (``rollout.embedded.per_rank``) are stopped by their rank
soon after its last step, and the bench knows neither their URLs nor their keys: each rank
itself reads its server's checksum right before it stops it and writes it to
``RUN_DIR/served_checksum.rank{k}.json`` (``learner.servers.embedded.record_served``), which
the bench reads (``served_by_ranks``).

    python3 bench/weights_check.py digest MODEL_DIR [--device cuda]   # prints DIGEST {...}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REL_TOL = 1e-9


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


def served_by_ranks(
    run_dir: Path, ranks: int, learner: subprocess.Popen | None, timeout_s: float
) -> list[dict]:
    """What each of ``ranks`` learner ranks recorded of its own server as the run ended
    (``RUN_DIR/served_checksum.rank{k}.json``), in ``read_served``'s form; waits up to
    ``timeout_s`` for them (each is written right after the rank's last step), or until the
    learner exits. A rank that wrote none: ``{url: "rank k", error}``."""
    paths = [run_dir / f"served_checksum.rank{k}.json" for k in range(ranks)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        if learner is not None and learner.poll() is not None:
            break
        time.sleep(0.1)
    out: list[dict[str, Any]] = []
    for k, path in enumerate(paths):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            out.append({"url": f"rank {k}", "error": f"no record of its server: {e}"})
            continue
        keep = ("url", "error") if "error" in record else ("url", "weight_version", "checksum")
        out.append({key: record[key] for key in keep})
    return out


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
