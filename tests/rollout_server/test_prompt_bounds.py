"""What a client's prompt may cost before it is generated from: the chat template is the
server's own (``chat_template_kwargs`` are template variables, never a template), its rendering
has a deadline and a character bound, text is bounded by characters before it is tokenized,
JSON bodies have a small limit of their own, and none of that work holds up the decoding of
other requests, a disconnected client's queued work, or the server's shutdown."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from rollout_server.engine.prompt_render import CHARS_PER_TOKEN, RENDER_DEADLINE_S
from rollout_server.protocol import Limits
from rollout_server.settings import ServerSettings
from rollout_server.tiny import CHAT_TEMPLATE

CHAT = [{"role": "user", "content": "hi"}]
# The server's own template, looping 10^10 times when a client sets the variable `loops`.
LOOPING_TEMPLATE = (
    "{%- if loops is defined %}{%- for i in range(loops) %}{%- for j in range(loops) %}"
    "{%- endfor %}{%- endfor %}{%- endif %}\n" + CHAT_TEMPLATE
)
LOOP = {"prompts": [CHAT], "max_tokens": 2, "chat_template_kwargs": {"loops": 100000}}
IDS = {"prompts": [[1, 2, 3]], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def looping_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model whose chat template a template variable can keep looping."""
    target = tmp_path_factory.mktemp("looping-template") / "model"
    shutil.copytree(tiny_model_dir, target)
    (target / "chat_template.jinja").write_text(LOOPING_TEMPLATE)
    return target


@pytest.fixture(scope="module")
def server(start_server, looping_model_dir):
    limits = Limits(max_prompt_len=64, max_json_body_mb=1, max_body_mb=8)
    with start_server(ServerSettings(model=str(looping_model_dir), limits=limits)) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"chat_template": "{{ 'ABC' * 3 }}"}, "'chat_template' is not accepted"),
        ({"tokenize": True}, "'tokenize' is not accepted"),
        ({"x": {"nested": 1}}, "'x': a dict is not accepted"),
        ({"x": "a" * 5000}, "'x': a string of 5000 characters"),
        ({"no such-name": 1}, "is not a template variable name"),
    ],
)
def test_template_selecting_kwargs_are_refused_naming_the_field(http, kwargs, named):
    r = http.post("/generate", json={"prompts": [CHAT], "chat_template_kwargs": kwargs})
    assert r.status_code == 422, r.text
    assert "chat_template_kwargs" in r.json()["detail"] and named in r.json()["detail"], r.text
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": kwargs})
    assert r.status_code == 422 and named in r.json()["detail"], r.text
    # template variables are fine
    r = http.post(
        "/generate",
        json={
            "prompts": [CHAT],
            "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert r.status_code == 200, r.text


def test_a_looping_template_is_stopped_and_others_decode_meanwhile(http, server):
    answers: dict[str, tuple[float, httpx.Response]] = {}

    def send(name: str, body: dict) -> None:
        r = http.post("/generate", json=body)
        answers[name] = (time.monotonic(), r)

    loop = threading.Thread(target=send, args=("loop", LOOP))
    loop.start()
    time.sleep(1.0)  # the template is looping now
    send("ids", IDS)
    send("text", {"prompts": ["hello"], "max_tokens": 2})
    loop.join(timeout=120)
    assert not loop.is_alive(), "the looping template was never stopped"
    done_loop, r = answers["loop"]
    assert r.status_code == 400, r.text
    assert f"did not finish rendering within {RENDER_DEADLINE_S:g} s" in r.json()["detail"]
    assert "chat_template_kwargs" in r.json()["detail"]
    # token ids decoded while the template looped; the text prompt waited at most the deadline
    done_ids, r = answers["ids"]
    assert r.status_code == 200 and done_ids < done_loop, r.text
    assert answers["text"][1].status_code == 200, answers["text"][1].text


def test_long_text_and_chat_prompts_are_refused_by_characters_before_tokenizing(http):
    max_chars = 64 * CHARS_PER_TOKEN
    start = time.monotonic()
    r = http.post("/generate", json={"prompts": ["a" * 900_000]})
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "prompts[0] has 900000 characters of text" in detail, detail
    assert f"more than the {max_chars} allowed before tokenizing" in detail, detail
    assert "max_prompt_len = 64" in detail and "--max-prompt-len" in detail, detail
    chat = [{"role": "user", "content": "b" * (max_chars + 1)}]
    r = http.post("/v1/chat/completions", json={"messages": chat})
    assert r.status_code == 400, r.text
    assert "characters of chat messages and tools" in r.json()["detail"], r.text
    assert time.monotonic() - start < 30
    # within the bound in characters, the token limit still speaks
    r = http.post("/generate", json={"prompts": ["a" * max_chars]})
    assert r.status_code == 400 and f"has {max_chars} tokens" in r.json()["detail"], r.text


def test_json_routes_have_a_small_body_limit_of_their_own(http):
    r = http.post("/generate", json={"prompts": [[1] * 600_000]})  # 1.8 MB of JSON
    assert r.status_code == 413, r.text
    assert "max_json_body_mb=1 (--max-json-body-mb)" in r.json()["detail"], r.text
    # the weight uploads keep max_body_mb: 2 MB is not too large for them (only not weights)
    r = http.post(
        "/weights/update",
        content=b"\0" * 2 * 2**20,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 400, r.text


def test_queued_renders_of_clients_that_left_are_dropped(server):
    """Eight clients leave while their looping prompts wait: only the one rendering runs on."""

    def leave_early() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/generate", json=LOOP, timeout=0.5)

    clients = [threading.Thread(target=leave_early) for _ in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    start = time.monotonic()
    r = httpx.post(
        f"{server.url}/generate", json={"prompts": ["hello"], "max_tokens": 2}, timeout=120
    )
    assert r.status_code == 200, r.text
    # at most the one render that had started (RENDER_DEADLINE_S), not eight of them
    assert time.monotonic() - start < 4 * RENDER_DEADLINE_S


def test_shutdown_does_not_wait_for_a_render(start_server, looping_model_dir):
    from rollout_server.engine.transformers_engine import TransformersEngine

    settings = ServerSettings(model=str(looping_model_dir))
    engine = TransformersEngine(settings)
    engine.render_deadline_s = 60.0  # the render would outlive the shutdown by far
    with start_server(settings, engine) as s:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{s.url}/generate", json=LOOP, timeout=1.0)
        r = httpx.post(f"{s.url}/generate", json=IDS, timeout=60)
        assert r.status_code == 200, r.text
        start = time.monotonic()
    assert time.monotonic() - start < 25  # run_server gives up on the thread after 30 s
