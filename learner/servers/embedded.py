"""The embedded rollout server: started by the learner when no server is configured.

It is a real ``rollout-server`` subprocess on a free loopback port, spoken to over HTTP exactly
like a remote one. It must never outlive the learner: it is stopped at the end, on Ctrl-C and on
an exception (context manager). A SIGKILLed learner runs no cleanup, so the server watches it:
it holds the read end of a pipe whose only write end is the learner's, and the kernel closes that
when the learner dies, however it dies. The server then gets SIGTERM (on Linux at once, from the
kernel: ``PR_SET_PDEATHSIG``) and, ``ORPHAN_GRACE_S`` later, its whole process group gets
SIGKILL: a SIGTERMed uvicorn first finishes the generation in flight, which kept an orphan busy
on the CPU or GPU (the memory a resumed colocated learner needs) for as long as that generation
ran, measured 9 s on the CPU demo with 1024-token samples.

Under a launcher of several processes the server is outside the launcher's process group
(``server_env``). With ``rollout.embedded.per_rank`` every learner process starts one
(``rank_env``: on that process's GPU alone), so each rank's share of the prompts
is generated on the GPU it trains on.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import runpy
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from grpo_common.net import free_port
from rollout_server.settings import API_KEY_ENV

if TYPE_CHECKING:
    from learner.config import LearnerConfig


class EmbeddedServerError(RuntimeError):
    pass


logger = logging.getLogger(__name__)

ORPHAN_GRACE_S = 5.0  # after SIGTERM, for a clean shutdown (vLLM's engine processes)
SERVED_TIMEOUT_S = 120.0  # the served weights' checksum, read as the run ends
WAIT_NOTE_S = 30.0  # while a server starts: how often the learner says it still waits, and on what
_PR_SET_PDEATHSIG = 1
# The child's command: import this module, watch the learner, then run the rollout server. Not a
# preexec_fn: that is unsafe in a process with threads, and the learner has some by then.
_CHILD = "from learner.servers.embedded import serve_watched; serve_watched()"
_SERVER_MODULE = "rollout_server"


def serve_watched() -> None:
    """The embedded server's process (``python -c _CHILD FD rollout_server ARGS...``): watch
    the learner through pipe ``FD``, then run the ``rollout_server`` module with ``ARGS``."""
    fd, module = int(sys.argv[1]), sys.argv[2]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    threading.Thread(target=_watch_learner, args=(fd,), daemon=True).start()
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _watch_learner(fd: int) -> None:
    """Block until the learner's end of the pipe closes (it exited or was killed), then stop
    this server: SIGTERM, and SIGKILL for the whole process group after the grace."""
    while os.read(fd, 1):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os.killpg(0, signal.SIGKILL)


#: What ``torchrun`` (``accelerate launch`` of several processes) tells a learner process about
#: its place in the launch. A server is no part of it: vLLM would read a rank of the learner's
#: group as its own, and with ``TORCHELASTIC_USE_AGENT_STORE`` its engine's own one-process
#: group waits, as a client, for a store nobody serves (seen: a per-rank vLLM server on 2 GPUs
#: never started).
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def server_env(env: dict[str, str | None] | None, api_key: str | None) -> dict[str, str]:
    """An embedded server's environment: the learner's, less the launcher's variables and the
    learner's key for external servers, with ``env``'s changes (None: unset) and ``api_key``."""
    child_env = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)
    }
    child_env["PYTHONUNBUFFERED"] = "1"
    for name, value in (env or {}).items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    child_env.pop(API_KEY_ENV, None)  # the learner's key for external servers is not this one's
    if api_key is not None:
        child_env[API_KEY_ENV] = api_key
    return child_env


@contextlib.contextmanager
def embedded_server(
    model: str,
    *,
    log_path: Path,
    engine: str = "transformers",
    dtype: str = "float32",
    startup_timeout_s: float = 120.0,
    extra_args: list[str] | None = None,
    api_key: str | None = None,
    port: int | None = None,
    env: dict[str, str | None] | None = None,
) -> Iterator[str]:
    """Start a rollout server on ``port`` (default: a free one) of loopback; yield its URL;
    always stop it. ``api_key`` reaches it through its environment, where ``ps`` does not show
    it; ``env``: changes to its environment (None: unset), such as the GPU it runs on."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    watch_fd, learner_fd = os.pipe()  # learner_fd is not inherited by any other child
    cmd = [
        sys.executable,
        "-c",
        _CHILD,
        str(watch_fd),
        _SERVER_MODULE,  # named in the command line, so ps shows what it is
        "--model",
        model,
        "--engine",
        engine,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(extra_args or []),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(env, api_key),
            pass_fds=(watch_fd,),
            start_new_session=True,  # its own process group: stopped with its children
        )
    except BaseException:
        os.close(learner_fd)
        log.close()
        raise
    finally:
        os.close(watch_fd)
    try:
        _wait_ready(proc, url, startup_timeout_s, log_path, api_key)
        try:
            yield url
        except Exception as e:
            if proc.poll() is None:
                raise
            # The learner's requests failed because the server had died: say so, not only
            # "connection refused" after the retries.
            raise EmbeddedServerError(
                f"the embedded rollout server died during the run ({_exit_status(proc)}); "
                f"its log ({log_path}) ends with:\n{_tail(log_path)}\nThe run stopped: "
                "--resume continues it from its last checkpoint"
            ) from e
    finally:
        _stop(proc)
        os.close(learner_fd)
        log.close()


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path, api_key: str | None
) -> None:
    start = time.monotonic()
    deadline, next_note = start + timeout_s, start + WAIT_NOTE_S
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        if time.monotonic() >= next_note:  # a silent wait of minutes looks like a hang
            next_note += WAIT_NOTE_S
            logger.info(
                "waiting for the embedded rollout server: %.0f s of %.0f s "
                "(rollout.embedded.startup_timeout_s); its log (%s) ends: %s",
                time.monotonic() - start, timeout_s, log_path, _last_line(log_path),
            )  # fmt: skip
        if proc.poll() is not None:
            raise EmbeddedServerError(
                f"the embedded rollout server exited ({_exit_status(proc)}); "
                f"its log ({log_path}) ends with:\n{_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", headers=headers, timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise EmbeddedServerError(
        f"the embedded rollout server was not ready after {timeout_s:.0f} s; see {log_path}"
    )


def _exit_status(proc: subprocess.Popen[bytes]) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (": out of memory?" if name == "SIGKILL" else "")
    return f"exit code {code}"


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-2000:]


def _last_line(log_path: Path) -> str:
    """The log's last non-empty line (progress bars' carriage returns split it), shortened."""
    with contextlib.suppress(OSError):
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            text = f.read().decode(errors="replace")
        lines = [x.strip() for x in text.replace("\r", "\n").splitlines() if x.strip()]
        if lines:
            return lines[-1][-300:]
    return "(nothing yet)"


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def record_served(url: str, api_key: str | None, path: Path, rank: int) -> None:
    """Write what the embedded server at ``url`` serves as the run ends, right before it is
    stopped, to ``path`` (JSON): its ``GET /weights/checksum`` as ``{"rank", "url",
    "weight_version", "checksum"}``, or ``{"rank", "url", "error"}`` when it does not answer
    (the run is not failed for it). A check after the run (the e2e bench) compares it with the
    saved final model, when the server is gone. Written whole or not at all (a rename)."""
    from rollout_server.protocol import WeightChecksum

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    record: dict[str, Any] = {"rank": rank, "url": url}
    try:
        r = httpx.get(f"{url}/weights/checksum", headers=headers, timeout=SERVED_TIMEOUT_S)
        r.raise_for_status()
        served = WeightChecksum.model_validate_json(r.content)
        record |= {"weight_version": served.weight_version, "checksum": served.checksum}
    except (httpx.HTTPError, ValueError) as e:
        logger.warning("could not read the embedded server's served weights: %s", e)
        record["error"] = f"{type(e).__name__}: {e}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def embedded_key() -> str:
    """A fresh random API key for an embedded server: no other local process may push weights
    to it or put it to sleep during the run."""
    return secrets.token_urlsafe(32)


def embedded_for(
    cfg: LearnerConfig,
    model: str,
    log_path: Path,
    *,
    api_key: str | None = None,
    port: int | None = None,
    device: Any = None,
) -> contextlib.AbstractContextManager[str]:
    """The embedded rollout server of ``rollout.embedded`` serving ``model``, with limits that
    cover what the config asks of it; the context yields its URL. ``device``: a learner
    process's own device, which the server alone is to use (``rollout.embedded.per_rank``)."""
    e = cfg.rollout.embedded
    return embedded_server(
        model,
        log_path=log_path,
        engine=e.engine,
        dtype=e.dtype,
        startup_timeout_s=e.startup_timeout_s,
        extra_args=[*limit_args(cfg), *sync_dir_args(cfg), *e.extra_args],
        api_key=api_key,
        port=port,
        env=None if device is None else rank_env(device),
    )


def rank_env(device: Any) -> dict[str, str | None]:
    """The environment changes for a learner process's own server: on a GPU ``device`` that GPU
    alone (``CUDA_VISIBLE_DEVICES`` names it, and the server sees it as its first: vLLM and the
    transformers engine both take that one)."""
    import torch

    env: dict[str, str | None] = {}
    dev = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    if dev.type != "cuda":
        return env
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    return env


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (one per rank's server)."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def sync_dir_args(cfg: LearnerConfig) -> list[str]:
    """``--weights-dir`` for ``rollout.sync.type = "file"``: the server loads weights files
    only under the model's directory and the one named there."""
    from learner.config.sync import FileSyncConfig

    sync = cfg.rollout.sync
    if not isinstance(sync, FileSyncConfig):
        return []
    return ["--weights-dir", str(Path(sync.dir).resolve())]


def limit_args(cfg: LearnerConfig) -> list[str]:
    """Flags that raise the embedded server's limits to what this config asks of it (training's
    sampling and the [eval] section's)."""
    from rollout_server.protocol import Limits

    default, s, e = Limits(), cfg.sampling, cfg.eval
    n = max(s.num_generations, e.num_generations if e else 0)
    max_tokens = max(s.max_tokens, (e.max_tokens or 0) if e else 0)
    args = []
    if n > default.max_n:
        args += ["--max-n", str(n)]
    if max_tokens > default.max_tokens:
        args += ["--max-tokens", str(max_tokens)]
    return args
