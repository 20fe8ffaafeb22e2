"""What the SGLang and vLLM stand-ins share: call recording, per-adapter in-flight counts, the chat answer
(plain or streamed) and the command line.

The answer names what served it (``served by sql@3``, ``served by base``), so a test sees the routing. A last user
message ``slow:SECONDS`` holds the answer that long (a stream sends its first chunk, then waits), which keeps a
request in flight for drain tests.

A plain answer asked for its tokens (``token_fields``) carries them in the server's own form (``add_tokens``): one
token a word, with ids unique across every stand-in of the process and random log-probabilities, each kept in
``sampled`` so a test can tell which server sampled what.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

BASE = "base"
_TOKEN_IDS = itertools.count(1000)  # shared by every stand-in: an id names the server that sampled it
"""The ``in_flight`` key, and the name in ``served by ...``, of a request that uses no adapter."""


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content or ""
    return ""


class _TrackedStream(StreamingResponse):
    """A stream that calls ``on_close`` once the response is over, however it ended (even if never started)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class LoRAServerStandIn:
    """The shared part. Subclasses give ``routes()``, and resolve a chat request's adapter before ``answer``."""

    def __init__(self, model_path: str, served_model_name: str | None, context_length: int) -> None:
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.context_length = context_length
        self.healthy = True
        self.calls: list[tuple[str, Any]] = []
        self.loaded: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}
        self.unload_in_flight: list[tuple[str, int]] = []
        self.sampled: list[dict[str, Any]] = []
        self.app = Starlette(routes=[*self.routes(),
                                     Route("/_standin/restart", self._restart_route, methods=["POST"]),
                                     Route("/_standin/state", self._state_route, methods=["GET"])])

    def routes(self) -> list[Route]:
        raise NotImplementedError

    def add_tokens(self, body: dict[str, Any], answer: dict[str, Any], ids: list[int], logprobs: list[float]) -> None:
        """Put the sampled tokens into ``answer`` as the real server does, where ``body`` asked for them."""

    def weights_of(self, served: str) -> str | None:
        """The adapter folder an answer of ``served`` was computed with (None: the base)."""
        return self.loaded.get(served)

    def restart(self) -> None:
        """What a restart of the server does to its adapters: the ones loaded at runtime are gone."""
        self.loaded.clear()

    async def read(self, request: Request) -> Any:
        """Record the call and return its body: parsed JSON, the raw text when it is not JSON, None when empty."""
        raw = await request.body()
        body: Any = None
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = raw.decode(errors="replace")
        self.calls.append((request.url.path, body))
        return body

    def note_unload(self, name: str) -> None:
        """Keep how many requests were using ``name`` when its unload arrived (0 after a proper drain)."""
        self.unload_in_flight.append((name, self.in_flight.get(name, 0)))

    async def wait_idle(self, name: str) -> None:
        while self.in_flight.get(name, 0):
            await asyncio.sleep(0.01)

    def _enter(self, served: str) -> None:
        self.in_flight[served] = self.in_flight.get(served, 0) + 1

    def _leave(self, served: str) -> None:
        self.in_flight[served] -= 1

    async def answer(self, body: dict[str, Any], served: str, response_model: str) -> Response:
        """The completion of a request resolved to ``served`` (an adapter name or ``BASE``).

        It counts as in flight from this call (made with no await after the resolution, as the real servers
        acquire the adapter) until the last byte is sent."""
        self._enter(served)
        command, _, arg = last_user_text(body).partition(":")
        try:
            delay = float(arg) if command == "slow" else 0.0
        except ValueError:
            delay = 0.0
        content = f"served by {served}"
        usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": response_model}
        if not body.get("stream"):
            try:
                if delay:
                    await asyncio.sleep(delay)
            finally:
                self._leave(served)
            message = {"role": "assistant", "content": content}
            answer = {**head, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]}
            words = content.split(" ")
            ids = [next(_TOKEN_IDS) for _ in words]
            logprobs = [round(random.uniform(-3.0, -0.01), 6) for _ in words]
            if body.get("logprobs"):
                answer["choices"][0]["logprobs"] = {"content": [
                    {"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}
                    for w, lp in zip(words, logprobs, strict=True)]}
            self.add_tokens(body, answer, ids, logprobs)
            self.sampled.append({"served": served, "weights": self.weights_of(served), "token_ids": ids,
                                 "logprobs": logprobs})
            return json_response(answer)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return _TrackedStream(self._chunks(head, content, usage if include_usage else None, delay),
                              on_close=lambda: self._leave(served))

    async def _chunks(self, head: dict[str, Any], content: str, usage: dict[str, int] | None,
                      delay: float) -> AsyncIterator[bytes]:
        def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": choices,
                                             **extra}) + b"\n\n"

        yield frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if delay:
            await asyncio.sleep(delay)
        words = content.split(" ")
        for i, word in enumerate(words):
            piece = word if i == len(words) - 1 else word + " "
            yield frame([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
        yield frame([{"index": 0, "delta": {}, "finish_reason": "stop"}])
        if usage is not None:
            yield frame([], usage=usage)
        yield b"data: [DONE]\n\n"

    async def _restart_route(self, request: Request) -> Response:
        self.restart()
        return json_response({"restarted": True})

    async def _state_route(self, request: Request) -> Response:
        return json_response({"loaded": self.loaded, "in_flight": self.in_flight,
                              "unload_in_flight": self.unload_in_flight})


def base_parser(prog: str) -> argparse.ArgumentParser:
    """The flags every stand-in reads; any other flag of the real server is accepted and ignored."""
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    return parser


def run(app: Starlette, host: str, port: int, ignored: Sequence[str]) -> None:
    import uvicorn

    if ignored:
        print(f"stand-in: ignoring {' '.join(ignored)}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="off")
