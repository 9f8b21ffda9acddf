"""NCCL weight sync on two GPUs: the rollout server on GPU 1 (its own process,
``CUDA_VISIBLE_DEVICES=1``), the learner's ``NcclWeightSender`` on GPU 0 (bench/gpu_sender.py,
a subprocess so it can be killed mid-sync).

- After a sync the server reports the learner's digest of exactly the sent bytes, generations
  change, and syncing the original weights back restores the original greedy outputs (so every
  tensor reached the right place in vLLM's fused, renamed parameters).
- A sync whose sender dies after the first bucket leaves the previous version serving, and a
  new sender can form the group again and sync.
- A prepared sync (receives queued before the broadcast) loads the same exact weights, copied
  into the parameters segment by segment as they land; while it is prepared generations wait
  (then run on the new weights) and sleep is refused; a learner that dies part way through
  one, or right after preparing, leaves exactly the old weights serving (the server restores
  the parameters it saved), and the next learner syncs.
- A learner that restarts after its dead predecessor posted a commit does not wait for that
  commit's timeout: its init cancels the commit (the workers' CancelFlag) and it syncs at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[(11 * i + 5 * j) % 256 for j in range(20)] for i in range(4)]
SENDER = Path(__file__).resolve().parents[2] / "bench" / "gpu_sender.py"


@pytest.fixture(scope="module")
def server(qwen3_dir, log_dir):
    from gpu_common import ServerProcess, gpu_count

    if gpu_count() < 2:
        pytest.skip("NCCL weight sync needs two GPUs")
    proc = ServerProcess(
        qwen3_dir,
        gpu="1",
        extra_args=["--no-enable-prefix-caching"],  # greedy comparisons across calls (see there)
        log_path=log_dir / "test_nccl_sync.server.log",
    )
    proc.start()
    yield proc
    proc.stop()


def send(server, model_dir, *, perturb_seed=None, timeout_s=60.0, log_dir=None, **flags):
    """Run one learner-side sync in a subprocess on GPU 0; return (returncode, summary).
    ``flags``: gpu_sender.py's switches, true to pass (``die`` is --die-after-first-bucket;
    prepare, die_after_prepare, early, broken_stream_first)."""
    from gpu_common import gpu_env

    from grpo_common.net import free_port

    argv = [
        sys.executable,
        str(SENDER),
        "--url",
        server.url,
        "--model",
        str(model_dir),
        "--master-port",
        str(free_port()),
        "--timeout-s",
        str(timeout_s),
        "--bucket-mb",
        "256",
    ]
    if perturb_seed is not None:
        argv += ["--perturb-seed", str(perturb_seed)]
    names = {"die": "die_after_first_bucket"}
    argv += ["--" + names.get(k, k).replace("_", "-") for k, on in flags.items() if on]
    proc = subprocess.run(argv, env=gpu_env("0"), capture_output=True, text=True, timeout=300)
    if log_dir is not None:
        with (log_dir / "test_nccl_sync.sender.log").open("a") as f:
            f.write(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else {"stderr": proc.stderr[-3000:]})


def test_sync_replaces_the_weights_exactly(server, qwen3_dir, log_dir) -> None:
    from gpu_common import Greedy, greedy

    def reload_checkpoint() -> Greedy:
        """The transport-independent reference (as in test_ipc_sync.py): the checkpoint loaded
        through ``/weights/load_file``; a random model's near-tied greedy tokens can differ from
        the very first generation of a fresh server (seen once on 2xH200)."""
        server.post("/weights/load_file", {"path": str(qwen3_dir)}).raise_for_status()
        return greedy(server, PROMPTS)

    original = reload_checkpoint()
    version = server.info()["weight_version"]
    rc, out = send(server, qwen3_dir, perturb_seed=1, log_dir=log_dir)
    assert rc == 0, out
    (resp,) = out["responses"]
    assert resp["weight_version"] == version + 1 and resp["num_tensors"] == 310
    assert resp["num_bytes"] == 2 * 596_049_920  # Qwen3-0.6B parameters (tied), bf16
    # The server's checksum is of the bytes it received, by bucket and position (the sender
    # already compared it with what it sent); the buckets packed apart in gpu_sender agree.
    assert resp["checksum"] == pytest.approx(out["bucket_checksum"], rel=1e-9)
    assert server.info()["weight_version"] == version + 1
    # ... and the weights vLLM now serves (fused q/k/v, gate/up) have the learner's digest of
    # its parameters, by name and position (a tensor in the wrong place would change it);
    # the first update of this layout went through vLLM's loader and verified the copy plan
    assert resp["loader"] == "load_weights+verify"
    served = server.get("/weights/checksum").json()
    assert served["checksum"] == pytest.approx(out["reference_checksum"], rel=1e-9)
    changed = greedy(server, PROMPTS)
    assert not changed.matches(original), "the perturbed weights generate as before"
    rc, out = send(server, qwen3_dir, log_dir=log_dir)  # the original weights, back over NCCL
    assert rc == 0, out
    assert out["responses"][0]["weight_version"] == version + 2
    assert out["responses"][0]["loader"] == "direct"  # copied straight into the parameters
    served = server.get("/weights/checksum").json()
    assert served["checksum"] == pytest.approx(out["reference_checksum"], rel=1e-9)
    restored = greedy(server, PROMPTS)
    again = reload_checkpoint()
    assert restored.matches(again), restored.mismatch(again)


def test_interrupted_sync_keeps_the_previous_version(server, qwen3_dir, log_dir) -> None:
    from gpu_common import greedy

    before_version = server.info()["weight_version"]
    before = greedy(server, PROMPTS)
    start = time.monotonic()
    rc, out = send(server, qwen3_dir, perturb_seed=2, die=True, timeout_s=20.0, log_dir=log_dir)
    assert rc == 3 and out == {"died_after_bucket": 0}, out
    # The server gives up after the group's timeout (20 s) and aborts the group; until then a
    # generation waits behind the update, it never sees half-loaded weights.
    after = greedy(server, PROMPTS)
    assert after.matches(before), after.mismatch(before)
    assert time.monotonic() - start < 120
    assert server.info()["weight_version"] == before_version
    # A new learner forms the group again and syncs.
    rc, out = send(server, qwen3_dir, perturb_seed=2, log_dir=log_dir)
    assert rc == 0, out
    assert out["responses"][0]["weight_version"] == before_version + 1
    assert not greedy(server, PROMPTS).matches(before)


def test_prepared_sync(server, qwen3_dir, log_dir) -> None:
    from gpu_common import greedy

    version = server.info()["weight_version"]
    before = greedy(server, PROMPTS)
    rc, out = send(server, qwen3_dir, perturb_seed=5, prepare=True, log_dir=log_dir)
    assert rc == 0, out
    probe = out["while_prepared"]
    assert probe["generate_waited"], probe  # a generation waits behind the prepared update
    assert probe["generated_version"] == version + 1, probe  # ... and runs on the new weights
    assert probe["sleep_status"] == 409 and "prepared" in probe["sleep_detail"], probe
    assert out["stats"]["prepared"] == 1.0
    (resp,) = out["responses"]
    assert resp["weight_version"] == version + 1
    assert resp["checksum"] == pytest.approx(out["bucket_checksum"], rel=1e-9)
    # the layout's copy plan was verified by the earlier tests: copied in as it landed
    assert resp["loader"] == "direct-overlapped"
    served = server.get("/weights/checksum").json()
    perturbed_checksum = out["reference_checksum"]
    assert served["checksum"] == pytest.approx(perturbed_checksum, rel=1e-9)
    perturbed = greedy(server, PROMPTS)
    assert not perturbed.matches(before)

    # A learner that dies part way through a prepared update: its first bucket was already
    # copied into the parameters; the server puts back the ones it saved at prepare.
    rc, out = send(server, qwen3_dir, perturb_seed=7, prepare=True, die=True, timeout_s=15.0,
                   log_dir=log_dir)  # fmt: skip
    assert rc == 3 and out == {"died_after_bucket": 0}, out
    after = greedy(server, PROMPTS)  # waits for the failed commit or the expiry (15 s)
    assert after.matches(perturbed), after.mismatch(perturbed)
    assert server.info()["weight_version"] == version + 1
    served = server.get("/weights/checksum").json()
    assert served["checksum"] == pytest.approx(perturbed_checksum, rel=1e-9)

    # A learner that dies with its update prepared: other updates are refused, generations
    # wait until the update expires (the group's timeout, 15 s), then run on the old weights.
    start = time.monotonic()
    rc, out = send(server, qwen3_dir, perturb_seed=6, prepare=True, die_after_prepare=True,
                   timeout_s=15.0, log_dir=log_dir)  # fmt: skip
    assert rc == 3, out
    refused = server.post("/weights/load_file", {"path": str(qwen3_dir)})
    assert refused.status_code == 409 and "prepared" in refused.json()["detail"]
    after = greedy(server, PROMPTS)
    assert time.monotonic() - start >= 10, "the generation did not wait for the expiry"
    assert after.matches(perturbed), after.mismatch(perturbed)
    assert server.info()["weight_version"] == version + 1
    served = server.get("/weights/checksum").json()
    assert served["checksum"] == pytest.approx(perturbed_checksum, rel=1e-9)
    # The next learner forms the group again and syncs (the original weights, prepared; staged
    # afresh, "direct": the expired update's receives were aborted, so its buffers were dropped),
    # returning on the workers' NCCL acknowledgement: a generation asked right then already
    # runs on the new version, and the HTTP answers come after.
    rc, out = send(server, qwen3_dir, prepare=True, early=True, log_dir=log_dir)
    assert rc == 0, out
    assert out["early"]["returned"] is False and out["early"]["generated_version"] == version + 2
    assert out["responses"][0]["weight_version"] == version + 2
    assert out["responses"][0]["loader"] == "direct"
    served = server.get("/weights/checksum").json()
    assert served["checksum"] == pytest.approx(out["reference_checksum"], rel=1e-9)


def test_a_new_learner_cancels_the_commit_a_dead_one_left(server, qwen3_dir, log_dir) -> None:
    """The dead learner's group timeout is 240 s; the next learner's init cancels its waiting
    commit at once, so the whole next sync (a fresh process: imports, model, group) ends well
    before that, on exactly the weights it sent."""
    version = server.info()["weight_version"]
    rc, out = send(server, qwen3_dir, perturb_seed=8, prepare=True, die_after_prepare=True,
                   timeout_s=240.0, log_dir=log_dir)  # fmt: skip
    assert rc == 3 and out == {"died_after_prepare": True}, out
    start = time.monotonic()
    rc, out = send(server, qwen3_dir, prepare=True, timeout_s=240.0, log_dir=log_dir)
    took = time.monotonic() - start
    assert rc == 0, out
    assert took < 150, f"the next sync took {took:.0f} s: it waited for the dead one's commit"
    (resp,) = out["responses"]
    assert resp["weight_version"] == version + 1  # the cancelled commit moved nothing
    served = server.get("/weights/checksum").json()
    assert served["checksum"] == pytest.approx(out["reference_checksum"], rel=1e-9)
    log = (log_dir / "test_nccl_sync.server.log").read_text()
    assert "init: cancelled the commit of prepared NCCL update" in log


def test_broken_tensor_stream_keeps_weights_and_group(server, qwen3_dir, log_dir) -> None:
    """The learner's stream fails after one tensor: commit word 0, every worker acknowledges 0
    and keeps its weights, the send raises the stream's error, and the same group then
    carries a good update."""
    version = server.info()["weight_version"]
    before = server.get("/weights/checksum").json()["checksum"]
    rc, out = send(server, qwen3_dir, perturb_seed=9, broken_stream_first=True, log_dir=log_dir)
    assert rc == 0, out
    assert "broke on purpose" in out["broken_stream_error"], out
    (resp,) = out["responses"]
    assert resp["weight_version"] == version + 1  # only the good update moved it
    assert resp["checksum"] == pytest.approx(out["bucket_checksum"], rel=1e-9)
    served = server.get("/weights/checksum").json()["checksum"]
    assert served == pytest.approx(out["reference_checksum"], rel=1e-9) and served != before
