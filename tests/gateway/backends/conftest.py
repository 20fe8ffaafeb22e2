"""Fixtures for the local backend: the SmolLM2 tokenizer and a tiny random Llama that uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from gateway.backends.local_model import load_tokenizer

TINY_CONTEXT = 256


@pytest.fixture(scope="session")
def smol_tokenizer() -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer: instant from the model cache, else read from the GGUF (~7 s)."""
    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A 2-layer Llama with random weights, saved as a checkpoint folder a ``model_path`` can name."""
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True, initializer_range=0.5,
        bos_token_id=1, eos_token_id=smol_tokenizer.eos_token_id, pad_token_id=smol_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights would otherwise end a sequence at random; tests that need an end script it.
        for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            model.model.embed_tokens.weight[smol_tokenizer.convert_tokens_to_ids(token)] = 0.0
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def _random_lora(model_dir: Path, folder: Path, seed: int) -> Path:
    """A rank-4 LoRA for the model in ``model_dir`` whose weights are all random, so it changes the output
    (peft's own init zeroes B, which changes nothing)."""
    from peft import LoraConfig, get_peft_model

    model = LlamaForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """Two LoRA adapters for the tiny Llama that answer differently from it and from each other."""
    root = tmp_path_factory.mktemp("lora")
    return {name: _random_lora(tiny_model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2))}
