"""``rollout-server`` / ``python -m rollout_server``: parse flags, validate, then serve.

Only argparse and pydantic load before the flags are checked, so ``--help`` and a bad flag
answer at once; torch, transformers and vLLM are imported when the app is built.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
from typing import Any

from pydantic import ValidationError

from rollout_server.settings import API_KEY_ENV, ServerSettings, check_model_ref

_LIMIT_FLAGS = (
    "max_n",
    "max_tokens",
    "max_prompt_len",
    "max_batch_size",
    "max_body_mb",
    "max_json_body_mb",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-server",
        description="Serve a model for GRPO rollouts: /generate, OpenAI routes, weight sync.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags fall back to ServerSettings' defaults
    )
    p.add_argument("--model", required=True, help="local model directory or hub id")
    p.add_argument("--served-model-name", help="name in /info and /v1/models")
    p.add_argument("--engine", choices=["transformers", "vllm"], help="default: transformers")
    p.add_argument("--host", help="default 127.0.0.1; others need an API key")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--seed", type=int, help="seed for requests that give none")
    secrets = p.add_argument_group("security")
    secrets.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="require Authorization: Bearer KEY, KEY read from this file (surrounding "
        f"whitespace dropped); or set env {API_KEY_ENV}",
    )
    secrets.add_argument(
        "--api-key",
        metavar="KEY",
        help="as --api-key-file, but the key shows in `ps`: prefer the file or the env",
    )
    secrets.add_argument("--ssl-keyfile", metavar="PATH", help="TLS private key (PEM): HTTPS")
    secrets.add_argument("--ssl-certfile", metavar="PATH", help="TLS certificate chain (PEM)")
    secrets.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="/weights/load_file reads only under this directory and the model's own",
    )
    p.add_argument(
        "--disable-admin-endpoints",
        action="store_true",
        help="no weight/sleep routes (allows serving off loopback without a key)",
    )
    limits = p.add_argument_group("input limits (violations answer 4xx)")
    limits.add_argument("--max-n", type=int, help="samples per prompt (default 64)")
    limits.add_argument("--max-tokens", type=int, help="completion tokens (default 4096)")
    limits.add_argument("--max-prompt-len", type=int, help="prompt tokens (default 8192)")
    limits.add_argument("--max-batch-size", type=int, help="prompts per request (default 512)")
    limits.add_argument("--max-body-mb", type=int, help="weight upload body MB (default 4096)")
    limits.add_argument(
        "--max-json-body-mb",
        type=int,
        help="body MB of every route but the weight uploads (default 64)",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, help="context length (default: model's)")
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        help="sequences decoded together (default: transformers 256; vLLM its batch default, "
        "1024 on a >= 70 GB GPU)",
    )
    engine.add_argument(
        "--max-batch-tokens",
        type=int,
        help="prompt tokens prefilled in one step (vLLM max_num_batched_tokens; default: "
        "transformers 32768, vLLM 16384 on a >= 70 GB GPU)",
    )
    engine.add_argument("--gpu-memory-utilization", type=float, help="vLLM (default 0.9)")
    engine.add_argument("--tensor-parallel-size", type=int, help="vLLM (default 1)")
    engine.add_argument("--data-parallel-size", type=int, help="vLLM (default 1)")
    engine.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    engine.add_argument(
        "--direct-weight-copy",
        action=argparse.BooleanOptionalAction,
        help="vLLM: load verified NCCL/IPC updates by direct copies (default on)",
    )
    engine.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        help="vLLM: serve LoRA adapter updates (transformers: always)",
    )
    engine.add_argument(
        "--max-lora-rank", type=int, help="vLLM: the largest adapter rank (default 64)"
    )
    engine.add_argument("--trust-remote-code", action="store_true")
    engine.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        help="keep the startup heap out of Python's garbage collector once ready (default on)",
    )
    engine.add_argument(
        "--weight-transfer-backend",
        choices=["nccl", "ipc"],
        help="vLLM: serve vLLM's RL weight-transfer routes over this backend (transformers: "
        "always gloo)",
    )
    engine.add_argument(
        "--vllm-arg",
        action="append",
        metavar="KEY=VALUE",
        help="extra vLLM engine argument (VALUE as JSON, else a string); repeatable, "
        "e.g. --vllm-arg enforce_eager=true --vllm-arg max_num_batched_tokens=4096",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, wait this long for requests in flight, then cancel them (default 10)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    fields: dict[str, Any] = vars(args).copy()
    key_file = fields.pop("api_key_file", None)
    if key_file is not None:
        if "api_key" in fields:
            raise CliError("--api-key-file: give the key once (--api-key-file or --api-key)")
        fields["api_key"] = read_key_file(key_file)
    limits = {k: fields.pop(k) for k in _LIMIT_FLAGS if k in fields}
    extra = fields.pop("vllm_arg", None) or []
    if extra:
        fields["vllm_engine_args"] = dict(vllm_arg(item) for item in extra)
    if limits:
        fields["limits"] = limits
    return ServerSettings.model_validate(fields)


class CliError(ValueError):
    """A flag that cannot be used as given; the message names it."""


def read_key_file(path: str) -> str:
    """The key in ``path`` without surrounding whitespace (a trailing newline is usual); a
    file holding only whitespace gives "", which the settings refuse by name. A warning on
    stderr if the file's mode lets its group or other users in (it should be 0600)."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--api-key-file: cannot read {path!r}: {exc}") from exc
    if key and mode & 0o077:  # (a blank key is refused: nothing to warn about)
        print(
            f"rollout-server: warning: --api-key-file {path!r} is open to other users (mode "
            f"{stat.S_IMODE(mode):04o}): any of them can read the key; chmod 600 {path}",
            file=sys.stderr,
        )
    return key


def vllm_arg(item: str) -> tuple[str, Any]:
    """One ``--vllm-arg KEY=VALUE``: VALUE read as JSON (``true``, ``4096``), else a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"rollout-server: error: --vllm-arg {item!r} must look like KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"--{loc.split('.')[-1].replace('_', '-')}: {msg}" if loc else msg)
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except CliError as exc:
        print(f"rollout-server: error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"rollout-server: error: {_explain(exc)}", file=sys.stderr)
        return 2
    for flag, path in (
        ("--ssl-keyfile", settings.ssl_keyfile),
        ("--ssl-certfile", settings.ssl_certfile),
    ):
        if path is not None and not os.path.isfile(path):
            print(f"rollout-server: error: {flag}: no such file {path!r}", file=sys.stderr)
            return 2
    try:
        check_model_ref(settings.model)
    except ValueError as exc:
        print(f"rollout-server: error: --model: {exc}", file=sys.stderr)
        return 2
    # Checked before the model loads (minutes with vLLM), not found out after it.
    problem = missing_engine(settings.engine) or cannot_listen(settings.host, settings.port)
    if problem:
        print(f"rollout-server: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from rollout_server.app import build_app

    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_engine_failure(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True
        # A failed vLLM start can leave a thread behind that keeps asyncio.run (and so this
        # process) from ever returning: whoever waits for the process would wait for ever.
        threading.Thread(
            target=exit_unless_gone, args=(exc, settings.shutdown_timeout + 10.0), daemon=True
        ).start()

    app = build_app(settings, on_engine_failure=on_engine_failure)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile,
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    server.run()
    if failures:
        print(f"rollout-server: the engine failed to start: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def missing_engine(engine: str) -> str | None:
    """What is missing for ``--engine``, or None. Only looks for vLLM: importing it takes
    seconds, and the engine imports it when it starts."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        return (
            '--engine vllm: vLLM is not installed; install it with `pip install -e ".[vllm]"` '
            "(on a GPU machine), or serve with --engine transformers"
        )
    return None


def cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port``, or None: the address is bound as
    uvicorn binds it (``SO_REUSEADDR``, so a port in TIME_WAIT passes) and released at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"--host {host}: cannot resolve it ({exc.strerror})"
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"--port {port}: {host}:{port} is already in use; choose another with --port"
            return f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})"
    return None


def exit_unless_gone(exc: BaseException, grace_s: float) -> None:
    """The engine failed to start: end the process with exit code 1 if it is still here after
    ``grace_s`` (the normal shutdown prints the same line and returns first)."""
    time.sleep(grace_s)
    print(f"rollout-server: the engine failed to start: {exc}", file=sys.stderr, flush=True)
    os._exit(1)
