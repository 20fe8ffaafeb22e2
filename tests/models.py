"""Small real models for tests: a tiny random Llama that uses the SmolLM2 tokenizer, and LoRA adapters for it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

TINY_CONTEXT = 1024  # the longest prompt of the tools suite (hermes rendering, four tools) is under 800 tokens


def tiny_llama(folder: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A 2-layer Llama with random weights, saved with the tokenizer as a folder a ``model_path`` can name."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True, initializer_range=0.5,
        bos_token_id=1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights would otherwise end a sequence at random; tests that need an end script it.
        for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(token)] = 0.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_lora(model_dir: Path, folder: Path, seed: int, *, scale: float = 0.3,
                targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")) -> Path:
    """A rank-4 LoRA for the model in ``model_dir`` whose weights are all random (peft's own init zeroes B,
    which changes nothing): at ``scale`` 0.3 it answers differently; at 2.0 it is loud noise."""
    from peft import LoraConfig, get_peft_model

    model = LlamaForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(folder)
    return folder
