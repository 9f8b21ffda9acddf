"""The learner against external rollout servers that fail: killed mid-run (the learner waits,
gives the new one its weights under its own version and goes on), never back (one line, a
resume hint), unreachable, refusing the key, or serving another model (one line naming the
setting, exit 2)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest

from grpo_common.net import free_port
from learner.run.metrics import read_metrics
from learner.servers.pool import SERVERS_LOST_EXIT
from tests.learner.demo_runs import (
    assert_setup_error,
    kill_after_step,
    learner_env,
    serve_cmd,
    spawn_learner,
)

QUIET = ("run.progress_bar=false", "run.save_final=false", "run.tensorboard=false")


def _learner(run_dir: Path, model: Path, port: int, *overrides: str) -> subprocess.Popen:
    sets = [*QUIET, f'model.name_or_path="{model}"']
    sets += [f'rollout.servers=["http://127.0.0.1:{port}"]', *overrides]
    return spawn_learner(run_dir, *sets)


def test_a_server_killed_mid_generation_is_waited_for_and_the_run_goes_on(tmp_path, tiny_model_dir):
    """Down longer than the generate request's retries (about 3.5 s): the learner waits for the
    server, gives the new one its weights under its own version (not 1 again) and generates the
    step's prompts again; every step is trained once and the version never goes back."""
    port = free_port()
    server = subprocess.Popen(serve_cmd(tiny_model_dir, port), env=learner_env())
    run_dir = tmp_path / "run"
    learner = _learner(run_dir, tiny_model_dir, port, "run.steps=5", "sampling.max_tokens=32")
    try:
        kill_after_step(run_dir, learner, server, 2)
        time.sleep(8)
        server = subprocess.Popen(serve_cmd(tiny_model_dir, port), env=learner_env())
        _, err = learner.communicate(timeout=300)
    finally:
        learner.kill()
        server.kill()
        server.wait()
    assert learner.returncode == 0, err[-3000:]
    assert "went away while generating" in err and "rollout.reconnect_timeout_s" in err
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    versions = [r["weight_version"] for r in records]
    assert versions == sorted(versions) and versions == [1, 2, 3, 4, 5], versions
    assert [r["staleness"] for r in records] == [0.0] * 5


def test_a_server_that_stays_away_stops_the_run_in_one_line_with_a_resume_hint(
    tmp_path, tiny_model_dir
):
    port = free_port()
    server = subprocess.Popen(serve_cmd(tiny_model_dir, port), env=learner_env())
    run_dir = tmp_path / "run"
    learner = _learner(
        run_dir, tiny_model_dir, port, "run.steps=5", "rollout.reconnect_timeout_s=2"
    )
    try:
        kill_after_step(run_dir, learner, server, 1)
        _, err = learner.communicate(timeout=300)
    finally:
        learner.kill()
    assert learner.returncode == SERVERS_LOST_EXIT and "Traceback" not in err, err[-3000:]
    last = err.splitlines()[-1]
    assert f"the rollout server http://127.0.0.1:{port} went away" in last
    assert "rollout.reconnect_timeout_s = 2 s" in last and "--resume" in last


def test_an_unreachable_server_is_a_setup_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    assert_setup_error(
        tmp_path / "run",
        f'rollout.servers=["{url}"]',
        f"rollout.servers: {url} not ready after 3 s",
        "rollout.ready_timeout_s=3",
        model_loads=True,
    )


def test_a_refused_api_key_is_a_setup_error(tmp_path, start_server, tiny_model_dir):
    from rollout_server.settings import ServerSettings

    with start_server(ServerSettings(model=str(tiny_model_dir), api_key="the-right-key")) as s:
        assert_setup_error(
            tmp_path / "run",
            f'rollout.servers=["{s.url}"]',
            f"the rollout server {s.url} refused the API key (HTTP 401): give the learner the "
            "server's key as rollout.api_key_file",
            'rollout.api_key="a-wrong-key"',
            f'model.name_or_path="{tiny_model_dir}"',
            model_loads=True,
        )


@pytest.mark.parametrize("api", ["rollout-server", "vllm"])
def test_a_server_of_another_model_is_a_setup_error(tmp_path, start_server, tiny_model_dir, api):
    """The learner's tiny model is wider than the server's: the first sync is refused for its
    shapes, which no retry can change; over vLLM's RL routes too, where the refusal of
    /update_weights must not leave the learner waiting in its broadcast."""
    from rollout_server.settings import ServerSettings

    more = [f'rollout.server_api="{api}"']
    if api == "vllm":
        more.append('rollout.sync={type = "vllm", backend = "gloo"}')
    with start_server(ServerSettings(model=str(tiny_model_dir))) as s:
        assert_setup_error(
            tmp_path / "run",
            f'rollout.servers=["{s.url}"]',
            f"the rollout server {s.url} serves a model of other shapes than the learner's "
            "(model.name_or_path)",
            "model.tiny={hidden=96}",
            "run.steps=2",
            *more,
            model_loads=True,
        )


def test_a_push_never_takes_the_version_back(start_server, tiny_model_dir):
    """The version a sync pushes: the servers' own numbering where it is at least the learner's
    next one; the learner's where a server restarted (at 0), never 1 again; above every
    server's where they differ, so that all take it."""
    import asyncio

    from safetensors.torch import load_file

    from learner.config.rollout import RolloutConfig
    from learner.servers.pool import EventLoopThread, next_version
    from learner.sync import make_transport
    from rollout_server.client import RolloutClient
    from rollout_server.settings import ServerSettings

    emb = "model.embed_tokens.weight"
    weights = [(emb, load_file(str(tiny_model_dir / "model.safetensors"))[emb])]

    async def update(url: str, times: int) -> None:
        async with RolloutClient(url) as client:
            for _ in range(times):
                await client.update_weights(weights)

    settings = ServerSettings(model=str(tiny_model_dir))
    loop = EventLoopThread()
    with start_server(settings) as fresh, start_server(settings) as updated:
        asyncio.run(update(updated.url, 3))

        def version(urls: list[str], least: int) -> int | None:
            syncer = make_transport(RolloutConfig(), RolloutClient(urls), device="cpu")
            return next_version(loop, syncer, least)

        assert version([fresh.url], 13) == 13  # restarted: the learner's next version
        assert version([fresh.url], 1) is None  # the server's numbering gives 1
        assert version([updated.url], 4) is None  # the server's numbering gives 4
        assert version([updated.url], 3) is None  # a resync of a server that kept its weights
        assert version([updated.url], 10) == 10
        assert version([fresh.url, updated.url], 3) == 4  # both take 4: neither goes back
    loop.close()


def test_a_server_of_another_kind_is_a_setup_error_at_once(tmp_path):
    """A URL that answers HTTP but has no readiness route (here Python's own http.server, as a
    stock vllm serve has no /ready) is named at once, with the setting that speaks its API,
    instead of being waited for until rollout.ready_timeout_s."""
    import sys

    port = free_port()
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.2)
        start = time.monotonic()
        assert_setup_error(
            tmp_path / "run",
            f'rollout.servers=["{url}"]',
            f'rollout.servers: {url} is not the server rollout.server_api = "rollout-server" '
            "expects (its readiness route answered HTTP 404); is it a stock vllm serve? set "
            'rollout.server_api = "vllm"',
            "rollout.ready_timeout_s=300",
            model_loads=True,
        )
        assert time.monotonic() - start < 120  # not the 300 s of ready_timeout_s
    finally:
        other.kill()
        other.wait()
