"""PostgreSQL goes away under a running gateway (a restart, a failover, an outage): no request gets a 500. While
the server is down each gets 503 ``store_unavailable`` (nothing is answered that is not recorded); once it is back,
the very first request is answered again, on a new connection."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from tests.postgres import PostgresServer, require_postgres
from tests.processes import GatewayProcess, upstream_config
from tests.standin import StandIn

pytestmark = pytest.mark.integration


def _ask(gateway: GatewayProcess, text: str, *, stream: bool = False) -> tuple[int, dict]:
    body = {"model": "stand-in-model", "messages": [{"role": "user", "content": text}], "stream": stream}
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    if response.status_code == 200 and stream:
        events = [orjson.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return (200 if "data: [DONE]" in response.text else 599), events[-1] if events else {}
    return response.status_code, {**response.json(), "retry-after": response.headers.get("retry-after")}


def test_the_gateway_rides_out_a_postgresql_restart_and_an_outage(standin: tuple[StandIn, str],
                                                                   tmp_path: Path) -> None:
    server = PostgresServer(require_postgres()).start()  # its own: this test stops it
    gateway = GatewayProcess(upstream_config(standin[1], store=f'url = "{server.database()}"'), tmp_path)
    try:
        gateway.start()
        assert [_ask(gateway, f"before {i}")[0] for i in range(4)] == [200] * 4

        server.pause()
        server.resume()  # every pooled connection, and the writer's, is now dead
        assert [_ask(gateway, f"after restart {i}", stream=i % 2 == 1)[0] for i in range(8)] == [200] * 8

        server.pause()
        down = [_ask(gateway, f"while down {i}", stream=i % 2 == 1) for i in range(2)]
        for status, body in down:
            assert status == 503, body
            assert body["error"]["code"] == "store_unavailable" and body["retry-after"] == "1"
        assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200

        server.resume()
        assert [_ask(gateway, f"back {i}", stream=i % 2 == 1)[0] for i in range(6)] == [200] * 6
        assert "unhandled" not in gateway.log.read_text()
    finally:
        gateway.stop()
        server.stop()
