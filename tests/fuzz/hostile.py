"""The hostile pass of ``make fuzz``: requests built to cost the server time or memory, drawn by
Hypothesis and sent to the running server, beside schemathesis' passes over the OpenAPI.

- ``chat_template_kwargs`` mixing template variables with apply_chat_template's own parameters
  (``chat_template`` carrying templates that loop or build huge strings), nested values and
  odd names;
- long text prompts (thousands to millions of characters, some over the JSON body limit);
- made-up HTTP methods on known and unknown paths.

Each answer must come within the response-time limit and be no 5xx; afterwards the metrics must
label no made-up method and hold a bounded number of series (made-up methods and paths fold
into one label each). The
server's peak memory is watched by the runner for the whole run.
"""

from __future__ import annotations

import collections
import re
import string
import time
from typing import Any

import httpx
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from rollout_server.middleware import HTTP_METHODS
from rollout_server.protocol.template_kwargs import RESERVED_TEMPLATE_KWARGS

TEMPLATES = [
    "{{ 'ABC' * 3 }}",
    "{{ 'a' * 30000000 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
]
MAX_SERIES = 300  # rollout_http_requests_total series: routes x methods x statuses, bounded

Request = tuple[str, str, dict[str, Any] | None]

_kwargs = st.dictionaries(
    keys=st.one_of(
        st.sampled_from([*sorted(RESERVED_TEMPLATE_KWARGS), "enable_thinking", "loops"]),
        st.text(max_size=12),
    ),
    values=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
        st.sampled_from(TEMPLATES),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    ),
    max_size=4,
)


@st.composite
def _chat(draw: st.DrawFn) -> Request:
    messages = [{"role": "user", "content": draw(st.text(max_size=60))}]
    kwargs = draw(_kwargs)
    if draw(st.booleans()):
        return "POST", "/generate", {"prompts": [messages], "max_tokens": 2,
                                     "chat_template_kwargs": kwargs}  # fmt: skip
    return "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                            "chat_template_kwargs": kwargs}  # fmt: skip


@st.composite
def _long_text(draw: st.DrawFn) -> Request:
    text = draw(st.sampled_from(["a", "ab ", " ", "é", "\U0001f642", "<|im_start|>"])) * draw(
        st.integers(1_000, 2_000_000)
    )
    if draw(st.booleans()):
        return "POST", "/generate", {"prompts": [text], "max_tokens": 2}
    return "POST", "/v1/completions", {"prompt": text, "max_tokens": 2}


_path = st.one_of(
    st.sampled_from(["/health", "/generate", "/metrics", "/weights/update", "/v1/models"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-_./", max_size=24).map(
        lambda p: "/" + p
    ),
)
_method = st.one_of(
    st.from_regex(r"[A-Z]{3,10}", fullmatch=True), st.sampled_from(["PATCH", "PUT", "DELETE"])
)
_unknown_method = st.tuples(_method, _path, st.none())

REQUESTS = st.one_of(_chat(), _long_text(), _unknown_method)
# sent on every run, whatever Hypothesis draws: the templates and the longest text the JSON
# body limit lets through
EXAMPLES: list[Request] = [
    *(
        ("POST", "/generate", {"prompts": [[{"role": "user", "content": "hi"}]],
                               "max_tokens": 2, "chat_template_kwargs": {"chat_template": t}})
        for t in TEMPLATES
    ),
    ("POST", "/generate", {"prompts": ["a" * 1_000_000], "max_tokens": 2}),
    ("BREW", "/health", None),
]  # fmt: skip


def hostile_pass(
    url: str, headers: dict[str, str], examples: int, seed_value: int, max_s: float
) -> tuple[list[str], dict[str, collections.Counter[int]]]:
    """Problems found (empty: passed) and the requests sent, by route and status (made-up
    methods counted together)."""
    by_route: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    client = httpx.Client(base_url=url, headers=headers, timeout=max_s * 3)

    @seed(seed_value)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(REQUESTS)
    def check(request: Request) -> None:
        method, path, body = request
        start = time.monotonic()
        r = client.request(method, path, json=body)
        took = time.monotonic() - start
        kind = "made-up method" if body is None else f"{method} {path}"
        by_route[f"hostile: {kind}"][r.status_code] += 1
        what = f"{method} {path} ({len(r.request.content)} bytes)"
        assert r.status_code < 500, f"{what} answered {r.status_code}: {r.text[:300]}"
        assert took < max_s, f"{what} took {took:.1f} s, more than {max_s} s"

    for request in EXAMPLES:
        check = example(request)(check)
    problems = []
    try:
        check()
        text = client.get("/metrics").text
        methods = set(re.findall(r'rollout_http_requests_total\{[^}]*method="([^"]*)"', text))
        if methods - {*HTTP_METHODS, "other"}:
            made_up = sorted(methods - {*HTTP_METHODS, "other"})
            problems.append(f"made-up methods became metric labels: {made_up[:5]} ...")
        series = sum(line.startswith("rollout_http_requests_total{") for line in text.splitlines())
        if series > MAX_SERIES:
            problems.append(f"the metrics hold {series} request series, more than {MAX_SERIES}")
    except Exception as exc:  # the falsifying example, as Hypothesis reports it
        problems.append(f"hostile pass: {type(exc).__name__}: {str(exc)[:800]}")
    finally:
        client.close()
    return problems, by_route
