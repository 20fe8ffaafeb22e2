"""The HTTP server: uvicorn on httptools, with the request head bounded in size, count and time.

httptools buffers a header line until it ends and uvicorn keeps every header, so without limits one
unauthenticated connection could hold a header of any size, and a client that trickles bytes (or sends
nothing) could keep a connection forever. ``BoundedHttpTools`` counts the bytes of each request head as
they arrive and refuses with 431 once they pass ``max_head_bytes`` (so at most one read past the limit is
ever buffered), refuses more than ``max_headers`` headers, and closes a connection whose head is not
complete ``head_timeout`` seconds after the connection opened or the head began. Idle keep-alive and the
number of connections are uvicorn's own settings (``timeout_keep_alive``, ``limit_concurrency``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = structlog.get_logger()


class BoundedHttpTools(HttpToolsProtocol):
    """``HttpToolsProtocol`` with limits on the request head; ``bounded_protocol`` sets them."""

    max_head_bytes = 65_536
    max_headers = 100
    head_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._header_count = 0
        self._in_head = True
        self._refusal: tuple[int, str] | None = None
        # From the start: a connection that never sends a byte is held no longer than a slow head. One timer
        # serves many requests: it checks the current head's deadline when it fires and re-arms for the rest,
        # so a request costs a clock read, not a timer made and cancelled.
        self._head_deadline = self.loop.time() + self.head_timeout
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_at(self._head_deadline, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        counted = self._in_head
        if counted:
            self._head_bytes += len(data)
        super().data_received(data)
        if not counted and self._in_head:  # the next request's head began in this chunk
            self._head_bytes += len(data)
        if self.transport.is_closing():
            return
        if self._refusal is None and self._in_head and self._head_bytes > self.max_head_bytes:
            self._refusal = (431, f"The request head is larger than {self.max_head_bytes} bytes.")
        if self._refusal is not None:
            self._refuse(*self._refusal)

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection: its head starts now
            self._in_head, self._head_bytes, self._header_count = True, 0, 0
            self._head_deadline = self.loop.time() + self.head_timeout
            if self._head_timer is None:
                self._head_timer = self.loop.call_at(self._head_deadline, self._head_timed_out)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            self._refusal = (431, f"The request has more than {self.max_headers} headers.")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._refusal is None:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusal is None:
            super().on_message_complete()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.loop.time() < self._head_deadline:  # a later head than the one this timer was set for
            self._head_timer = self.loop.call_at(self._head_deadline, self._head_timed_out)
        else:
            log.info("http.head_timeout", client=self.client, received=self._head_bytes)
            if self._head_bytes:
                self._refuse(408, f"The request head did not arrive within {self.head_timeout:g} s.")
            else:
                self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._stop_head_timer()
        body = message.encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: text/plain; charset=utf-8\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def bounded_protocol(*, max_head_bytes: int, max_headers: int, head_timeout: float) -> type[BoundedHttpTools]:
    """A protocol class for ``uvicorn.run(http=...)`` with these limits (uvicorn makes one per connection)."""
    limits: dict[str, Any] = {"max_head_bytes": max_head_bytes, "max_headers": max_headers,
                              "head_timeout": head_timeout}
    return type("BoundedHttpToolsWithLimits", (BoundedHttpTools,), limits)
