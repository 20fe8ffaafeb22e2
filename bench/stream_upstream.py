#!/usr/bin/env python3
"""A fixed streaming chat-completions upstream for bench/gateway_overhead.py: every POST is answered with 50 chunks
(``chat.completion.chunk`` server-sent events), each after a small gap, then a usage chunk and ``[DONE]``.

Plain asyncio on uvloop with a hand-written HTTP/1.1 loop (keep-alive, chunked transfer encoding) so that it costs
little CPU beside what it measures: the same for every target. A body without ``"stream": true`` gets the whole
completion as one JSON answer.

    python bench/stream_upstream.py --port 18100 [--chunks 50] [--gap-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import uvloop

_LENGTH = re.compile(rb"(?im)^content-length:\s*(\d+)\s*$")
_STREAM = re.compile(rb'"stream"\s*:\s*true')


def _frames(chunks: int) -> list[bytes]:
    base = {"id": "chatcmpl-stream", "object": "chat.completion.chunk", "created": 1700000000, "model": "bench-model"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{**base, "choices": [{"index": 0, "delta": {"content": f"word{i} "}, "finish_reason": None}]}
               for i in range(chunks - 2)]
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**base, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": chunks - 2,
                                                     "total_tokens": chunks + 7}})
    out = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    out.append(b"data: [DONE]\n\n")
    return [b"%x\r\n%s\r\n" % (len(frame), frame) for frame in out]


def _whole(chunks: int) -> bytes:
    body = json.dumps({"id": "chatcmpl-stream", "object": "chat.completion", "created": 1700000000,
                       "model": "bench-model", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                           "role": "assistant", "content": " ".join(f"word{i}" for i in range(chunks - 2))}}],
                       "usage": {"prompt_tokens": 9, "completion_tokens": chunks - 2,
                                 "total_tokens": chunks + 7}}).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def serve(port: int, chunks: int, gap: float) -> None:
    frames = _frames(chunks)
    whole = _whole(chunks)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                length = _LENGTH.search(request)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if not _STREAM.search(body):
                    writer.write(whole)
                    await writer.drain()
                    continue
                writer.write(head + frames[0])
                await writer.drain()
                for frame in frames[1:-3]:
                    await asyncio.sleep(gap)
                    writer.write(frame)
                    await writer.drain()
                writer.write(b"".join(frames[-3:]) + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=50)
    p.add_argument("--gap-ms", type=float, default=1.0)
    args = p.parse_args()
    uvloop.run(serve(args.port, args.chunks, args.gap_ms / 1000))


if __name__ == "__main__":
    main()
