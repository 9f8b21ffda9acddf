"""``/docs`` and ``/redoc`` render without internet access: every script and stylesheet their
pages load is served by the rollout server itself, not by a CDN."""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from rollout_server.settings import ServerSettings


class AssetLinks(HTMLParser):
    """The URLs of a page's ``<script src>`` and ``<link rel=stylesheet href>``."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self.styles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"] or "")
        if tag == "link" and a.get("rel") == "stylesheet" and a.get("href"):
            self.styles.append(a["href"] or "")


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir)), wait_ready=False) as s:
        yield s


def _assets(server, page: str) -> AssetLinks:
    resp = httpx.get(f"{server.url}{page}", timeout=30)
    assert resp.status_code == 200, resp.text
    links = AssetLinks()
    links.feed(resp.text)
    return links


def _fetch_local(server, page: str, url: str) -> httpx.Response:
    """GET an asset a page names, after checking that it names this server."""
    absolute = urljoin(f"{server.url}{page}", url)
    assert urlsplit(absolute).netloc == urlsplit(server.url).netloc, (
        f"{page} loads {url} from another host"
    )
    resp = httpx.get(absolute, timeout=30)
    assert resp.status_code == 200, (url, resp.status_code)
    return resp


def test_swagger_ui_assets_come_from_the_server(server):
    links = _assets(server, "/docs")
    assert links.scripts and links.styles, "the page names no Swagger UI JS or CSS"
    for url in links.scripts:
        resp = _fetch_local(server, "/docs", url)
        assert "javascript" in resp.headers["content-type"]
        assert "SwaggerUIBundle" in resp.text
    for url in links.styles:
        resp = _fetch_local(server, "/docs", url)
        assert resp.headers["content-type"].startswith("text/css")
        assert ".swagger-ui" in resp.text


def test_redoc_assets_come_from_the_server(server):
    links = _assets(server, "/redoc")
    assert links.scripts, "the page names no ReDoc JS"
    for url in links.scripts:
        resp = _fetch_local(server, "/redoc", url)
        assert "javascript" in resp.headers["content-type"]
        assert len(resp.content) > 100_000  # the ReDoc bundle, not an error page
    for url in links.styles:
        _fetch_local(server, "/redoc", url)
