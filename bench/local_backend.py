"""Throughput of the local backend on the real embedded model: one request alone vs. N at once, each free and
held to a JSON Schema (constrained decoding).

    python -m bench.local_backend [--max-tokens 64] [--concurrency 8] [--rounds 3] [--cache-dir DIR] [--threads T]

Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``; the schema's text is longer than that can
hold), so tokens/s compares equal work. The four measurements are interleaved for ``--rounds`` rounds and the
medians reported, with the constraint's cost as a ratio, and the grammar mask's own time per decoding step.
Not a test: it takes a few minutes of CPU and prints numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import torch

from gateway.backends.base import ChatRequest
from gateway.backends.local import LocalBackend
from gateway.backends.local.grammar import Masks, answer_schema, matcher, output_grammar
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


# A string longer than any --max-tokens here can write, so a constrained request generates as many tokens as a free
# one: the ratio compares equal work (a schema the model could finish early would end rows early and shrink the batch).
SCHEMA = {"type": "json_schema", "json_schema": {"name": "notes", "schema": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                     "text": {"type": "string", "minLength": 2000}},
    "required": ["title", "text"], "additionalProperties": False}}}


def _request(prompt: str, max_tokens: int, constrained: bool) -> ChatRequest:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                            "max_tokens": max_tokens, "ignore_eos": True}
    if constrained:
        body["response_format"] = SCHEMA
    return ChatRequest(body=body, model="bench")


async def _timed(backend: LocalBackend, prompts: list[str], max_tokens: int,
                 constrained: bool = False) -> tuple[int, float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(backend.chat(_request(p, max_tokens, constrained)) for p in prompts))
    elapsed = time.perf_counter() - started
    return sum(r.response["usage"]["completion_tokens"] for r in results), elapsed


def _mask_ms(backend: LocalBackend, rows: int, steps: int = 200) -> float:
    """The mask's time for ``rows`` constrained sequences inside the schema's long string (median of ``steps``)."""
    engine = backend._engine
    assert engine is not None
    tokenizer = backend.loaded.tokenizer
    grammar = output_grammar(answer=answer_schema(SCHEMA), tools=None, calls="free", parallel=False)
    assert grammar is not None
    matchers = [matcher(engine.grammar_tokenizer, grammar) for _ in range(rows)]
    for m in matchers:
        for token in tokenizer.encode('{"title": "Notes", "text": "The', add_special_tokens=False):
            m.consume_token(token)
    masks = Masks(backend.loaded.model.config.vocab_size)
    logits = torch.zeros(rows, masks.vocab_size)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        masks.apply(logits, list(enumerate(matchers)))
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    settings = BackendSettings(name="local", kind="local", cache_dir=args.cache_dir, threads=args.threads,
                               max_batch_size=max(args.concurrency, 1))
    backend = LocalBackend(settings)
    started = time.perf_counter()
    await backend.start()
    print(f"model loaded in {time.perf_counter() - started:.1f} s (source: {backend.loaded.source})")
    try:
        await _timed(backend, PROMPTS[:1], 4)  # warm-up: first-call allocations and kernel selection
        await _timed(backend, PROMPTS[:1], 4, constrained=True)  # builds the grammar engine's tokenizer once
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
        runs: dict[tuple[int, bool], list[float]] = {}
        for round_ in range(args.rounds):
            for width in (1, args.concurrency):
                for constrained in (False, True):
                    tokens, elapsed = await _timed(backend, prompts[:width], args.max_tokens, constrained)
                    runs.setdefault((width, constrained), []).append(tokens / elapsed)
                    print(f"round {round_ + 1}: {width} request(s), {'json_schema' if constrained else 'free':11}"
                          f" {tokens:4d} tokens in {elapsed:6.2f} s = {tokens / elapsed:7.1f} tokens/s")
        medians = {key: statistics.median(values) for key, values in runs.items()}
        for width in (1, args.concurrency):
            free, held = medians[(width, False)], medians[(width, True)]
            print(f"{width} request(s): free {free:7.1f} tokens/s, json_schema {held:7.1f} tokens/s, "
                  f"constraint cost {1 - held / free:+.1%}")
        for width in (1, args.concurrency):
            print(f"grammar mask, {width} sequence(s): {_mask_ms(backend, width):.3f} ms per decoding step")
        batching = medians[(args.concurrency, False)] / medians[(1, False)]
        print(f"batching ratio ({args.concurrency} vs 1, free): {batching:.2f}x")
    finally:
        await backend.aclose()


if __name__ == "__main__":
    asyncio.run(main())
