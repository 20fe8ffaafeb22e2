"""Throughput of the local backend on the real embedded model: one request alone vs. N at once.

    python bench/local_backend.py [--max-tokens 64] [--concurrency 8] [--cache-dir DIR] [--threads T]

Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``), so the two figures compare
equal work. Not a test: it takes a minute of CPU and prints numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from gateway.backends.base import ChatRequest
from gateway.backends.local import LocalBackend
from gateway.config import BackendSettings

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some uses of baking soda around the house.",
    "Describe the water cycle to a ten-year-old.",
    "What should I pack for a weekend hike?",
    "Summarise the plot of a heist movie you invent.",
    "Give tips for learning a new language.",
    "Why is the sky blue? Answer in detail.",
]


def _request(prompt: str, max_tokens: int) -> ChatRequest:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True}
    return ChatRequest(body=body, model="bench")


async def _timed(backend: LocalBackend, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(backend.chat(_request(p, max_tokens)) for p in prompts))
    elapsed = time.perf_counter() - started
    return sum(r.response["usage"]["completion_tokens"] for r in results), elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()

    settings = BackendSettings(name="local", kind="local", cache_dir=args.cache_dir, threads=args.threads,
                               max_batch_size=max(args.concurrency, 1))
    backend = LocalBackend(settings)
    started = time.perf_counter()
    await backend.start()
    print(f"model loaded in {time.perf_counter() - started:.1f} s (source: {backend.loaded.source})")
    try:
        await _timed(backend, PROMPTS[:1], 4)  # warm-up: first-call allocations and kernel selection
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]

        passes = backend.forward_passes
        tokens, elapsed = await _timed(backend, prompts[:1], args.max_tokens)
        single = tokens / elapsed
        print(f"1 request:   {tokens:4d} tokens in {elapsed:6.2f} s = {single:7.1f} tokens/s "
              f"({backend.forward_passes - passes} forward passes)")

        passes = backend.forward_passes
        tokens, elapsed = await _timed(backend, prompts, args.max_tokens)
        batched = tokens / elapsed
        print(f"{args.concurrency} requests:  {tokens:4d} tokens in {elapsed:6.2f} s = {batched:7.1f} tokens/s "
              f"({backend.forward_passes - passes} forward passes)")
        print(f"ratio: {batched / single:.2f}x")
    finally:
        await backend.aclose()


if __name__ == "__main__":
    asyncio.run(main())
