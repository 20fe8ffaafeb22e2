"""Finding: a slow request body held a connection slot without any key.

2,100 connections each sent ``POST /v1/chat/completions`` with ``Content-Length: 1000000``, no key, and then a
byte every 6 s. Each got its 401, but the gateway went on reading (and discarding) the body to keep the
connection, so every slot stayed taken and ``/healthz`` and authenticated requests got 503 for the whole run.

Now (``gateway/server.py``) an answer given before the body has come closes the connection, a body has
``body_timeout`` seconds in all (408, then close), and one client address holds at most
``max_connections_per_client`` connections (more are answered 503 at once, outside the global count). The
limits are small here so that the attack is too: 200 connections in all, 100 per address. The attackers connect
from other loopback addresses (127.0.0.2 and up) so that the probes from 127.0.0.1 stand for other clients.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.processes import GatewayProcess, create_key, upstream_config

pytestmark = pytest.mark.integration

MAX_CONNECTIONS = 200
PER_CLIENT = 100
BODY_TIMEOUT = 2.0
HEAD_TIMEOUT = 5.0
CHAT = {"model": "stand-in-model", "messages": [{"role": "user", "content": "plain"}]}


@pytest.fixture(scope="module")
def gateway_and_key(standin, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, str]]:
    extra = (f"[server]\nmax_connections = {MAX_CONNECTIONS}\nmax_connections_per_client = {PER_CLIENT}\n"
             f"body_timeout = {BODY_TIMEOUT}\nhead_timeout = {HEAD_TIMEOUT}\n")
    gw = GatewayProcess(upstream_config(standin[1], extra=extra), tmp_path_factory.mktemp("slow-body"))
    key = create_key(gw.config, "acme")[1]  # a key exists, so a request without one is refused
    gw.start()
    yield gw, key
    gw.stop()


def _connect(gw: GatewayProcess, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=5, source_address=(source, 0))


def _slow_post(key: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            "Content-Length: 1000000\r\n\r\n{").encode()


@dataclass
class Probes:
    """/healthz and an authenticated chat request from 127.0.0.1, over and over, with their latencies."""

    gw: GatewayProcess
    key: str
    health: list[tuple[int, float]] = field(default_factory=list)
    chat: list[tuple[int, float]] = field(default_factory=list)

    def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        with httpx.Client(base_url=self.gw.url, timeout=5) as client:
            while time.monotonic() < until:
                self.health.append(self._timed(lambda: client.get("/healthz")))
                self.chat.append(self._timed(lambda: client.post(
                    "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {self.key}"})))
                time.sleep(0.1)

    @staticmethod
    def _timed(call: Callable[[], httpx.Response]) -> tuple[int, float]:
        started = time.monotonic()
        try:
            status = call().status_code
        except httpx.HTTPError:
            status = 0
        return status, time.monotonic() - started

    def assert_answered(self, within: float) -> None:
        for name, results in (("/healthz", self.health), ("chat", self.chat)):
            assert results and all(status == 200 for status, _ in results), (name, results)
            assert max(latency for _, latency in results) < within, (name, results)


class SlowBodies:
    """Keeps ``per_source`` connections open from each source address, each sending a head without a key and
    then trickling its body; a connection the gateway closes is replaced at once, as a determined attacker would.
    Records, per connection, its status line and the seconds from its head to the gateway's close."""

    def __init__(self, gw: GatewayProcess, sources: list[str], per_source: int) -> None:
        self.gw, self.sources, self.per_source = gw, sources, per_source
        self.closed: list[tuple[bytes, float]] = []

    def run(self, seconds: float) -> None:
        selector = selectors.DefaultSelector()
        state: dict[socket.socket, list] = {}

        def open_one(source: str) -> None:
            sock = _connect(self.gw, source)
            sock.sendall(_slow_post())
            sock.setblocking(False)
            state[sock] = [source, time.monotonic(), b""]
            selector.register(sock, selectors.EVENT_READ)

        for source in self.sources:
            for _ in range(self.per_source):
                open_one(source)
        until = time.monotonic() + seconds
        next_drip = time.monotonic() + 0.5
        try:
            while time.monotonic() < until:
                for key, _ in selector.select(timeout=0.05):
                    sock = key.fileobj
                    source, started, got = state[sock]
                    try:
                        chunk = sock.recv(4096)
                    except (ConnectionResetError, BlockingIOError):
                        chunk = b""
                    if chunk:
                        state[sock][2] = got + chunk
                        continue
                    self.closed.append((got.split(b"\r\n", 1)[0], time.monotonic() - started))
                    selector.unregister(sock)
                    del state[sock]
                    sock.close()
                    open_one(source)
                if time.monotonic() >= next_drip:  # a byte of body now and then: never idle, never done
                    next_drip = time.monotonic() + 0.5
                    for sock in state:
                        try:
                            sock.send(b" ")
                        except OSError:
                            pass
        finally:
            for sock in state:
                sock.close()
            selector.close()


def test_slow_bodies_without_a_key_are_refused_and_closed_while_others_are_served(gateway_and_key) -> None:
    gw, key = gateway_and_key
    # 240 connections from three addresses: more than the 200 slots, each address within its own 100.
    attack = SlowBodies(gw, ["127.0.0.2", "127.0.0.3", "127.0.0.4"], per_source=80)
    attacker = threading.Thread(target=attack.run, args=(4.0,))
    attacker.start()
    time.sleep(0.5)  # the attack is under way
    probes = Probes(gw, key)
    try:
        probes.run(3.0)
    finally:
        attacker.join(30)
    probes.assert_answered(within=1.0)
    assert len(attack.closed) > 240, "the gateway did not close the refused connections"
    statuses = {status for status, _ in attack.closed}
    assert statuses == {b"HTTP/1.1 401 Unauthorized"}, statuses
    slowest = max(seconds for _, seconds in attack.closed)
    assert slowest < 1.0, f"a refused connection was held {slowest:.2f} s"


def test_one_address_cannot_take_every_slot(gateway_and_key) -> None:
    gw, key = gateway_and_key
    silent = [_connect(gw, "127.0.0.5") for _ in range(MAX_CONNECTIONS + 50)]  # more than all the slots
    try:
        started = time.monotonic()
        time.sleep(0.5)  # the refusals are sent at once; the held ones wait for a head
        replies = []
        for sock in silent:
            sock.setblocking(False)
            try:
                replies.append(sock.recv(200))
            except BlockingIOError:
                replies.append(None)  # held open, waiting for a head
            except ConnectionResetError:
                replies.append(b"")
        held = sum(reply is None for reply in replies)
        refused = [reply for reply in replies if reply is not None]
        assert held == PER_CLIENT, held
        assert all(reply.startswith(b"HTTP/1.1 503") for reply in refused), refused[:3]
        probes = Probes(gw, key)
        probes.run(1.0)
        probes.assert_answered(within=1.0)
        assert time.monotonic() - started < HEAD_TIMEOUT  # all while the held ones were still held
    finally:
        for sock in silent:
            sock.close()


def test_a_slow_body_with_a_key_gets_408_after_body_timeout(gateway_and_key) -> None:
    gw, key = gateway_and_key
    sock = _connect(gw, "127.0.0.6")
    try:
        sock.sendall(_slow_post(key))
        started = time.monotonic()
        sock.settimeout(0.3)
        reply = b""
        while time.monotonic() - started < BODY_TIMEOUT + 3:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                sock.send(b" ")  # still trickling
                continue
            if not chunk:
                break
            reply += chunk
        waited = time.monotonic() - started
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in reply.lower()
    assert BODY_TIMEOUT - 0.1 < waited < BODY_TIMEOUT + 1.0, f"answered and closed after {waited:.2f} s"
    assert httpx.get(gw.url + "/healthz").status_code == 200
