"""GRPO against a stock ``vllm serve`` (no code of ours on the server; docs/vllm-serve.md):
``rollout.server_api = "vllm"`` and ``[rollout.sync] type = "vllm"``, with vLLM's NCCL engine to
a server on its own GPU and with its IPC engine to one on the learner's GPU (colocated).

Each run trains 5 steps. After every sync the server serves the learner's weights: the samples'
truncated importance weights (``is_weight``: exp(learner log-prob − server log-prob), clamped)
stay at 1 within bf16 noise every step that trains, where a server a sync missed would drift
from it (a step whose groups all drew equal rewards trains no token and has none). After
the last one the stock server's greedy continuations are those of our own vLLM server loading the
learner's saved final model from disk, and not those of the base model it started from.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# over the suite's 300 s per test: a stock vLLM server's start and a run allowed 900 s
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1000)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
PROBES = [[100 + 7 * i + j for j in range(12)] for i in range(4)]
IS_WEIGHT_TOL = 0.05  # |is_weight - 1| per step: bf16 logits of vLLM and of the learner
# printed per step by the delegation test, to tell a sync that did not load from a policy change
DIAGNOSTICS = ("is_weight", "ratio_mean", "loss", "grad_norm", "entropy", "completion/len_mean",
               "completion/truncated_frac", "reward/mean", "reward/std", "staleness",
               "weight_version")  # fmt: skip
MIN_TRAINED_STEPS = 3  # of the STEPS: the policy must move (and the syncs carry it) for a while


def _drift(records: list[dict]) -> list[float]:
    """|is_weight - 1| of every step that trained a token. A step whose groups all drew equal
    rewards trains none and has no ``is_weight`` (the policy collapsed onto one completion: it
    happened at step 4 of a run at this learning rate); at least MIN_TRAINED_STEPS must train."""
    trained = [r for r in records if "is_weight" in r]
    assert len(trained) >= MIN_TRAINED_STEPS, [r.get("reward/std") for r in records]
    return [abs(r["is_weight"] - 1) for r in trained]


def _run(
    model: Path, url: str, backend: str, gpus: str, run_dir: Path, log: Path, api: str = "vllm"
) -> None:
    from gpu_common import API_KEY, gpu_env

    sets = [
        f'model.name_or_path="{model}"',
        'model.dtype="bfloat16"',  # what vllm serve holds the model in ("auto": its config's)
        f'rollout.servers=["{url}"]',
        f'rollout.server_api="{api}"',
        f'rollout.sync={{type = "vllm", backend = "{backend}"}}',
        f"run.steps={STEPS}",
        "run.progress_bar=false",
        # no cliff: 32 tokens of the longest (16-character) added token stay under 2 x target
        'rewards=[{name="length", kwargs={unit="chars", target=300}}]',
        # the demo's 3e-3 suits its hidden-64 model; at this width it collapses the policy onto
        # one long added token within three steps (every reward then equal). 1e-4 still moves
        # the bf16 weights the server holds in 5 steps
        "optim.lr=1e-4",
        "sampling.max_tokens=32",
        "grpo.tis_cap=2.0",
        "eval.max_prompts=4",
    ]
    if backend == "ipc":
        sets.append("rollout.sleep_while_training=1")  # the server's GPU is the learner's
    cmd = [sys.executable, "-m", "learner", "--config", str(ROOT / "learner/configs/demo.toml"),
           "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]  # fmt: skip
    env = gpu_env(gpus, ROLLOUT_API_KEY=API_KEY)  # our server's key; vllm serve has none
    with log.open("w") as out:  # written as it runs: a run cut by a timeout leaves its log
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=out, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_grpo_against_a_stock_vllm_serve(qwen3_text_dir, log_dir, tmp_path, backend):
    from gpu_common import ServerProcess, VllmServeProcess, gpu_count

    from learner.run.metrics import read_metrics

    if backend == "nccl" and gpu_count() < 2:
        pytest.skip("the NCCL layout puts the server on a second GPU")
    if backend == "ipc" and importlib.util.find_spec("ray") is None:  # before a server's start
        pytest.fail("vLLM's IPC weight-transfer engine imports ray, not installed here")
    gpu = "1" if backend == "nccl" else "0"
    server = VllmServeProcess(
        qwen3_text_dir,
        backend=backend,
        gpu=gpu,
        gpu_memory_utilization=0.3,
        extra_args=["--enable-sleep-mode"] if backend == "ipc" else [],
        log_path=log_dir / f"test_vllm_serve.{backend}.server.log",
    )
    with server:
        base = server.greedy(PROBES)
        run_dir = tmp_path / backend
        log = log_dir / f"test_vllm_serve.{backend}.log"
        _run(qwen3_text_dir, server.url, backend, "0", run_dir, log)
        served = server.greedy(PROBES)
    records = read_metrics(run_dir)
    assert [r["weight_version"] for r in records] == list(range(1, STEPS + 1))
    drift = _drift(records)
    print(f"{backend}: step times {[round(r['time/step'], 2) for r in records]} s, "
          f"|is_weight - 1| {[round(d, 4) for d in drift]}")  # fmt: skip
    assert max(drift) <= IS_WEIGHT_TOL, drift
    with ServerProcess(
        run_dir / "final", gpu=gpu, gpu_memory_utilization=0.3,
        log_path=log_dir / f"test_vllm_serve.{backend}.reference.log",
    ) as ours:  # fmt: skip
        from gpu_common import greedy

        want = greedy(ours, PROBES)
    assert served.matches(want), served.mismatch(want)
    assert not base.matches(want), "the training moved no greedy log-prob: nothing was synced"


@pytest.mark.parametrize("sleep_mode", [True, False], ids=["sleep_mode", "no_sleep_mode"])
def test_our_server_delegates_to_vllms_nccl_engine(qwen3_text_dir, log_dir, tmp_path, sleep_mode):
    """Our server started with ``--weight-transfer-backend nccl`` hands vLLM's RL routes to
    vLLM's own engine (and versions each update): the same 5-step run over ``type = "vllm"``
    ends with its weights those of the saved model (the served weights' checksum, and greedy
    continuations), its version the learner's, and each step's importance weight near 1. With
    and without vLLM's sleep mode (our server's default is on; a stock ``vllm serve``'s off)."""
    from gpu_common import ServerProcess, gpu_count, greedy

    from learner.run.metrics import read_metrics

    if gpu_count() < 2:
        pytest.skip("the NCCL layout puts the server on a second GPU")
    name = "delegated" if sleep_mode else "delegated_no_sleep"
    server = ServerProcess(
        qwen3_text_dir, gpu="1", gpu_memory_utilization=0.3,
        extra_args=["--weight-transfer-backend", "nccl",
                    "--enable-sleep-mode" if sleep_mode else "--no-enable-sleep-mode"],
        log_path=log_dir / f"test_vllm_serve.{name}.server.log",
    )  # fmt: skip
    run_dir = tmp_path / name
    with server:
        log = log_dir / f"test_vllm_serve.{name}.log"
        _run(qwen3_text_dir, server.url, "nccl", "0", run_dir, log, api="rollout-server")
        served, info = greedy(server, PROBES), server.info()
        served_sum = server.get("/weights/checksum").json()["checksum"]
    records = read_metrics(run_dir)
    drift = [abs(r["is_weight"] - 1) if "is_weight" in r else None for r in records]
    print(f"{name}: step times {[round(r['time/step'], 2) for r in records]} s, "
          f"|is_weight - 1| {[d if d is None else round(d, 4) for d in drift]}")  # fmt: skip
    for r in records:  # what else moved in a step whose importance weight did
        print(f"{name}: step {r['step']}: " + ", ".join(
            f"{k} {r[k]:.4g}" for k in DIAGNOSTICS if isinstance(r.get(k), int | float)))  # fmt: skip
    with ServerProcess(
        run_dir / "final", gpu="1", gpu_memory_utilization=0.3,
        log_path=log_dir / f"test_vllm_serve.{name}.reference.log",
    ) as ours:  # fmt: skip
        want = greedy(ours, PROBES)
        want_sum = ours.get("/weights/checksum").json()["checksum"]
    # which half fails, if one does: the weights the server holds, or what it generates with them
    print(f"{name}: served weights' checksum {served_sum!r}, the saved final model's {want_sum!r}; "
          f"greedy against the saved final model: {served.mismatch(want) or 'same'}")  # fmt: skip
    assert info["weight_version"] == STEPS and info["weight_transfer_backend"] == "nccl"
    assert served_sum == pytest.approx(want_sum, rel=1e-9), (
        "the served weights are not the final model"
    )
    assert max(_drift(records)) <= IS_WEIGHT_TOL, drift
    assert served.matches(want), served.mismatch(want)
