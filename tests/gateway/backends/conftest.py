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
