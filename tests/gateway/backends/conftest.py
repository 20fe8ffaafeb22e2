"""Fixtures for the local backend: the backend on the tiny Llama (``tests/conftest.py`` has the model), scripted
output, and two LoRA adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import BackendSettings


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """Two LoRA adapters for the tiny Llama that answer differently from it and from each other."""
    from tests.models import random_lora

    root = tmp_path_factory.mktemp("lora")
    return {name: random_lora(tiny_model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2))}


def local_backend(model_dir: Path, **settings: Any) -> Any:
    """A local backend (not started) on ``model_dir``; ``settings`` override the tests' batching defaults."""
    from gateway.backends.local import LocalBackend

    return LocalBackend(BackendSettings(**{"name": "local", "kind": "local", "model_path": str(model_dir),
                                           "batch_wait_ms": 20, "max_batch_size": 8, **settings}))


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[Any]:
    b = local_backend(tiny_model_dir)
    await b.start()
    yield b
    await b.aclose()


def script(backend: Any, token_ids: list[int]) -> None:
    """Make every sequence emit ``token_ids`` in order instead of sampling (the tiny model cannot write
    tool calls or end a turn on its own)."""
    from gateway.backends.local.sampling import Choice

    engine = backend._engine
    assert engine is not None

    def choose(logits: Any) -> list[Choice]:
        return [Choice(token_ids[len(row.token_ids)], -0.5, -0.5) for row in engine._rows]

    engine._choose = choose  # type: ignore[method-assign]
