"""The upstream client honours the proxy settings of its environment (HTTP_PROXY, NO_PROXY), as operators behind a
proxy expect, and maps what it cannot reach to backend errors."""

import pytest

from gateway.backends.base import BackendUnavailable
from gateway.backends.upstream_http import Unreached, UpstreamClient
from gateway.config import BackendSettings
from tests.clients.support import DenyProxy

pytestmark = pytest.mark.integration


async def test_requests_go_through_the_environments_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    with DenyProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "")
        client = UpstreamClient(BackendSettings(name="up", base_url="http://upstream.invalid/v1", models=["m"]))
        try:
            response = await client.open("POST", "/chat/completions", b"{}", {"Content-Type": "application/json"})
            assert response.status == 403  # the proxy's answer: the request went to it, not to the name
            await response.read(1024)
        finally:
            await client.aclose()
        assert proxy.attempts == ["POST http://upstream.invalid/v1/chat/completions HTTP/1.1"]


async def test_an_unreachable_upstream_is_a_retryable_backend_error() -> None:
    client = UpstreamClient(BackendSettings(name="up", base_url="http://127.0.0.1:9/v1", models=["m"],
                                            connect_timeout=2))
    try:
        with pytest.raises(Unreached) as info:
            await client.open("POST", "/chat/completions", b"{}")
    finally:
        await client.aclose()
    assert isinstance(info.value.error, BackendUnavailable) and info.value.retry
    assert "'up' is unreachable" in info.value.error.message
