"""The elastic fleet's join rule, between two steps (``ServerConnection.refresh``) with real
in-process servers and the http transport: a server added to ``rollout.servers_file`` joins the
rotation once it is ready and serves the learner's weights under the learner's version, never
before. A second each, where the end-to-end run (``tests/learner/test_elastic_fleet.py``)
takes minutes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from grpo_common.net import free_port
from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model


class _Policy(torch.nn.Module):
    """What the connection pushes from: the learner's policy holds the HF model as ``model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _served(url: str) -> tuple[int, float]:
    """A server's weight version and the checksum of the weights it serves."""
    checksum = httpx.get(f"{url}/weights/checksum", timeout=30).raise_for_status().json()
    return checksum["weight_version"], checksum["checksum"]


@pytest.fixture
def fleet(tmp_path, start_server, tiny_model_dir) -> Iterator[dict]:
    """Four servers of the tiny model (one, ``other``, of other shapes), a servers file
    listing the first, and a learner connected to it whose weights differ from the served ones,
    synced as version 3."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.config.rollout import RolloutConfig
    from learner.run.checkpoint import TrainerState
    from learner.servers.connection import ServerConnection
    from learner.servers.pool import EventLoopThread
    from learner.sync import make_transport
    from rollout_server.client import RolloutClient

    learner_dir = save_tiny_model(tmp_path / "learner", seed=1)
    other_dir = save_tiny_model(tmp_path / "other", seed=0, hidden=32)
    policy = _Policy(AutoModelForCausalLM.from_pretrained(learner_dir, dtype=torch.float32))
    same, other = ServerSettings(model=str(tiny_model_dir)), ServerSettings(model=str(other_dir))
    loop = EventLoopThread()
    with (
        start_server(same) as a,
        start_server(same) as b,
        start_server(same) as newer,
        start_server(other) as odd,
    ):
        listing = tmp_path / "servers.txt"
        listing.write_text(f"{a.url}\n")
        rollout = RolloutConfig(servers_file=str(listing), max_retries=0, ready_timeout_s=10)
        client = RolloutClient([a.url], max_retries=0)
        syncer = make_transport(rollout, client)
        state = TrainerState()
        state.weight_version = 3
        conn = ServerConnection(rollout, Accelerator(cpu=True), loop, client, syncer, policy, state)
        try:
            conn.resync()
            yield {"conn": conn, "listing": listing, "a": a.url, "b": b.url,
                   "newer": newer.url, "odd": odd.url}  # fmt: skip
        finally:
            conn.close()
            loop.close()


def test_a_listed_server_joins_once_ready_with_the_learners_weights_and_version(fleet):
    conn, listing, a, b = fleet["conn"], fleet["listing"], fleet["a"], fleet["b"]
    learner_served = _served(a)
    assert learner_served[0] == 3
    base = _served(b)
    assert base[0] == 0 and base[1] != learner_served[1]  # b serves the model it loaded

    dead = f"http://127.0.0.1:{free_port()}"  # listed, nothing there yet: not ready
    listing.write_text(f"{a}\n{dead}\n")
    conn.refresh()
    assert conn.client.servers == [a] and conn.fleet.joined_total == 0

    listing.write_text(f"{a}\n{dead}\n{b}\n")
    conn.refresh()
    assert conn.client.servers == [a, b]  # in listing order
    assert _served(b) == learner_served  # the learner's weights, under the learner's version
    assert conn.state.weight_version == 3 and conn.fleet.joined_total == 1

    conn.refresh()  # in rotation, at the learner's version: nothing more happens
    assert conn.client.servers == [a, b] and conn.fleet.joined_total == 1
    assert conn.metrics() == {"fleet/servers": 2.0, "fleet/joined": 1.0, "fleet/left": 0.0}


def test_a_listed_server_that_cannot_serve_the_learners_version_stays_out(fleet, caplog):
    """One serving a newer version (another learner updates it) is left out; one that refuses
    the weights (another model's shapes) stays out: neither ever gets a request."""
    from learner.config.sync import HttpSyncConfig
    from learner.sync.http import HttpTransport
    from rollout_server.client import RolloutClient

    conn, listing, a = fleet["conn"], fleet["listing"], fleet["a"]
    newer, odd = fleet["newer"], fleet["odd"]
    other_learner = RolloutClient([newer], max_retries=0)
    pushed = HttpTransport(HttpSyncConfig(), other_learner, ready_timeout_s=10)
    conn.loop.run(pushed.push(conn.policy.model, 7))
    conn.loop.run(other_learner.aclose())
    odd_before = _served(odd)

    listing.write_text(f"{a}\n{newer}\n{odd}\n")
    with caplog.at_level("WARNING"):
        conn.refresh()
    assert conn.client.servers == [a] and conn.fleet.joined_total == 0
    assert f"rollout server {newer} serves weight version 7, newer than" in caplog.text
    assert "giving the weights to joining server(s) failed" in caplog.text
    assert _served(newer)[0] == 7 and _served(odd) == odd_before  # neither was changed
