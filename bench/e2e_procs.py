"""The processes of bench_grpo_e2e.py's runs: each started in its own session (ended by process
group, so vLLM's engine and worker processes go with it), the wait for the learner's steps
while every server stays up, and facts about the machine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_common import BenchError
from gpu_common import ROOT, ServerProcess


def stop_group(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM a process group (its leader started with a new session), SIGKILL what is left
    after ``grace_s``, and wait until no member remains (so the GPU memory is free)."""
    if proc is None:
        return
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)  # any member of the group left?
        except ProcessLookupError:
            return
        time.sleep(0.2)


def start_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:
        proc = subprocess.Popen(
            argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
    if pidfile := os.environ.get("GRPO_GPU_PIDFILE"):  # the GPU suite ends leftovers by pid
        with open(pidfile, "a") as f:
            f.write(f"{proc.pid}\n")
    return proc


def tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def ram_dir(need_bytes: int) -> str | None:
    """/dev/shm when it has room (the colocated file sync never touches a disk), else None
    (the default temp directory)."""
    with contextlib.suppress(OSError):
        if shutil.disk_usage("/dev/shm").free > need_bytes:
            return "/dev/shm"
    return None


def gpu_names() -> list[str]:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return []


def logged_steps(run_dir: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(1 for line in (run_dir / "metrics.jsonl").open() if line.strip())
    return 0


def wait_for_steps(
    learner: subprocess.Popen,
    servers: list[ServerProcess],
    run_dir: Path,
    steps: int,
    deadline: float,
) -> bool:
    """Until ``steps`` metric records exist; True if the learner was still running then (it is
    saving its final checkpoint). A dead learner or server, or the deadline, raises."""
    while True:
        rc = learner.poll()
        done = logged_steps(run_dir)
        if done >= steps:
            return rc is None
        if rc is not None:
            raise BenchError(f"the learner exited with code {rc} after {done} of {steps} steps")
        for server in servers:
            if server.proc is not None and (rc := server.proc.poll()) is not None:
                raise BenchError(f"the rollout server on GPU {server.gpu} exited with code {rc}")
        if time.monotonic() > deadline:
            raise BenchError(f"timed out with {logged_steps(run_dir)} of {steps} steps logged")
        time.sleep(0.5)


def start_servers(servers: list[ServerProcess], timeout_s: float) -> None:
    """Start every server at once and wait until all are ready (each loads on its own GPUs)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        for future in [pool.submit(s.start, ready_timeout_s=timeout_s) for s in servers]:
            future.result()
