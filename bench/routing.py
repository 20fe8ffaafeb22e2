"""Adapter routing: what serving LoRA adapters costs.

    python bench/routing.py [--section routing|local-mixed] [--iterations N] [--tiny] [--batch 8]
                            [--adapters 4] [--rank 8] [--max-tokens 32] [--repeats 2]
                            [--model-path PATH] [--cache-dir DIR] [--threads T]

Sections (``--section``, repeatable; default all):

- ``routing``: what the routing pipeline (alias, defaults, override, canary, resolve, and wrapping an adapter's
  backend) adds per request, for a base, ``base:adapter``, ``base:adapter@version`` and an alias with a canary,
  beside the plain dictionary look-up of a model name that it replaced. Target: under 0.1 ms.

- ``local-mixed``: the local backend's throughput for one batch of ``--batch`` requests sent together, in
  four shapes: the base model with no peft wrapping (no adapter ever loaded), the base model's rows through
  peft (adapters loaded, none named), every row on one adapter, and rows mixed over ``--adapters`` adapters
  and the base (round-robin). The adapters are random rank-``--rank`` LoRAs on the attention projections,
  written to a temp dir. Default model: the embedded SmolLM2-135M (from its cache: a few seconds);
  ``--tiny`` uses a tiny random Llama instead, for a quick check of the script.

Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``, greedy), so the shapes compare
equal work; each figure is the best of ``--repeats`` runs. Not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench import sections  # noqa: E402
from bench.local_backend import PROMPTS  # noqa: E402
from gateway.backends.base import ChatRequest  # noqa: E402
from gateway.backends.local import LocalBackend  # noqa: E402
from gateway.backends.local.loading import load_tokenizer  # noqa: E402
from gateway.config import BackendSettings  # noqa: E402
from tests.models import tiny_llama  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


# -- local-mixed -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchFigure:
    label: str
    requests: int
    tokens: int
    seconds: float
    forward_passes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def random_lora(model: torch.nn.Module, folder: Path, rank: int, seed: int) -> Path:
    """A LoRA adapter folder for ``model`` (plain, not yet wrapped by peft) with random A and B (peft's own
    init zeroes B, which would change nothing and could hide a cost)."""
    from peft import LoraConfig

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            prefix = f"base_model.model.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.02
            weights[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), task_type="CAUSAL_LM").save_pretrained(folder)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


async def _batch(backend: LocalBackend, label: str, adapters: list[str | None], max_tokens: int,
                 repeats: int) -> BatchFigure:
    """Send one request per entry of ``adapters`` at once; the best of ``repeats`` runs."""
    best: BatchFigure | None = None
    for _ in range(repeats):
        requests = [ChatRequest(body={"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                      "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
                                model="bench", adapter=adapter) for i, adapter in enumerate(adapters)]
        passes = backend.forward_passes
        started = time.perf_counter()
        results = await asyncio.gather(*(backend.chat(r) for r in requests))
        elapsed = time.perf_counter() - started
        tokens = sum(r.response["usage"]["completion_tokens"] for r in results)
        assert tokens == max_tokens * len(adapters), "every row must generate max_tokens"
        figure = BatchFigure(label, len(adapters), tokens, elapsed, backend.forward_passes - passes)
        if best is None or figure.seconds < best.seconds:
            best = figure
    assert best is not None
    return best


async def bench_local_mixed(model_path: str | None = None, *, cache_dir: str | None = None,
                            threads: int | None = None, batch: int = 8, adapters: int = 4, rank: int = 8,
                            max_tokens: int = 32, repeats: int = 2,
                            log: Callable[[str], None] = print) -> list[BatchFigure]:
    """Throughput of a batch of ``batch`` requests on the local backend: plain base model, base rows
    through peft, one adapter for every row, and rows mixed over ``adapters`` adapters and the base."""
    settings = BackendSettings(name="local", kind="local", model_path=model_path, cache_dir=cache_dir,
                               threads=threads, max_batch_size=batch)
    backend = LocalBackend(settings)
    started = time.perf_counter()
    await backend.start()
    log(f"model loaded in {time.perf_counter() - started:.1f} s from {backend.loaded.path} "
        f"({sum(p.numel() for p in backend.loaded.model.parameters()) / 1e6:.0f}M parameters, "
        f"{torch.get_num_threads()} threads)")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
            # Written before the first load: the model must still be plain for its module names.
            folders = [random_lora(backend.loaded.model, Path(tmp) / f"lora{k}", rank, seed=k)
                       for k in range(max(adapters, 1))]
            await _batch(backend, "warm-up", [None], 4, 1)
            figures = [await _batch(backend, "base, no peft wrapping", [None] * batch, max_tokens, repeats)]

            started = time.perf_counter()
            names = [f"bench-{k}@1" for k in range(len(folders))]
            for name, folder in zip(names, folders, strict=True):
                await backend.load_adapter(name, str(folder))
            log(f"{len(names)} rank-{rank} adapters loaded in {time.perf_counter() - started:.2f} s")
            await _batch(backend, "warm-up", [names[0], None], 4, 1)

            mixed: list[str | None] = [*names, None]
            figures += [
                await _batch(backend, "base rows through peft", [None] * batch, max_tokens, repeats),
                await _batch(backend, "one adapter", [names[0]] * batch, max_tokens, repeats),
                await _batch(backend, f"mixed: {len(names)} adapters + base", [mixed[i % len(mixed)]
                                                                             for i in range(batch)],
                             max_tokens, repeats),
            ]
            for name in names:
                await backend.unload_adapter(name)
    finally:
        await backend.aclose()
    return figures


def _print_local_mixed(figures: list[BatchFigure], max_tokens: int) -> None:
    plain = figures[0].tokens_per_second
    single = next((f.tokens_per_second for f in figures if f.label == "one adapter"), plain)
    print(f"\n{'batch of ' + str(figures[0].requests):<36} {'tokens':>6} {'seconds':>8} {'tokens/s':>9} "
          f"{'passes':>6} {'vs plain':>9} {'vs one adapter':>15}")
    for f in figures:
        print(f"{f.label:<36} {f.tokens:6d} {f.seconds:8.2f} {f.tokens_per_second:9.1f} {f.forward_passes:6d} "
              f"{f.tokens_per_second / plain:8.2f}x {f.tokens_per_second / single:14.2f}x")
    print(f"({max_tokens} tokens per request; forward passes = 1 prefill + decode steps when the batch is shared)")


def section_local_mixed(args: argparse.Namespace) -> None:
    print("== local-mixed: mixed-adapter batches on the local backend ==")
    with tempfile.TemporaryDirectory(prefix="bench-tiny-") as tmp:
        model_path = str(tiny_llama(Path(tmp), load_tokenizer())) if args.tiny else args.model_path
        figures = asyncio.run(bench_local_mixed(model_path, cache_dir=args.cache_dir, threads=args.threads,
                                                batch=args.batch, adapters=args.adapters, rank=args.rank,
                                                max_tokens=args.max_tokens, repeats=args.repeats))
    _print_local_mixed(figures, args.max_tokens)


# -- main ----------------------------------------------------------------------------------------------

# -- routing latency ----------------------------------------------------------------------------------


def bench_routing_latency(iterations: int) -> list[tuple[str, float]]:
    """Microseconds per request for each routing path, from the name the client sent to the backend (wrapped
    for its adapter): what the pipeline adds over the plain dictionary look-up it replaced."""
    import timeit

    from gateway.app import Gateway
    from gateway.auth import Principal
    from gateway.config import Settings
    from gateway.routing import Snapshot

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.model_validate({
            "store": {"path": f"{tmp}/harness.db"},
            "backends": [{"name": "up", "kind": "sglang", "base_url": "http://127.0.0.1:9/v1", "models": ["qwen"]}],
            "routing": {"aliases": {"support": "qwen:sql"},
                        "canaries": [{"model": "support", "target": "qwen:sql@2", "share": 0.1}]},
        })
        gateway = Gateway(settings)
        registry = gateway.adapters.registry
        for version in (1, 2):
            registry.register("sql", "qwen", f"{tmp}/sql{version}")
        registry.promote("sql", 1)
        gateway.adapter_manager.snapshot = Snapshot(registry.all())
        caller = Principal(key_id="k", tenant="t").caller()

        def route(model: str, session: str = "s") -> object:
            return gateway.router.route(gateway.router.name_for(model, caller), session)

        cases: dict[str, Callable[[], object]] = {
            "dict look-up (before routing)": lambda: gateway.model_map.get("qwen"),
            "base": lambda: route("qwen"),
            "base:adapter": lambda: route("qwen:sql"),
            "base:adapter@version": lambda: route("qwen:sql@2"),
            "alias + canary draw": lambda: route("support", "session-1"),
        }
        return [(label, min(timeit.repeat(fn, number=iterations, repeat=3)) / iterations * 1e6)
                for label, fn in cases.items()]


def section_routing(args: argparse.Namespace) -> None:
    figures = bench_routing_latency(args.iterations)
    print(f"\nrouting latency per request (best of 3 x {args.iterations:,}; target: under 100 us)")
    print(f"{'path':<32}{'us':>10}{'pass':>8}")
    for label, micros in figures:
        print(f"{label:<32}{micros:>10.2f}{'' if label.startswith('dict') else ('yes' if micros < 100 else 'NO'):>8}")


SECTIONS: dict[str, sections.Section] = {
    "routing": section_routing,
    "local-mixed": section_local_mixed,
}


def main(argv: list[str] | None = None) -> None:
    parser = sections.parser(__doc__, SECTIONS)
    parser.add_argument_group("routing").add_argument("--iterations", type=int, default=100_000,
                                                      help="routing calls per timing (default 100,000)")
    local = parser.add_argument_group("local-mixed")
    sections.model_options(local)
    local.add_argument("--cache-dir")
    local.add_argument("--batch", type=int, default=8, help="requests sent together (default 8)")
    local.add_argument("--adapters", type=int, default=4, help="adapters in the mixed batch (default 4)")
    local.add_argument("--rank", type=int, default=8)
    local.add_argument("--max-tokens", type=int, default=32)
    local.add_argument("--repeats", type=int, default=2, help="runs per figure; the best is kept")
    sections.run(parser.parse_args(argv), SECTIONS)


if __name__ == "__main__":
    main()
