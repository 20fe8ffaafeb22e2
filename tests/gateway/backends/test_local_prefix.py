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


async def test_entries_hold_a_shared_prefix_once(pair: tuple[LocalBackend, ...], smol_tokenizer: Any) -> None:
    cached, _ = pair
    stats = cached.prefix_stats
    first, second = (encode_prompt(smol_tokenizer, _episode(0, i)) for i in (1, 2))
    await cached.chat(_req(_episode(0, 1), max_tokens=1))  # one entry: the prompt (the reply adds no position)
    per_token = stats.bytes / len(first)
    await cached.chat(_req(_episode(0, 2), max_tokens=1))
    shared = len(encode_prompt(smol_tokenizer, [SYSTEM]))
    # the second entry holds only what follows the system prompt; the first's positions serve it the rest
    assert stats.entries == 2 and stats.bytes - len(first) * per_token <= (len(second) - shared) * per_token
    again = await _ids(cached, _req(_episode(0, 2)))
    assert stats.hits == 2 and again == await _ids(pair[1], _req(_episode(0, 2)))


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


def test_a_hidden_entry_lives_as_long_as_an_entry_points_at_it() -> None:
    import torch

    from gateway.backends.local.prefix_cache import PrefixCache

    def positions(n: int) -> Any:
        return lambda start: [(torch.ones(1, 2, n - start, 4), torch.ones(1, 2, n - start, 4))]

    base = (None, None)  # no tenant, no adapter
    per_token = 2 * 2 * 4 * 4  # keys and values, 2 heads x 4 dims of float32
    cache = PrefixCache(budget_bytes=100 * per_token)
    system = list(range(100, 140))
    first, second = system + [1] * 10, system + [2] * 10
    cache.add(base, first, positions(len(first)))
    cache.add(base, first + [3] * 10, positions(len(first) + 10))  # extends the first: it is hidden, not freed
    cache.add(base, second, positions(len(second)))  # shares the system prompt with them
    assert cache.stats.entries == 2 and cache.stats.bytes == (50 + 10 + 10) * per_token
    hit = cache.longest(base, second + [9])
    assert hit is not None and hit.length == 50
    [(keys, _)] = cache.gather([hit], 52, capacity=60)  # right-aligned in 52 positions, with room for 8 more
    assert keys.shape == (1, 2, 60, 4) and keys[0, :, :2].abs().sum() == 0 and keys[0, :, 2:52].min() == 1
    assert keys[0, :, 52:].abs().sum() == 0
    cache.add(base, list(range(500, 580)), positions(80))  # over budget: the oldest go, and what they held
    assert cache.stats.evictions == 2 and cache.stats.entries == 1 and cache.stats.bytes == 80 * per_token
    cache.forget("nobody")
    assert cache.stats.bytes == 80 * per_token


async def test_a_prompt_prefilled_in_chunks_gives_the_same_output(pair: tuple[LocalBackend, ...],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.backends.local import engine

    cached, plain = pair
    prompts = [(_episode(4, i), adapter) for i, adapter in enumerate([None, A, B])]
    start = plain._engine.forward_passes
    whole = await asyncio.gather(*(_ids(plain, _req(m, a)) for m, a in prompts))
    unchunked = plain._engine.forward_passes - start
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 16)  # every prompt here takes several passes
    assert await asyncio.gather(*(_ids(plain, _req(m, a)) for m, a in prompts)) == whole
    assert plain._engine.forward_passes - start - unchunked >= unchunked + 3
    # and a cache hit's new tokens too, chunked after the cached part
    await cached.chat(_req(_episode(3, 0)))
    assert await _ids(cached, _req(_episode(4, 0))) == whole[0] and cached.prefix_stats.hits == 1


async def test_hits_admitted_together_with_more_new_tokens_than_a_short_prompt_holds(
        pair: tuple[LocalBackend, ...]) -> None:
    """A short prompt with a long cached part, admitted with a prompt that is mostly new: the short one cannot
    recompute as many tokens as the long one brings, so it is prefilled from the start; both answer as without
    the cache (this once failed the batch, and left the jobs being admitted waiting for ever)."""
    cached, plain = pair
    await cached.chat(_req(_episode(2, 0)))  # caches the system prompt and the first steps
    long_new = [SYSTEM, {"role": "user", "content": "Go on counting: " + " ".join(str(k) for k in range(60))}]
    short = _episode(3, 0)
    prompts = [_req(long_new), _req(short)]
    expected = [await _ids(plain, r) for r in prompts]
    together = asyncio.gather(*(_ids(cached, r) for r in prompts))
    assert await asyncio.wait_for(together, 60) == expected  # a lost job would wait for ever
