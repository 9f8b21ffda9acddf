"""``/init_weight_transfer_engine`` against a trainer that never completes the rendezvous: a
peer that accepts the connection and never speaks, and a closed port. The server answers 502
within ``timeout_s`` and serves generations meanwhile; a later init joins a real trainer."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rollout_server.protocol import WeightTransferInitInfo
from rollout_server.settings import ServerSettings
from rollout_server.weight_transfer.gloo import trainer_init

IDS = {"prompts": [[1, 2, 3]], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir))) as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture
def silent_peer() -> Iterator[int]:
    """A port whose listener accepts every connection and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for conn in accepted:
        conn.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_info(port: int, **extra: object) -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, **extra}  # fmt: skip


def test_a_silent_peer_is_given_up_at_timeout_s_and_generation_goes_on(http, silent_peer):
    answer: dict[str, object] = {}

    def init() -> None:
        start = time.monotonic()
        r = http.post(
            "/init_weight_transfer_engine",
            json={"init_info": _init_info(silent_peer, timeout_s=4)},
        )
        answer["r"], answer["s"] = r, time.monotonic() - start

    waiter = threading.Thread(target=init)
    waiter.start()
    time.sleep(1.0)
    r = http.post("/generate", json=IDS)  # served while the init waits
    assert r.status_code == 200, r.text
    waiter.join(timeout=120)
    assert not waiter.is_alive(), "the init never answered"
    r = answer["r"]
    assert isinstance(r, httpx.Response) and r.status_code == 502, r.text
    assert "within init_info.timeout_s=4 s" in r.json()["detail"], r.text
    assert 3.5 < answer["s"] < 40  # type: ignore[operator]


def test_a_closed_port_answers_within_timeout_s(http):
    start = time.monotonic()
    r = http.post(
        "/init_weight_transfer_engine", json={"init_info": _init_info(_closed_port(), timeout_s=3)}
    )
    assert r.status_code == 502 and "within init_info.timeout_s=3 s" in r.json()["detail"], r.text
    assert time.monotonic() - start < 30


def test_the_default_timeout_is_the_documented_60_s():
    info = WeightTransferInitInfo.model_validate(_init_info(1234))
    assert info.timeout_s == 60.0


def test_after_an_abandoned_join_a_real_trainer_joins(http, silent_peer):
    r = http.post(
        "/init_weight_transfer_engine", json={"init_info": _init_info(silent_peer, timeout_s=2)}
    )
    assert r.status_code == 502, r.text
    info = _init_info(_closed_port())
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(trainer_init, info, 30.0)
        r = http.post("/init_weight_transfer_engine", json={"init_info": {**info, "timeout_s": 30}})
        assert r.status_code == 200, r.text
        trainer.result(timeout=60).close()
    assert http.post("/start_weight_update", json={}).status_code == 200
    assert http.post("/finish_weight_update", json={}).status_code == 200
