"""Fixtures for the local backend: two LoRA adapters for the tiny Llama (``tests/conftest.py`` has the model)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """Two LoRA adapters for the tiny Llama that answer differently from it and from each other."""
    from tests.models import random_lora

    root = tmp_path_factory.mktemp("lora")
    return {name: random_lora(tiny_model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2))}
