"""A rollout server whose engine fails to start exits, even when the failed start left a thread
behind that keeps ``asyncio.run`` from returning (as a failed vLLM start can): the learner, the
GPU tests and an orchestrator's restart policy all wait for the process to end."""

from __future__ import annotations

import subprocess
import sys
import time

from grpo_common.net import free_port

SCRIPT = """
import sys, threading
import rollout_server.app as app
from rollout_server.engine.base import EngineError


class StuckStart:
    name = "stuck"

    async def start(self):
        import asyncio
        # a worker thread of the default executor that never returns: asyncio.run waits for it
        asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
        raise EngineError("the engine core died")


app.load_engine = lambda kind, settings: StuckStart()
from rollout_server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_engine_start_that_leaves_a_thread_behind_still_exits(tiny_model_dir):
    port = free_port()
    argv = [sys.executable, "-c", SCRIPT, "--model", str(tiny_model_dir), "--port", str(port),
            "--log-level", "error", "--shutdown-timeout", "1"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the engine failed to start: the engine core died" in proc.stderr
    assert time.monotonic() - t0 < 60
