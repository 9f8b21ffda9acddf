"""CUDA IPC weight sync on one GPU (colocated mode): the rollout server and the learner-side
sender (bench/gpu_sender.py --transport ipc, its own process) on GPU 0.

- After a sync the server reports the checksum of exactly the bytes the learner packed,
  generations change, and syncing the original weights back restores the original greedy
  outputs (every tensor reached its place in vLLM's fused parameters).
- An update whose handles cannot be opened is refused and the previous version keeps serving;
  the next good update loads.
- An update holding a NaN is refused (a 400 naming the tensor) before anything loads, and the
  previous version keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[(13 * i + 3 * j) % 256 for j in range(20)] for i in range(4)]
SENDER = Path(__file__).resolve().parents[2] / "bench" / "gpu_sender.py"


@pytest.fixture(scope="module")
def server(qwen3_dir, log_dir):
    from gpu_common import ServerProcess

    proc = ServerProcess(
        qwen3_dir,
        gpu="0",
        gpu_memory_utilization=0.3,  # the sender shares the GPU
        extra_args=["--no-enable-prefix-caching", "--enable-sleep-mode"],
        log_path=log_dir / "test_ipc_sync.server.log",
    )
    proc.start()
    yield proc
    proc.stop()


def send(server, model_dir, log_dir, *extra: str) -> tuple[int, dict]:
    from gpu_common import gpu_env

    argv = [sys.executable, str(SENDER), "--transport", "ipc", "--url", server.url,
            "--model", str(model_dir), "--bucket-mb", "256", *extra]  # fmt: skip
    proc = subprocess.run(argv, env=gpu_env("0"), capture_output=True, text=True, timeout=300)
    with (log_dir / "test_ipc_sync.sender.log").open("a") as f:
        f.write(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else {"stderr": proc.stderr[-3000:]})


def test_ipc_sync_replaces_the_weights_exactly(server, qwen3_dir, log_dir) -> None:
    """The reference for "the original weights" is the checkpoint loaded through another
    transport (``/weights/load_file``), on the same server, with the same request: a
    random-weight model's near-uniform logits make greedy tokens sensitive to anything else."""
    from gpu_common import Greedy, greedy

    def reload_checkpoint() -> Greedy:
        server.post("/weights/load_file", {"path": str(qwen3_dir)}).raise_for_status()
        return greedy(server, PROMPTS)

    original = reload_checkpoint()
    v0 = server.info()["weight_version"]
    rc, out = send(server, qwen3_dir, log_dir, "--perturb-seed", "1")
    assert rc == 0 and "responses" in out, out
    (resp,) = out["responses"]
    assert resp["weight_version"] == v0 + 1 and resp["num_tensors"] == 310
    assert resp["num_bytes"] == 2 * 596_049_920
    assert resp["checksum"] == pytest.approx(out["bucket_checksum"], rel=1e-9)
    assert resp["loader"] == "load_weights+verify"  # the layout's first update
    served = server.get("/weights/checksum").json()["checksum"]
    assert served == pytest.approx(out["reference_checksum"], rel=1e-9)
    changed = greedy(server, PROMPTS)
    assert not changed.matches(original), "the perturbed weights generate as before"
    rc, out = send(server, qwen3_dir, log_dir)  # the original weights back, over IPC
    assert rc == 0 and "responses" in out, out
    assert out["responses"][0]["loader"] == "direct"
    served = server.get("/weights/checksum").json()["checksum"]
    assert served == pytest.approx(out["reference_checksum"], rel=1e-9)
    restored = greedy(server, PROMPTS)
    again = reload_checkpoint()
    print("ipc restore vs file reload:", restored.mismatch(again) or "same", "| same tokens:",
          restored.tokens == again.tokens)  # fmt: skip
    assert restored.matches(again), restored.mismatch(again)


def test_unopenable_handles_keep_the_previous_version(server, qwen3_dir, log_dir) -> None:
    from gpu_common import greedy

    before, version = greedy(server, PROMPTS), server.info()["weight_version"]
    rc, out = send(server, qwen3_dir, log_dir, "--perturb-seed", "2", "--corrupt-handle")
    assert rc == 0 and "previous weights still serve" in out.get("error", ""), out
    assert server.info()["weight_version"] == version
    after = greedy(server, PROMPTS)
    assert after.matches(before), after.mismatch(before)
    rc, out = send(server, qwen3_dir, log_dir, "--perturb-seed", "2")
    assert rc == 0 and out["responses"][0]["weight_version"] == version + 1, out
    assert not greedy(server, PROMPTS).matches(before)


def test_non_finite_weights_are_refused_and_the_previous_version_serves(
    server, qwen3_dir, log_dir
) -> None:
    from gpu_common import greedy

    before, version = greedy(server, PROMPTS), server.info()["weight_version"]
    checksum = server.get("/weights/checksum").json()["checksum"]
    name = "model.layers.3.mlp.down_proj.weight"
    rc, out = send(server, qwen3_dir, log_dir, "--perturb-seed", "3", "--nan-tensor", name)
    error = out.get("error", "")
    assert rc == 0 and "refused, the previous weights still serve" in error, out
    assert f"tensor '{name}' holds 1 non-finite values" in error and "HTTP 400" in error, out
    assert server.info()["weight_version"] == version
    assert server.get("/weights/checksum").json()["checksum"] == checksum
    after = greedy(server, PROMPTS)
    assert after.matches(before), after.mismatch(before)
