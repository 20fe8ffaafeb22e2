"""The embedded engine's prefix cache, on the tiny random Llama: what it saves, and that it changes no output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("local")

from gateway.backends.base import ChatRequest
from gateway.backends.local import LocalBackend
from gateway.prompting import encode_prompt
from tests.gateway.backends.conftest import local_backend

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one line. " * 6}
A, B = "a", "b"


def _backend(model_dir: Path, mb: int) -> LocalBackend:
    return local_backend(model_dir, prefix_cache_mb=mb)


@pytest.fixture
async def pair(tiny_model_dir: Path, lora_adapters: dict[str, Path]) -> AsyncIterator[tuple[LocalBackend, ...]]:
    cached, plain = _backend(tiny_model_dir, 64), _backend(tiny_model_dir, 0)
    for b in (cached, plain):
        await b.start()
        await b.load_adapter(A, str(lora_adapters["a"]))
        await b.load_adapter(B, str(lora_adapters["b"]))
    yield cached, plain
    for b in (cached, plain):
        await b.aclose()


def _req(messages: list[dict[str, Any]], adapter: str | None = None, **params: Any) -> ChatRequest:
    return ChatRequest(body={"messages": messages, "temperature": 0, "max_tokens": 6, **params}, model="tiny",
                       adapter=adapter)


def _episode(step: int, i: int = 0) -> list[dict[str, Any]]:
    """An agent's conversation at its ``step``: each step resends the last with a reply and a result appended."""
    messages = [SYSTEM, {"role": "user", "content": f"Task {i}: what is {i} plus {i}?"}]
    for k in range(step):
        messages += [{"role": "assistant", "content": f"Working on part {k}."},
                     {"role": "user", "content": f"Result {k}: {i + k}."}]
    return messages


async def _ids(backend: LocalBackend, request: ChatRequest) -> list[int]:
    return (await backend.chat(request)).extras.completion_token_ids[0]


async def test_greedy_output_is_the_same_with_and_without_the_cache(pair: tuple[LocalBackend, ...]) -> None:
    cached, plain = pair
    plan = [(_episode(step, i), adapter) for step in range(3) for i, adapter in enumerate([None, A, B, A])]
    for messages, adapter in plan:  # one at a time: every later step finds its earlier steps cached
        assert await _ids(cached, _req(messages, adapter)) == await _ids(plain, _req(messages, adapter))
    assert cached.prefix_stats.hits >= 8 and cached.prefix_stats.prefill_saved > 0
    # and in mixed batches: cache hits and misses, adapters and the base, prefilled together and joined
    mixed = [(_episode(3, i), adapter) for i, adapter in enumerate([None, A, B, A, None, B])]
    together = await asyncio.gather(*(_ids(cached, _req(m, a)) for m, a in mixed))
    assert together == [await _ids(plain, _req(m, a)) for m, a in mixed]


async def test_an_agents_next_step_prefills_only_what_is_new(pair: tuple[LocalBackend, ...],
                                                             smol_tokenizer: Any) -> None:
    cached, _ = pair
    stats = cached.prefix_stats
    await cached.chat(_req(_episode(0)))
    first = len(encode_prompt(smol_tokenizer, _episode(0)))
    assert (stats.prefill_computed, stats.prefill_saved, stats.hits) == (first, 0, 0)
    await cached.chat(_req(_episode(1)))
    second = len(encode_prompt(smol_tokenizer, _episode(1)))
    # All of step 1's prompt came from the cache (and the reply's tokens too, as far as they were rendered alike).
    assert stats.hits == 1 and stats.prefill_saved >= first
    assert stats.prefill_computed - first == second - stats.prefill_saved < second - first + 2


async def test_two_episodes_share_their_system_prompt(pair: tuple[LocalBackend, ...], smol_tokenizer: Any) -> None:
    cached, _ = pair
    await cached.chat(_req(_episode(0, 1)))
    shared = len(encode_prompt(smol_tokenizer, [SYSTEM]))
    before = cached.prefix_stats.prefill_saved
    await cached.chat(_req(_episode(0, 2)))
    assert cached.prefix_stats.hits == 1 and cached.prefix_stats.prefill_saved - before >= shared


async def test_an_adapters_entry_serves_that_adapter_alone(pair: tuple[LocalBackend, ...]) -> None:
    cached, _ = pair
    stats = cached.prefix_stats
    await cached.chat(_req(_episode(0), A))
    for adapter in (None, B):
        await cached.chat(_req(_episode(0), adapter))
    assert stats.hits == 0  # the same prompt, but under another adapter (or none) its keys and values differ
    await cached.chat(_req(_episode(0), A))
    assert stats.hits == 1
    await cached.unload_adapter(A)
    entries = stats.entries
    assert entries == 2  # A's went with it; the base's and B's remain


async def test_eviction_keeps_the_cache_within_its_budget(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir, 1)  # 1 MiB: a few prompts of the tiny model
    await backend.start()
    try:
        for i in range(40):
            await backend.chat(_req(_episode(6, i), max_tokens=1))
        stats = backend.prefix_stats
        assert stats.evictions > 0 and 0 < stats.bytes <= 2**20 and stats.entries >= 1
        await backend.chat(_req(_episode(7, 39)))  # the newest survived eviction
        assert stats.hits >= 1
    finally:
        await backend.aclose()
