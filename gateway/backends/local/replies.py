"""The engine's tokens as OpenAI replies: a whole completion's choices, and the ``chat.completion.chunk`` stream."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from llguidance import LLTokenizer

from gateway.agent.parsing import ToolCallStreamFilter, parse_tool_calls
from gateway.backends.base import CallExtras
from gateway.backends.local.jobs import Failure, Finish, Job, JobEvent, Token
from gateway.backends.local.sampling import SamplingParams
from gateway.protocol.completions import text_completion_chunk


@dataclass(frozen=True)
class Cancelled:
    """Posted by the request itself so a consumer blocked on the queue wakes up and ends."""


Events = asyncio.Queue[list[JobEvent | Cancelled]]  # one request's events, in the engine's lists per step


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    tools_enabled: bool
    adapter: str | None = None  # the name the request gave
    token_bytes: LLTokenizer | None = None  # set when the request asked for logprobs


async def events(job: Job, queue: Events) -> AsyncIterator[Token | Finish]:
    """The job's tokens and finishes until every sequence has finished; failures are raised."""
    unfinished = job.params.n
    while unfinished:
        for event in await queue.get():
            if isinstance(event, Failure):
                raise event.error
            if isinstance(event, Cancelled):
                return
            if isinstance(event, Finish):
                unfinished -= 1
            yield event


def logprobs_of(token_bytes: LLTokenizer | None, tokens: list[Token]) -> dict[str, Any] | None:
    """A choice's (or a chunk's) ``logprobs`` in OpenAI's shape; None when they were not asked for."""
    if token_bytes is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes.decode_bytes([token_id])
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens], "refusal": None}


def final_message(text: str, reason: str, tools_enabled: bool) -> tuple[dict[str, Any], str]:
    """The choice's message and finish reason. A generation cut off by the length limit (or by a grammar that
    failed: ``error``) keeps its reason even when it holds calls, so a client never executes a call that was
    truncated."""
    if not tools_enabled:
        return {"role": "assistant", "content": text}, reason
    parsed = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if not parsed.calls:
        return message, reason
    message["tool_calls"] = parsed.tool_calls
    return message, "tool_calls" if reason == "stop" else reason


def completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def usage(prompt_ids: list[int], completions: list[list[int]]) -> dict[str, int]:
    completion = sum(len(ids) for ids in completions)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


class LocalChunkStream:
    """OpenAI ``chat.completion.chunk`` dicts for one streamed request (see ``ChunkStream``)."""

    def __init__(self, job: Job, queue: Events, prepared: Prepared, model: str) -> None:
        n = prepared.params.n
        self.extras = CallExtras(prepared.prompt_ids, [[] for _ in range(n)], [[] for _ in range(n)],
                                 [[] for _ in range(n)])
        self._job = job
        self._queue = queue
        self._prepared = prepared
        self._header = {"id": completion_id(), "object": "chat.completion.chunk",
                        "created": int(time.time()), "model": model}
        self._chunks = self._generate()

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks

    async def aclose(self) -> None:
        self._job.cancelled = True
        self._queue.put_nowait([Cancelled()])
        # Fails only while another task is inside the generator; the sentinel above ends that one.
        with suppress(RuntimeError):
            await self._chunks.aclose()

    def _chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               tokens: list[Token] | None = None) -> dict[str, Any]:
        """One choice's chunk; ``tokens`` (emptied here) are those whose log-probabilities go out with it."""
        logprobs = logprobs_of(self._prepared.token_bytes, tokens) if tokens else None
        if tokens:
            tokens.clear()
        return {**self._header, "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        n = self._prepared.params.n
        filters = [ToolCallStreamFilter() if self._prepared.tools_enabled else None for _ in range(n)]
        extras = self.extras
        ids, logprobs = extras.completion_token_ids, extras.completion_logprobs
        sampled = extras.completion_sampled_logprobs
        assert ids is not None and logprobs is not None and sampled is not None
        # Tokens whose text has not gone out yet (held while a call or a stop string may be starting).
        unsent: list[list[Token]] = [[] for _ in range(n)]
        try:
            for i in range(n):
                yield self._chunk(i, {"role": "assistant", "content": ""})
            async for event in events(self._job, self._queue):
                i = event.index
                if isinstance(event, Token):
                    ids[i].append(event.token_id)
                    logprobs[i].append(event.logprob)
                    sampled[i].append(event.sampled_logprob)
                    unsent[i].append(event)
                    text = filters[i].feed(event.text) if filters[i] else event.text
                    if text:
                        yield self._chunk(i, {"content": text}, tokens=unsent[i])
                    continue
                reason = event.reason
                if filters[i] is not None:
                    tail, parsed = filters[i].finish()
                    if tail:
                        yield self._chunk(i, {"content": tail}, tokens=unsent[i])
                    for k, call in enumerate(parsed.calls):
                        yield self._chunk(i, {"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                                              "function": {"name": call.name, "arguments": ""}}]})
                        yield self._chunk(i, {"tool_calls": [{"index": k,
                                                              "function": {"arguments": call.arguments}}]})
                    if parsed.calls and reason == "stop":
                        reason = "tool_calls"
                yield self._chunk(i, {}, reason, tokens=unsent[i])
            if self._job.cancelled:
                return
            yield {**self._header, "choices": [], "usage": usage(self._prepared.prompt_ids, ids)}
        finally:
            self._job.cancelled = True


class TextCompletionStream:
    """A raw prompt's chunk stream as ``text_completion`` chunks (see ``CompletionsHost``)."""

    def __init__(self, chunks: LocalChunkStream) -> None:
        self._chunks = chunks
        self.extras = chunks.extras

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._translated()

    async def _translated(self) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self._chunks:
            out = text_completion_chunk(chunk)
            if out is not None:
                yield out

    async def aclose(self) -> None:
        await self._chunks.aclose()
