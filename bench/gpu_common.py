"""Shared by the GPU tests (tests/gpu) and benchmarks (bench/*_gpu.py): the random-weight
Qwen3-shaped models (0.6B, 4B, 8B), a rollout server in its own process on a chosen GPU, GPU
memory reads (this process's, and every GPU's peak while a benchmark runs).

    python3 bench/gpu_common.py build-model --shape qwen3-4b DIR   # random weights, bf16

The server runs as a real ``rollout-server`` process (``python -m rollout_server``) so that it can
own a different GPU than the test (``CUDA_VISIBLE_DEVICES``) and so vLLM's worker processes die
with it. NVLink multicast stays off in every process started here (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from grpo_common.net import free_port
from rollout_server.tiny import QWEN3_0_6B_SHAPE, QWEN3_4B_SHAPE

ROOT = Path(__file__).resolve().parents[1]
NO_MULTICAST = {
    "NCCL_CUMEM_ENABLE": "0",  # the same NCCL memory mode at both ends of the weight group
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
API_KEY = "gpu-test-key"


def require_modules(script: str, modules: dict[str, str]) -> None:
    """Exit 2 naming every package (``{import name: pip name}``) that cannot be imported, before
    anything starts: a benchmark never reports ok with a part or baseline it could not run."""
    import importlib.util

    missing = [pip for mod, pip in modules.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(
            f"{script}: error: missing dependencies: {', '.join(missing)} (pip install -e "
            '".[vllm,deepspeed]"; the baselines: pip install trl==1.16.0 liger-kernel==0.8.5)',
            file=sys.stderr,
        )
        raise SystemExit(2)


def visible_gpus(indices: str, parent: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that should see GPUs ``indices`` ("0", "0,1") of the
    ones this process sees: a test written for GPUs 0 and 1 runs unchanged on GPUs 2 and 3 when
    the GPU suite starts it with ``CUDA_VISIBLE_DEVICES=2,3`` (two test lanes on a 4-GPU host).
    ``parent`` is this process's own setting (default: the environment's); unset, indices pass
    through."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    wanted = [i.strip() for i in indices.split(",") if i.strip()]
    if not parent:
        return ",".join(wanted)
    seen = [d.strip() for d in parent.split(",") if d.strip()]
    out = []
    for i in wanted:
        if not i.isdigit() or int(i) >= len(seen):
            raise ValueError(
                f"GPU {i!r} asked for, but this process sees only CUDA_VISIBLE_DEVICES={parent!r}"
            )
        out.append(seen[int(i)])
    return ",".join(out)


def gpu_env(cuda_visible_devices: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a GPU child process; ``cuda_visible_devices`` counts among the GPUs this
    process sees (``visible_gpus``)."""
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1", **extra}
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus(cuda_visible_devices)
    return env


def qwen3_model_dir() -> Path:
    """``$GRPO_GPU_MODEL`` if set (the GPU suite writes it once), else a fresh random-weight
    Qwen3-0.6B-shaped bf16 model in a temp directory."""
    if (path := os.environ.get("GRPO_GPU_MODEL")) and (Path(path) / "config.json").is_file():
        return Path(path)
    from rollout_server.tiny import QWEN3_0_6B_SHAPE, save_tiny_model

    out = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-shape-"))
    return save_tiny_model(out, seed=0, dtype="bfloat16", **QWEN3_0_6B_SHAPE)


def qwen3_text_model_dir() -> Path:
    """``$GRPO_GPU_TEXT_MODEL`` if set, else a fresh Qwen3-0.6B-shaped bf16 model whose vocabulary
    is its tokenizer's (265 byte-level ids, not 151936): for the tests whose GRPO runs must
    learn something. The random-weight model samples its vocabulary almost uniformly, and of
    151936 ids only 0.18 % decode to text (the rest decode to ''), so every text reward (charset,
    length in chars) is 0 for nearly every sample, every advantage 0, and nothing is trained;
    with the tokenizer's ids every sampled token is a character or an end."""
    path = os.environ.get("GRPO_GPU_TEXT_MODEL")
    if path and (Path(path) / "config.json").is_file():
        return Path(path)
    from rollout_server.tiny import QWEN3_0_6B_SHAPE, save_tiny_model

    # on the CPU, as qwen3_model_dir: the test process holds no GPU memory the servers want
    out = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-text-"))
    return save_tiny_model(
        out, seed=0, dtype="bfloat16", **{**QWEN3_0_6B_SHAPE, "vocab_size": None}
    )


# The published Qwen3 architectures' sizes (their config.json), as ``save_tiny_model`` overrides:
# real shapes with random weights, since nothing can be downloaded on the GPU machine.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": QWEN3_0_6B_SHAPE,
    "qwen3-4b": QWEN3_4B_SHAPE,
    "qwen3-8b": {**QWEN3_0_6B_SHAPE, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "tie_word_embeddings": False},
}  # fmt: skip
#: the fields a model directory's config.json must match to be called that shape
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "tie_word_embeddings")  # fmt: skip


def shape_mismatch(model_dir: Path | str, shape: str) -> str:
    """Why ``model_dir``'s config.json is not ``shape`` ('' when it is): a result labelled
    Qwen3-8B must have run the 8B shape."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"cannot read {model_dir}/config.json: {e}"
    want = MODEL_SHAPES[shape]
    bad = [f"{k} {config.get(k)} (want {want[k]})" for k in SHAPE_KEYS if config.get(k) != want[k]]
    return f"{model_dir} is not the {shape} shape: " + ", ".join(bad) if bad else ""


def build_shape_model(path: Path | str, shape: str, seed: int = 0) -> Path:
    """A random-weight bf16 model of ``shape`` at ``path`` (with the byte-level tokenizer),
    initialised on the GPU when there is one: 8B parameters are drawn in seconds there, minutes
    on the CPU."""
    import torch

    from rollout_server.tiny import save_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        return save_tiny_model(path, seed=seed, dtype="bfloat16", **MODEL_SHAPES[shape])


def model_bytes(model_dir: Path | str) -> int:
    """The bytes of the model's weights as saved (bf16 safetensors): what a full sync sends."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_gpu_bytes(device: int = 0) -> int:
    """Free memory on a physical GPU (as this process numbers them), all processes counted."""
    import torch

    return torch.cuda.mem_get_info(device)[0]


class GpuMemoryPeak:
    """Every GPU's peak used memory (``nvidia-smi``: all processes, vLLM's pools included) while
    the block runs, sampled every ``interval_s`` in a thread: the same measure for our layouts
    and for a baseline whose memory is not all in one torch allocator. ``peak_mib`` maps the
    GPU index to MiB; empty where there is no ``nvidia-smi`` (the CPU runs)."""

    QUERY = ("nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits")

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak_mib: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def sample(self) -> bool:
        try:
            out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        for line in out.stdout.splitlines():
            index, _, used = line.partition(",")
            with contextlib.suppress(ValueError):
                mib = int(float(used))
                self.peak_mib[index.strip()] = max(mib, self.peak_mib.get(index.strip(), 0))
        return out.returncode == 0

    def _poll(self) -> None:
        while self.sample() and not self._stop.wait(self.interval_s):
            pass

    def __enter__(self) -> GpuMemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


class ServerProcess:
    """``python -m rollout_server --engine vllm`` on ``gpu``, with an API key, on loopback."""

    ready_path = "/ready"

    def __init__(
        self,
        model: Path | str,
        *,
        gpu: str = "0",
        gpu_memory_utilization: float = 0.35,
        max_model_len: int = 2048,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.env = dict(env or {})  # more environment for its process (a run marker)
        self.url = f"http://127.0.0.1:{self.port}"
        self.gpu = gpu
        self.argv = [
            sys.executable,
            "-m",
            "rollout_server",
            "--model",
            str(model),
            "--engine",
            "vllm",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--api-key",
            API_KEY,
            "--gpu-memory-utilization",
            str(gpu_memory_utilization),
            "--max-model-len",
            str(max_model_len),
            *(extra_args or []),
        ]
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="rollout-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(600.0, connect=10.0),
        )

    def start(self, ready_timeout_s: float = 420.0) -> ServerProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=gpu_env(self.gpu, **self.env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"rollout server exited ({self.proc.returncode}):\n{self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get(self.ready_path, timeout=5.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {ready_timeout_s}s:\n{self.tail()}")
            time.sleep(1.0)

    def tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """SIGTERM the server's process group (vLLM's engine and workers with it), then KILL."""
        self.http.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # stragglers of the group (engine core, workers)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- calls -----------------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(path, **kw).raise_for_status()

    def generate(self, **body: Any) -> dict[str, Any]:
        r = self.post("/generate", body)
        if r.status_code != 200:
            raise AssertionError(f"/generate -> {r.status_code}: {r.text[:500]}")
        return r.json()

    def info(self) -> dict[str, Any]:
        return self.http.get("/info").raise_for_status().json()


class VllmServeProcess(ServerProcess):
    """A stock ``vllm serve`` (vLLM's own CLI, none of our server's code) on ``gpu``, with its
    RL routes on (``VLLM_SERVER_DEV_MODE=1``) and ``backend``'s weight-transfer engine. The IPC
    engine's handles arrive pickled over HTTP, which vLLM refuses to unpickle unless started
    with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: set for ``backend="ipc"``."""

    ready_path = "/health"

    def __init__(self, model: Path | str, *, backend: str = "nccl", **kw: Any) -> None:
        super().__init__(model, **kw)
        self.backend = backend
        extra = self.argv[self.argv.index("--max-model-len") + 2 :]
        self.argv = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--gpu-memory-utilization", self.argv[self.argv.index("--gpu-memory-utilization") + 1],
            "--max-model-len", self.argv[self.argv.index("--max-model-len") + 1],
            "--weight-transfer-config", f'{{"backend": "{backend}"}}', *extra,
        ]  # fmt: skip

    def start(self, ready_timeout_s: float = 420.0) -> ServerProcess:
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # inherited by the server (gpu_env copies it)
        if self.backend == "ipc":
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ.update(env)
        try:
            return super().start(ready_timeout_s)
        finally:
            for name in env:
                del os.environ[name]

    def greedy(self, prompts: list[list[int]], max_tokens: int = 24) -> Greedy:
        body = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": True}  # fmt: skip
        r = self.post("/v1/completions", body)
        if r.status_code != 200:
            raise AssertionError(f"/v1/completions -> {r.status_code}: {r.text[:500]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return Greedy(
            tokens=[c["token_ids"] for c in choices],
            logprobs=[c["logprobs"]["token_logprobs"] for c in choices],
        )


@contextlib.contextmanager
def running_server(model: Path | str, **kw: Any) -> Iterator[ServerProcess]:
    server = ServerProcess(model, **kw)
    try:
        yield server.start()
    finally:
        server.stop()


GREEDY_LOGPROB_TOL = 0.05  # bf16 logits: near-ties are a few 1e-3 apart


@dataclass(frozen=True)
class Greedy:
    """Greedy continuations (token ids and their log-probs), one per prompt.

    Two runs of the same weights can still differ: the random-weight test model has many
    near-tied logits, and vLLM's bf16 numerics are not batch-invariant, so one near-tie may
    resolve the other way (seen on 2xH200 between two identical requests). ``matches`` is the
    same-weights check that allows exactly that: equal tokens, log-probs within ``tol`` on the
    common prefix, and where the tokens first differ, both runs' chosen tokens within ``tol`` of
    each other (a tie flip); what follows a flip is a different continuation, not compared.
    Different weights (the senders' N(0, 0.02) perturbation) move the log-probs far more."""

    tokens: list[list[int]]
    logprobs: list[list[float]]

    def matches(self, other: Greedy, tol: float = GREEDY_LOGPROB_TOL) -> bool:
        return not self.mismatch(other, tol)

    def mismatch(self, other: Greedy, tol: float = GREEDY_LOGPROB_TOL) -> str:
        """Why the two are not the same weights' generations ('' when they are)."""
        if len(self.tokens) != len(other.tokens):
            return f"{len(self.tokens)} vs {len(other.tokens)} prompts"
        for p, (ta, tb, la, lb) in enumerate(
            zip(self.tokens, other.tokens, self.logprobs, other.logprobs, strict=True)
        ):
            for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
                if abs(la[i] - lb[i]) > tol:
                    return f"prompt {p} token {i}: log-prob {la[i]:.4f} vs {lb[i]:.4f} ({x} vs {y})"
                if x != y:
                    break  # a tie flip: both choices equally likely, the rest diverges
        return ""


def greedy(server: ServerProcess, prompts: list[list[int]], max_tokens: int = 24) -> Greedy:
    out = server.generate(
        prompts=prompts, n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )
    samples = [r["samples"][0] for r in out["results"]]
    return Greedy([s["token_ids"] for s in samples], [s["logprobs"] for s in samples])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="random-weight Qwen3-shaped models for the GPU runs")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-model", help="write a random-weight bf16 model of a real shape")
    b.add_argument("--shape", choices=sorted(MODEL_SHAPES), required=True)
    b.add_argument("path", type=Path)
    args = p.parse_args(argv)
    print(build_shape_model(args.path, args.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
