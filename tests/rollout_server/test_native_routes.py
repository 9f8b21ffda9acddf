"""vLLM's RL routes on our server: the test plays a trainer written for vLLM (the gloo twin of
its NCCL engine) against a real server on loopback, and checks what this server adds: the update
applied at once at finish as a new version, a failed receive leaving everything as it was, and
inputs refused by name before anything is received."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import torch

from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model
from rollout_server.weight_digest import params_checksum
from rollout_server.weight_transfer.gloo import GlooGroup, trainer_init, trainer_send_weights
from tests.server_metrics import metric

KEY = "native-routes-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW = 600.0  # seconds a request may take on a loaded machine before the test gives up


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    """The served architecture with other random weights: what the trainer sends."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-native-b"), seed=1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir), api_key=KEY)) as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(http: httpx.Client) -> GlooGroup:
    """The trainer's init and the server's, at the same time (each blocks until both joined)."""
    info = {"master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1,
            "world_size": 2}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(trainer_init, info, 10.0)
        r = http.post("/init_weight_transfer_engine", json={"init_info": {**info, "timeout_s": 10}})
        assert r.status_code == 200, r.text
        assert r.json() == {"message": "Weight transfer initialized"}
        return trainer.result(timeout=10)


def _update_info(named: list[tuple[str, torch.Tensor]]) -> dict:
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "packed": False,
    }


def _served(http: httpx.Client) -> tuple[int, float]:
    checksum = http.get("/weights/checksum").json()
    assert http.get("/info").json()["weight_version"] == checksum["weight_version"]
    return checksum["weight_version"], checksum["checksum"]


def test_a_trainer_update_is_applied_at_finish_as_one_new_version(http, model_b):
    named = [(n, p.detach()) for n, p in model_b.named_parameters()]
    version, before = _served(http)
    assert http.get("/info").json()["weight_transfer_backend"] == "gloo"
    assert http.get("/get_world_size", params={"include_dp": True}).json() == {"world_size": 1}
    assert http.get("/get_world_size", params={"include_dp": False}).json() == {"world_size": 1}
    group = _join(http)
    try:
        r = http.post("/start_weight_update", json={"is_checkpoint_format": True})
        assert r.json() == {"message": "Weight update started"}, r.text
        half = len(named) // 2
        for part in (named[:half], named[half:]):  # two update_weights calls, one update
            with ThreadPoolExecutor(1) as pool:
                sent = pool.submit(trainer_send_weights, iter(part), group)
                r = http.post("/update_weights", json={"update_info": _update_info(part)})
                sent.result(timeout=30)
            assert r.status_code == 200 and r.json() == {"message": "Weights updated"}, r.text
        assert _served(http) == (version, before)  # staged: nothing serves before finish
        r = http.post("/finish_weight_update")
        assert r.status_code == 200 and r.json() == {"message": "Weight update finished"}
    finally:
        group.close()
    new_version, after = _served(http)
    assert new_version == version + 1
    assert after == pytest.approx(params_checksum(model_b), rel=1e-9)
    assert after != pytest.approx(before, rel=1e-6)


def test_a_sender_that_dies_leaves_the_served_weights_and_version(http, model_b):
    named = [(n, (p.detach() * 0.5)) for n, p in model_b.named_parameters()]
    version, before = _served(http)
    group = _join(http)
    assert http.post("/start_weight_update", json={}).status_code == 200

    def die_midway() -> None:
        trainer_send_weights(iter(named[:2]), group)  # fewer tensors than announced
        time.sleep(0.3)
        group.close()

    sender = threading.Thread(target=die_midway)
    sender.start()
    started = time.monotonic()
    r = http.post("/update_weights", json={"update_info": _update_info(named)})
    sender.join()
    assert r.status_code == 502, r.text
    assert "unchanged" in r.json()["detail"] and time.monotonic() - started < 10
    assert _served(http) == (version, before)
    assert http.get("/ready").status_code == 200
    assert http.post("/finish_weight_update").status_code == 409  # the update was dropped
    r = http.post("/v1/completions", json={"prompt": [[97, 98]], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_bad_update_info_is_refused_by_name_before_anything_is_received(http, model_b):
    named = [(n, p.detach()) for n, p in model_b.named_parameters()]
    good = _update_info(named[:2])
    (n0, t0), (n1, _) = named[:2]
    cases = [
        ({**good, "dtype_names": good["dtype_names"][:1]}, "update_info.dtype_names"),
        ({**good, "shapes": good["shapes"][:1]}, "update_info.shapes"),
        ({**good, "names": ["nope", n1]}, "update_info.names[0]"),
        ({**good, "names": [n0, n0], "shapes": [list(t0.shape)] * 2}, "update_info.names[1]"),
        ({**good, "dtype_names": ["float32", "complex64"]}, "update_info.dtype_names[1]"),
        ({**good, "shapes": [list(t0.shape), [1, 2, 3]]}, "update_info.shapes[1]"),
        ({**good, "packed": True}, "packed"),
        ({**good, "update_kind": "sparse_flat", "num_updates_list": [1, 1]}, "sparse"),
        ({"names": [n0]}, "update_info.dtype_names"),
        ({**good, "surprise": 1}, "update_info.surprise"),
    ]
    group = _join(http)
    try:
        assert http.post("/start_weight_update").status_code == 200
        for update_info, words in cases:
            r = http.post("/update_weights", json={"update_info": update_info})
            assert r.status_code == 400, (update_info, r.text)
            assert words in r.json()["detail"], (words, r.json()["detail"])
        too_many = _update_info(named * 3)
        r = http.post("/update_weights", json={"update_info": too_many})
        assert r.status_code == 400 and "update_info.names has" in r.json()["detail"]
        # nothing was received: the group still carries a real update
        with ThreadPoolExecutor(1) as pool:
            sent: Future = pool.submit(trainer_send_weights, iter(named[:2]), group)
            r = http.post("/update_weights", json={"update_info": good})
            sent.result(timeout=30)
        assert r.status_code == 200, r.text
        assert http.post("/finish_weight_update").status_code == 200
    finally:
        group.close()
    r = http.post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}})
    assert r.status_code == 400 and "init_info.master_address" in r.json()["detail"]


def test_steps_out_of_order_answer_409(http):
    assert http.post("/update_weights", json={"update_info": _update_info([])}).status_code == 409
    assert http.post("/finish_weight_update").status_code == 409
    group = _join(http)
    try:
        assert http.post("/start_weight_update").status_code == 200
        r = http.post("/start_weight_update")
        assert r.status_code == 409 and "already open" in r.json()["detail"]
        assert http.post("/finish_weight_update").status_code == 200  # nothing sent: no version
        assert http.post("/finish_weight_update").status_code == 409
    finally:
        group.close()


def test_pause_holds_new_generations_until_resume(http, server):
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert http.post("/pause", params={"mode": "sometimes"}).status_code == 422
    assert http.get("/is_paused").json() == {"is_paused": True}
    with ThreadPoolExecutor(1) as pool:
        gen = pool.submit(http.post, "/generate", json={"prompts": [[97]], "max_tokens": 2})
        time.sleep(0.5)
        assert not gen.done()  # queued behind the pause
        assert http.post("/resume").json() == {"status": "resumed"}
        assert gen.result(timeout=30).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause").json() == {"status": "paused"}  # mode=abort, the default
    assert http.post("/resume").status_code == 200
    assert httpx.post(f"{server.url}/pause").status_code == 401  # the key, as on every route


def test_vllm_sleep_and_wake_up_query_params(http):
    assert http.post("/sleep", params={"level": 3}).status_code == 422  # the query is read
    r = http.post("/sleep", params={"level": 1, "mode": "abort"})
    assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": 1}, r.text
    r = http.post("/wake_up", params={"tags": "weights"})
    assert r.status_code == 200 and r.json()["is_sleeping"] is True  # kv_cache still asleep
    r = http.post("/wake_up", params={"tags": ["kv_cache"]})
    assert r.json() == {"is_sleeping": False, "level": 0}
    assert http.get("/is_sleeping").json()["is_sleeping"] is False


def test_vllm_completions_with_token_id_prompts(http):
    prompts = [[97, 98, 99], [100, 101]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 1.0, "top_p": 1.0,
            "top_k": -1, "seed": 3, "logprobs": 0, "return_token_ids": True,
            "stop_token_ids": [], "ignore_eos": True, "skip_special_tokens": False}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt_index * n + k
    for c in choices:
        assert c["prompt_token_ids"] == prompts[c["index"] // 2]
        assert len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) == 5
        assert c["finish_reason"] == "length"


def test_the_weight_transfer_backend_flag_reaches_the_settings():
    from rollout_server.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["--model", "m", "--weight-transfer-backend", "nccl"])
    assert settings_from_args(args).weight_transfer_backend == "nccl"
    assert (
        settings_from_args(build_parser().parse_args(["--model", "m"])).weight_transfer_backend
        is None
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--weight-transfer-backend", "gloo"])


def test_finish_takes_the_trainers_version_and_refuses_an_older_one(http, model_b):
    """``/finish_weight_update?version=N`` (ours; vLLM ignores it): a learner resyncing a
    restarted server keeps its own version; a version not newer than the served one is a 409
    that leaves the update open for a finish without it."""
    named = [(n, p.detach()) for n, p in model_b.named_parameters()]
    version, _ = _served(http)
    group = _join(http)
    try:
        assert http.post("/start_weight_update", json={}).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(trainer_send_weights, iter(named), group)
            r = http.post("/update_weights", json={"update_info": _update_info(named)})
            sent.result(timeout=30)
        assert r.status_code == 200, r.text
        r = http.post("/finish_weight_update", params={"version": version})
        assert r.status_code == 409 and "not newer" in r.json()["detail"], r.text
        r = http.post("/finish_weight_update", params={"version": version + 10})
        assert r.status_code == 200, r.text
    finally:
        group.close()
    assert _served(http)[0] == version + 10


LONG = {"prompts": [[97]], "n": 4, "max_tokens": 600, "ignore_eos": True}


def _in_flight(http: httpx.Client) -> float:
    return metric(http.get("/metrics").text, "rollout_generate_in_flight")


def _counts(http: httpx.Client) -> tuple[float, float]:
    """Completion tokens served and samples finished by length, as the server counted them."""
    text = http.get("/metrics").text

    def counted(name: str, **labels: str) -> float:
        try:
            return metric(text, name, **labels)
        except KeyError:  # a labelled counter shows up at its first count
            return 0.0

    return (
        counted("rollout_generation_tokens_total"),
        counted("rollout_samples_total", finish_reason="length"),
    )


def _start_long(pool: ThreadPoolExecutor, http: httpx.Client) -> Future:
    gen = pool.submit(http.post, "/generate", json=LONG, timeout=SLOW)
    deadline = time.monotonic() + SLOW
    while _in_flight(http) < 1:
        assert time.monotonic() < deadline and not gen.done(), "the generation never started"
        time.sleep(0.05)
    return gen


def test_pause_abort_cancels_the_generations_in_flight_and_wait_lets_them_finish(http):
    """vLLM's default ``/pause`` (mode=abort) cuts the generations in flight short: each answers
    503 saying why, none of its tokens is served or counted, and the server is paused;
    ``mode=wait`` answers only after the one in flight finished, whole. What is checked is
    which generation was cut and which finished (answers, token counts, finish reasons, the
    server's counters), not how long either took: a loaded machine changes only the latter."""
    with ThreadPoolExecutor(1) as pool:
        tokens, by_length = _counts(http)
        gen = _start_long(pool, http)
        r = http.post("/pause", params={"mode": "abort"}, timeout=SLOW)
        assert r.json() == {"status": "paused"}
        answer = gen.result(timeout=SLOW)
        assert answer.status_code == 503, answer.text
        assert "aborted by POST /pause?mode=abort" in answer.json()["detail"]
        assert _in_flight(http) == 0 and http.get("/is_paused").json() == {"is_paused": True}
        assert _counts(http) == (tokens, by_length)  # cut short: nothing of it was served
        assert http.post("/resume").status_code == 200

        gen = _start_long(pool, http)
        r = http.post("/pause", params={"mode": "wait"}, timeout=SLOW)
        assert r.json() == {"status": "paused"}
        # /pause?mode=wait answered once the generation in flight ended (it was, just before)
        assert _in_flight(http) == 0 and http.get("/is_paused").json() == {"is_paused": True}
        whole = gen.result(timeout=SLOW)
        assert whole.status_code == 200, whole.text
        samples = whole.json()["results"][0]["samples"]
        assert len(samples) == LONG["n"]
        assert all(len(s["token_ids"]) == LONG["max_tokens"] for s in samples)
        assert all(s["finish_reason"] == "length" for s in samples)
        n_tokens = LONG["n"] * LONG["max_tokens"]
        assert _counts(http) == (tokens + n_tokens, by_length + LONG["n"])
        assert http.post("/resume").status_code == 200
    assert http.post("/generate", json={"prompts": [[97]], "max_tokens": 2}).status_code == 200
