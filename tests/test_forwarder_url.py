"""The engine URL of each forwarded request: the gateway's path on the engine's base URL,
parsed once per distinct path."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pylon.config import UpstreamSettings
from pylon.forwarder import PARSED_URLS_KEPT, Forwarder


class RecordingTransport(httpx.AsyncBaseTransport):
    """Answers 204 to everything and keeps each request it was handed."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(204)


def forwarded_urls(paths: list[str]) -> list[httpx.URL]:
    transport = RecordingTransport()
    forwarder = Forwarder(transport, UpstreamSettings(url="http://engine.internal:8000"))

    async def scenario() -> None:
        for path in paths:
            async with forwarder.exchange(
                method="POST", path=path, headers=(), content=b"{}", request_id=None
            ) as response:
                assert response.status == 204

    asyncio.run(scenario())
    return [request.url for request in transport.requests]


def test_the_path_and_query_go_to_the_engine_base_url() -> None:
    (url,) = forwarded_urls(["/v1/chat/completions?stream=true&x=%2F"])
    assert url == httpx.URL("http://engine.internal:8000/v1/chat/completions?stream=true&x=%2F")
    assert url.raw_path == b"/v1/chat/completions?stream=true&x=%2F"


class CountingURL(httpx.URL):
    """httpx.URL, counting the strings it parses."""

    parsed: list[str] = []

    def __init__(self, url: httpx.URL | str = "", **kwargs: object) -> None:
        if isinstance(url, str):
            CountingURL.parsed.append(url)
        super().__init__(url, **kwargs)


@pytest.fixture
def counted_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    CountingURL.parsed = []
    monkeypatch.setattr(httpx, "URL", CountingURL)
    return CountingURL.parsed


def test_a_path_seen_before_is_not_parsed_again(counted_parses: list[str]) -> None:
    urls = forwarded_urls(["/v1/completions", "/v1/completions", "/v1/chat/completions"])
    assert [url.path for url in urls] == ["/v1/completions"] * 2 + ["/v1/chat/completions"]
    assert counted_parses == [
        "http://engine.internal:8000/v1/completions",
        "http://engine.internal:8000/v1/chat/completions",
    ]


def test_the_parsed_urls_are_bounded(counted_parses: list[str]) -> None:
    paths = [f"/v1/models/{index}" for index in range(PARSED_URLS_KEPT + 1)]
    urls = forwarded_urls([*paths, paths[0]])
    # The first path was evicted by the last new one, so it is parsed again.
    assert len(counted_parses) == PARSED_URLS_KEPT + 2
    assert urls[-1] == urls[0]
