"""A learner pointed at an address where nothing listens keeps waiting for
``rollout.ready_timeout_s`` (a server may still be starting), but says so plainly: at once,
again while it lasts, when something starts listening, and in its last line."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import time
from pathlib import Path

import pytest

from grpo_common.net import free_port
from learner.servers.listening import ListenWatch, address, refuses
from tests.learner.demo_runs import learner_cmd, learner_env


def test_an_address_maps_to_its_host_and_port() -> None:
    assert address("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert address("https://rollout.example/v1") == ("rollout.example", 443)
    assert address("http://[::1]:9/") == ("::1", 9)


async def test_the_watch_says_nothing_listens_again_while_it_lasts_and_when_it_ends(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    assert await refuses(url)
    watch = ListenWatch(lambda: [url], 300.0, every_s=0.5, probe_s=0.1)
    caplog.set_level(logging.INFO, logger="learner.servers.listening")
    task = asyncio.create_task(watch.watch())
    try:
        deadline = time.monotonic() + 60
        while sum("still nothing listens" in r.message for r in caplog.records) < 2:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.1)
        first = caplog.records[0].message
        assert f"{url}: nothing listens at {url[7:]} yet (connection refused)" in first
        assert "rollout.ready_timeout_s = 300 s" in first and "fix the URL" in first
        message = watch.nothing_listens(url)
        assert message is not None and message.startswith(f"nothing listens at {url[7:]}")

        with socket.create_server(address(url)) as server:  # a server starts listening
            server.listen()
            while url in watch.refused:
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.1)
            assert f"{url}: something listens at {url[7:]} now" in caplog.text
            assert watch.nothing_listens(url) is None
            assert not await refuses(url)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.slow
def test_the_learner_says_at_once_that_nothing_listens_and_ends_saying_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    sets = [f'rollout.servers=["{url}"]', "rollout.ready_timeout_s=10", "run.progress_bar=false"]
    proc = subprocess.run(
        learner_cmd(tmp_path / "run", *(a for o in sets for a in ("--set", o))),
        env=learner_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if "nothing listens at" in line and "yet" in line]
    waits = [i for i, line in enumerate(lines) if "waiting for 1 of 1 rollout server" in line]
    assert said and waits and said[0] <= waits[0] + 1, proc.stderr[-3000:]  # with the first note
    assert "(connection refused)" in lines[said[0]]
    assert lines[-1].startswith(f"error: rollout.servers: {url} not ready after 10 s")
    assert f"nothing listens at {url[7:]} (connection refused for the last" in lines[-1]
