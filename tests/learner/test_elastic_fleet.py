"""An elastic rollout fleet: servers listed in ``rollout.servers_file`` leave (killed, or taken
off the list) and join (added to it) while the learner trains. Every step is trained once, a
server gets requests only once it serves the learner's weight version, and no logged version
goes back."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from grpo_common.net import free_port
from learner.config import RolloutConfig
from learner.run.metrics import read_metrics
from rollout_server.client import RolloutClient, RolloutUnavailableError
from rollout_server.protocol import GenerateRequest
from rollout_server.settings import ServerSettings
from tests.learner.demo_runs import learner_env, serve_cmd, spawn_learner, wait_for_step

QUIET = ("run.progress_bar=false", "run.save_final=false", "run.tensorboard=false")


def _serve(model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return subprocess.Popen(serve_cmd(model, port), env=learner_env()), f"http://127.0.0.1:{port}"


def _fleet_learner(run_dir: Path, model: Path, listing: Path, *more: str) -> subprocess.Popen:
    """The demo learner on ``model`` with its servers from the file ``listing``."""
    sets = [*QUIET, f'model.name_or_path="{model}"', f'rollout.servers_file="{listing}"']
    return spawn_learner(run_dir, *sets, *more)


def _generate_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    found = re.findall(r'rollout_http_requests_total\{[^}]*route="/generate"[^}]*\} (\S+)', text)
    return sum(float(v) for v in found)


def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} not ready after {timeout_s} s"
        time.sleep(0.2)


def _version(url: str) -> int:
    return httpx.get(f"{url}/info", timeout=10).raise_for_status().json()["weight_version"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # four servers and a learner: 233 s on two cores busy with other jobs
def test_a_killed_server_leaves_and_a_listed_one_joins_at_the_current_version(
    tmp_path, tiny_model_dir
):
    """Three servers; one killed while the learner generates step 3 (its share goes to the
    others, the step is not lost); two steps later a fourth is added to the servers file and
    joins once it got the learner's weights under the learner's version (the rule alone, in a
    second: ``tests/learner/servers/test_fleet_join.py``)."""
    procs = [_serve(tiny_model_dir) for _ in range(3)]
    new, new_url = _serve(tiny_model_dir)  # ready before it is listed: its join is not raced
    try:  # by the end of a run that outpaces its start on a loaded machine
        _wait_ready(new_url)
    except AssertionError:
        for p in [*(p for p, _ in procs), new]:
            p.kill()
        raise
    listing = tmp_path / "servers.txt"
    listing.write_text("# the rollout fleet\n" + "".join(f"{u}\n" for _, u in procs))
    run_dir = tmp_path / "run"
    learner = _fleet_learner(
        run_dir, tiny_model_dir, listing, "run.steps=8", "sampling.max_tokens=16"
    )
    try:
        wait_for_step(run_dir, learner, 2)
        procs[0][0].kill()  # the learner is about to generate step 3, or generating it
        assert _version(new_url) == 0 and _generate_count(new_url) == 0
        wait_for_step(run_dir, learner, 4)
        with listing.open("a") as f:
            f.write(f"{new_url}  # joined later\n")
        seen = []  # (generate requests, weight version) of the new server, polled
        while learner.poll() is None:
            with contextlib.suppress(httpx.HTTPError):  # still starting
                seen.append((_generate_count(new_url), _version(new_url)))
            time.sleep(0.05)
        _, err = learner.communicate(timeout=300)
        final_version = _version(new_url)
        served_by_new = _generate_count(new_url)
    finally:
        learner.kill()
        for p in [*(p for p, _ in procs), new]:
            p.kill()
            p.wait()
    assert learner.returncode == 0, err[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    versions = [r["weight_version"] for r in records]
    assert versions == list(range(1, 9)), versions
    # every step's samples came from the weights of the step before: none from a server that
    # had not yet been given them
    assert [r["weight_version/min"] for r in records] == list(range(0, 8))
    assert [r["staleness"] for r in records] == [0.0] * 8
    sizes = [r["fleet/servers"] for r in records]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert records[-1]["fleet/joined"] == 1 and records[-1]["fleet/left"] == 1
    assert f"rollout server {procs[0][1]} taken out of rotation" in err
    joined = re.search(rf"joined at weight version (\d+): {re.escape(new_url)}", err)
    assert joined, err[-3000:]
    # the new server answered generate requests only while serving a synced version
    assert served_by_new > 0 and final_version == 8
    assert all(v >= int(joined.group(1)) for n, v in seen if n > 0), seen


def test_a_server_taken_off_the_list_leaves_and_a_broken_list_keeps_the_fleet(
    tmp_path, tiny_model_dir
):
    """An operator removes a server from the file: it gets no more requests. A file that
    becomes unreadable mid-run is a warning; the servers listed before keep serving."""
    procs = [_serve(tiny_model_dir) for _ in range(2)]
    url_a, url_b = (u for _, u in procs)
    listing = tmp_path / "servers.txt"
    listing.write_text(f"{url_a}\n{url_b}\n")
    run_dir = tmp_path / "run"
    learner = _fleet_learner(
        run_dir, tiny_model_dir, listing, "run.steps=6", "sampling.max_tokens=8"
    )
    try:
        wait_for_step(run_dir, learner, 1)
        listing.write_text(f"{url_b}\n")
        wait_for_step(run_dir, learner, 3)
        before = _generate_count(url_a)
        listing.write_text("not a url\n")
        _, err = learner.communicate(timeout=300)
        after = _generate_count(url_a)
    finally:
        learner.kill()
        for p, _ in procs:
            p.kill()
            p.wait()
    assert learner.returncode == 0, err[-3000:]
    assert after == before  # off the list: no more requests
    assert f"left the rotation: {url_a}" in err
    assert "rollout.servers_file: " in err and "keeping the servers listed before" in err
    records = read_metrics(run_dir)
    assert [r["weight_version"] for r in records] == list(range(1, 7))
    assert records[-1]["fleet/servers"] == 1


def test_the_client_moves_an_unreachable_servers_share_to_the_others(start_server, tiny_model_dir):
    """Seeded samples do not depend on which server drew them: the share of a dead server
    drawn by another is what the dead one would have drawn."""
    settings = ServerSettings(model=str(tiny_model_dir), engine="transformers")
    dead = f"http://127.0.0.1:{free_port()}"
    req = GenerateRequest(prompts=["a", "bb", "ccc", "dddd"], n=2, max_tokens=6, seed=7)

    async def both(url: str) -> tuple:
        async with RolloutClient([dead, url], max_retries=0) as client:
            out = await client.generate(req)
            return out, client.servers, client.dropped

    async def alone(url: str) -> list:
        async with RolloutClient(url) as client:
            return (await client.generate(req)).results

    with start_server(settings) as server:
        out, servers, dropped = asyncio.run(both(server.url))
        expected = asyncio.run(alone(server.url))
        with pytest.raises(RolloutUnavailableError):  # the last server is never dropped
            asyncio.run(both_dead(dead))
    assert servers == [server.url] and dropped == [dead]
    # the same draws; log-probs to float noise (the server batched the shards its own way)
    got = [s for r in out.results for s in r.samples]
    want = [s for r in expected for s in r.samples]
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert out.server == f"{server.url},{server.url}"


async def both_dead(dead: str) -> None:
    async with RolloutClient([dead], max_retries=0) as client:
        await client.generate(GenerateRequest(prompts=["a"], n=1, max_tokens=2))


def test_a_servers_file_is_checked_at_load(tmp_path):
    listing = tmp_path / "servers.txt"
    listing.write_text("http://a:8000\n# comment\n\nhttp://a:8000/\nhttps://b:9000  # tls\n")
    r = RolloutConfig(servers_file=str(listing))
    assert r.external and r.listed() == ["http://a:8000", "https://b:9000"]
    for text, message in [("", "names no server"), ("a:8000\n", "line 1: 'a:8000' is not a URL")]:
        listing.write_text(text)
        with pytest.raises(ValueError, match=message):
            RolloutConfig(servers_file=str(listing))
    with pytest.raises(ValueError, match="set servers or servers_file, not both"):
        RolloutConfig(servers=["http://a:1"], servers_file=str(listing))
    with pytest.raises(ValueError, match="cannot read"):
        RolloutConfig(servers_file=str(tmp_path / "missing"))


def test_a_server_that_fails_its_part_of_a_sync_leaves_and_the_others_are_synced(
    start_server, tiny_model_dir
):
    """Of two servers, one cannot be reached when the weights go out: the sync is pushed again
    to the other alone (which serves the new version), and the unreachable one is out of
    rotation, never serving a mix of versions."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.config.sync import HttpSyncConfig
    from learner.servers.pool import EventLoopThread, push_weights
    from learner.sync.http import HttpTransport

    settings = ServerSettings(model=str(tiny_model_dir), engine="transformers")
    dead = f"http://127.0.0.1:{free_port()}"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loop = EventLoopThread()
    try:
        with start_server(settings) as server:
            client = RolloutClient([server.url, dead], max_retries=0)
            syncer = HttpTransport(HttpSyncConfig(), client, ready_timeout_s=5)
            answers = push_weights(Accelerator(cpu=True), loop, syncer, model, least=3)
            assert [a.weight_version for a in answers] == [3]
            assert client.servers == [server.url] and client.dropped == [dead]
            assert _version(server.url) == 3
            loop.run(client.aclose())
    finally:
        loop.close()


def test_a_sync_whose_only_server_stays_away_is_one_error_naming_the_setting(tiny_model_dir):
    """No server left to sync: the error the learner prints as one line with a resume hint
    (exit 75), naming the wait's setting, not a transport's traceback."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.config.sync import HttpSyncConfig
    from learner.servers.pool import EventLoopThread, ServersLostError, push_weights
    from learner.sync.http import HttpTransport

    dead = f"http://127.0.0.1:{free_port()}"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loop = EventLoopThread()
    try:
        client = RolloutClient([dead], max_retries=0)
        syncer = HttpTransport(HttpSyncConfig(), client, ready_timeout_s=1)
        with pytest.raises(ServersLostError, match=r"rollout.ready_timeout_s = 1 s.*--resume"):
            push_weights(Accelerator(cpu=True), loop, syncer, model, least=1)
        loop.run(client.aclose())
    finally:
        loop.close()


def test_an_embedded_servers_rotation_is_the_server_started(caplog):
    """No rollout.servers: the rotation is the embedded server, never an empty listing (which
    warned after every step that no listed server was ready)."""
    from learner.servers.fleet import Fleet

    url = f"http://127.0.0.1:{free_port()}"

    async def plan() -> object:
        async with RolloutClient(url) as client:
            return await Fleet(RolloutConfig(), client).plan(3, dropped=set())

    got = asyncio.run(plan())
    assert not got.changes and got.members == [url]
    assert "no listed rollout server" not in caplog.text
