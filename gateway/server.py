"""The HTTP server: uvicorn on httptools, with each request's head and body bounded, and each address's connections.

httptools buffers a header line until it ends and uvicorn keeps every header, so without limits one
unauthenticated connection could hold a header of any size, and a client that trickles bytes (or sends
nothing) could keep a connection forever. ``BoundedHttpTools`` adds, per connection:

* the head's size: counted as it arrives (431 once a head still arriving passes ``max_head_bytes``, so at most
  one read past the limit is ever buffered) and again, exactly, once it is complete (431 past the limit, even
  for a head that came in one read);
* the head's header count (431 past ``max_headers``) and time (``head_timeout`` from connecting, or from the
  head's first byte on a kept-alive connection: 408, or a plain close if nothing came);
* the body's time: ``body_timeout`` for the whole body once the head is in (408, then close);
* an answer given before the body was read (a 401 from the head, a 404, a 413) closes the connection
  (``connection: close``) instead of reading and discarding the rest of the body;
* at most ``max_connections_per_client`` connections open per client address: more are answered 503 and closed
  at once, outside uvicorn's ``limit_concurrency`` count, so one address cannot take every slot.

Idle keep-alive and the number of connections in all are uvicorn's own settings (``timeout_keep_alive``,
``limit_concurrency``).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import structlog
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr

log = structlog.get_logger()

_HEAD, _BODY = "head", "body"  # what the connection's deadline is for; None: none runs (the app has the request)


class BoundedHttpTools(HttpToolsProtocol):
    """``HttpToolsProtocol`` with limits on request heads, bodies and connections per address; ``bounded_protocol``
    sets them."""

    # The limits, set by ``bounded_protocol`` from ``[server]`` (their defaults live there alone).
    max_head_bytes: int
    max_headers: int
    head_timeout: float
    body_timeout: float
    max_connections_per_client: int
    # Connections open now per client address. Every connection of one server shares it (``bounded_protocol``
    # gives each server class its own); only the event loop's thread touches it.
    _open_per_client: ClassVar[dict[str, int]] = {}
    # When each refused address was last logged: once a minute at most, so an attack does not flood the log.
    _refusals_logged: ClassVar[dict[str, float]] = {}

    _address: str | None = None  # counted in _open_per_client while this connection is open
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = get_remote_addr(transport)
        address = peer[0] if peer else None  # a Unix socket has no address to count
        if address is not None:
            held = self._open_per_client.get(address, 0)
            if held >= self.max_connections_per_client:
                # Answered before it is read, and never added to uvicorn's connections: no slot is taken.
                self.transport = transport
                self._log_refusal(address, held)
                self._refuse(503, f"This address already has {held} connections open.")
                return
            self._open_per_client[address] = held + 1
            self._address = address
        super().connection_made(transport)
        self._app, self.app = self.app, self._close_unread
        self._head_bytes = 0  # read so far of a head still arriving: bounds memory
        self._head_size = 0  # the head as parsed: name, value and the separators of each line
        self._header_count = 0
        self._in_head = True
        self._refusal: tuple[int, str] | None = None
        # From the start: a connection that never sends a byte is held no longer than a slow head.
        self._phase: str | None = _HEAD
        self._deadline = self.loop.time() + self.head_timeout
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        # The websocket protocol takes the transport, so this one never sees it close: let go of it now.
        self._disarm()
        self._release()
        super().handle_websocket_upgrade()

    def _release(self) -> None:
        address, self._address = self._address, None
        if address is not None:
            left = self._open_per_client[address] - 1
            if left:
                self._open_per_client[address] = left
            else:
                del self._open_per_client[address]

    def _log_refusal(self, address: str, held: int) -> None:
        now = self.loop.time()
        logged = self._refusals_logged
        if address not in logged or now - logged[address] >= 60.0:
            if len(logged) > 10_000:  # many addresses: forget them rather than grow without end
                logged.clear()
            logged[address] = now
            log.warning("http.client_connection_limit", client=address, open=held)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # refused: what is still in flight is not parsed
            return
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
            self._in_head, self._head_bytes, self._head_size, self._header_count = True, 0, 0, 0
            self._start(_HEAD, self.head_timeout)

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_size += len(name) + len(value) + 4  # "name: value\r\n"
        if self._header_count > self.max_headers:
            self._refusal = (431, f"The request has more than {self.max_headers} headers.")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        # "METHOD url HTTP/1.1\r\n" and the blank line that ends the head. A head that came in one read was never
        # checked while it arrived, so this is the check that makes the limit exact.
        self._head_size += len(self.parser.get_method()) + 14
        if self._refusal is None and self._head_size > self.max_head_bytes:
            self._refusal = (431, f"The request head is larger than {self.max_head_bytes} bytes.")
        if self._refusal is None:
            super().on_headers_complete()
            self._start(_BODY, self.body_timeout)  # ended at once by on_message_complete if there is no body

    def on_body(self, body: bytes) -> None:
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusal is None:
            self._phase = None
            super().on_message_complete()

    async def _close_unread(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, answering with ``connection: close`` when it answers before the whole body has come.

        Otherwise uvicorn would read and discard the rest of the body to keep the connection: a client without a
        key could trickle a large body into a connection that already had its 401 and hold it as long as it liked.
        """
        cycle = self.cycle
        # Another request's cycle: a later head was parsed, so this request's body had all come.
        if cycle is None or cycle.scope is not scope or not cycle.more_body:
            await self._app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and cycle.more_body:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self._app(scope, receive, send_closing)

    # One timer per connection for whichever deadline runs (the head's, then the body's, then the next head's):
    # it checks the deadline when it fires and re-arms for the rest, so a request costs a clock read, not a timer
    # made and cancelled.
    def _start(self, phase: str, seconds: float) -> None:
        self._phase = phase
        self._deadline = self.loop.time() + seconds
        self._arm()

    def _arm(self) -> None:
        timer = self._timer
        if timer is not None and timer.when() <= self._deadline:
            return  # fires first and re-arms
        if timer is not None:
            timer.cancel()
        self._timer = self.loop.call_at(self._deadline, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._phase is None or self.transport.is_closing():
            return
        if self.loop.time() < self._deadline:  # a later deadline than the one this timer was set for
            self._timer = self.loop.call_at(self._deadline, self._timed_out)
        elif self._phase == _BODY and (self.pipeline or self.flow.read_paused):
            # The gateway is not reading (the body waits behind an earlier request, or for the app to take what
            # came): that time is not the client's, so it gets a fresh window.
            self._deadline = self.loop.time() + self.body_timeout
            self._timer = self.loop.call_at(self._deadline, self._timed_out)
        elif self._phase == _HEAD:
            log.info("http.head_timeout", client=self.client, received=self._head_bytes)
            if self._head_bytes:
                self._refuse(408, f"The request head did not arrive within {self.head_timeout:g} s.")
            else:
                self.transport.close()
        else:
            log.info("http.body_timeout", client=self.client, path=self.scope.get("path"))
            cycle = self.cycle
            # The app sees the client gone (its read ends) and whatever it sends from now on is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # its answer is under way: a 408 cannot follow it on this connection
                self.transport.close()
            else:
                self._refuse(408, f"The request body did not arrive within {self.body_timeout:g} s.")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        body = message.encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: text/plain; charset=utf-8\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def bounded_protocol(*, max_head_bytes: int, max_headers: int, head_timeout: float, body_timeout: float,
                     max_connections_per_client: int) -> type[BoundedHttpTools]:
    """A protocol class for ``uvicorn.run(http=...)`` with these limits (uvicorn makes one per connection)."""
    limits: dict[str, Any] = {"max_head_bytes": max_head_bytes, "max_headers": max_headers,
                              "head_timeout": head_timeout, "body_timeout": body_timeout,
                              "max_connections_per_client": max_connections_per_client,
                              "_open_per_client": {}, "_refusals_logged": {}}
    return type("BoundedHttpToolsWithLimits", (BoundedHttpTools,), limits)

