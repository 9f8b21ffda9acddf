"""The learner's console: its own INFO lines, but no httpx line per request to a server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_server.settings import ServerSettings

SCRIPT = """
import logging, sys
import httpx
from learner.cli import setup_logging

setup_logging()
for _ in range(3):
    httpx.get(sys.argv[1] + "/health", timeout=30).raise_for_status()
logging.getLogger("learner").info("step 1 done")
"""


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir)), wait_ready=False) as s:
        yield s


def test_no_httpx_request_lines_on_the_console(server):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "step 1 done" in out.stderr  # the learner's own INFO lines still show
    assert "HTTP Request:" not in out.stderr, out.stderr
