"""The request head is bounded in size, header count and time, on a real gateway process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import GatewayProcess, upstream_config

pytestmark = pytest.mark.integration

HEAD_TIMEOUT = 1.0


@pytest.fixture
def gateway(standin, tmp_path: Path) -> Iterator[GatewayProcess]:
    config = upstream_config(standin[1], extra=f"[server]\nhead_timeout = {HEAD_TIMEOUT}\n")
    proc = GatewayProcess(config, tmp_path).start()
    yield proc
    proc.stop()


def _memory_mb(gw: GatewayProcess) -> dict[str, float]:
    """The gateway process's resident memory now (VmRSS) and at its peak so far (VmHWM), in MB."""
    assert gw.proc is not None
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{gw.proc.pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def _connect(gw: GatewayProcess, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def _reply(sock: socket.socket) -> bytes:
    try:
        return sock.recv(200)
    except (ConnectionResetError, TimeoutError):
        return b""


def test_huge_headers_are_refused_before_they_are_read(gateway: GatewayProcess) -> None:
    httpx.get(gateway.url + "/healthz")
    assert gateway.proc is not None
    # Start the peak afresh (5 resets VmHWM to the current RSS), so only what the attack adds counts.
    Path(f"/proc/{gateway.proc.pid}/clear_refs").write_text("5")
    before = _memory_mb(gateway)
    size = 20 * 1024 * 1024
    outcomes: list[tuple[int, bytes]] = []

    def send_one() -> None:
        sock = _connect(gateway)
        sent = 0
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
            chunk = b"a" * 65536
            while sent < size:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the gateway closed the connection: what is wanted
        outcomes.append((sent, _reply(sock)))
        sock.close()

    threads = [threading.Thread(target=send_one) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = _memory_mb(gateway)
    assert len(outcomes) == 10
    for sent, reply in outcomes:
        assert sent < size, "a 20 MB header was read to its end"
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431"), reply
    assert any(reply.startswith(b"HTTP/1.1 431") for _, reply in outcomes)
    assert after["VmHWM"] - before["VmRSS"] <= 20, (before, after)
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_too_many_headers_and_a_large_but_allowed_head(gateway: GatewayProcess) -> None:
    many = b"".join(b"X-H%d: 1\r\n" % i for i in range(150))
    sock = _connect(gateway)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert _reply(sock).startswith(b"HTTP/1.1 431")
    # 60 kB of headers is within the default 64 KiB: answered as usual.
    allowed = httpx.get(gateway.url + "/healthz", headers={"X-Filler": "f" * 60_000})
    assert allowed.status_code == 200


def test_slow_and_silent_connections_are_closed_while_healthz_answers(gateway: GatewayProcess) -> None:
    silent = [_connect(gateway) for _ in range(150)]
    slow = [_connect(gateway) for _ in range(150)]
    for sock in slow:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
    started = time.monotonic()
    stop = threading.Event()

    def drip() -> None:  # a byte at a time, which restarts no timer
        while not stop.is_set():
            for sock in slow:
                try:
                    sock.send(b"s")
                except OSError:
                    pass
            time.sleep(0.2)

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        while time.monotonic() - started < HEAD_TIMEOUT * 0.8:
            tick = time.monotonic()
            assert httpx.get(gateway.url + "/healthz", timeout=5).status_code == 200
            assert time.monotonic() - tick < 1.0
            time.sleep(0.1)
        replies = [_reply(sock) for sock in silent + slow]
        waited = time.monotonic() - started
    finally:
        stop.set()
        dripper.join(5)
    assert all(reply == b"" for reply in replies[:150]), "a silent connection got an answer"
    assert all(reply.startswith(b"HTTP/1.1 408") or reply == b"" for reply in replies[150:])
    assert sum(reply.startswith(b"HTTP/1.1 408") for reply in replies[150:]) > 100
    assert waited < HEAD_TIMEOUT + 5, f"connections were held {waited:.1f} s"
    for sock in silent + slow:
        sock.close()
    assert httpx.get(gateway.url + "/healthz").status_code == 200
