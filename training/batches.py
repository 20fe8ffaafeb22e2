"""Batches of training rows and what a model makes of them: padding, the shared prompt a batch runs once, the
logits at the labelled positions, and per-row losses (the general check's perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from training.data import IGNORE, Example, pad_id_of
from training.metrics import perplexity_of


@dataclass
class Batch:
    """Right-padded tensors of a list of examples; padding has attention 0 and label -100."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    tokens: int = field(default=0)  # real (unpadded) tokens
    prefix: int = 0  # leading tokens every row shares and none scores: the decoder runs them once (label_logits)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device), self.tokens,
                     self.prefix)


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself, under a peft wrapper or not."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


MIN_SHARED_PREFIX = 16  # shorter shared prefixes are not worth a second decoder call


def shared_prefix(examples: list[Example]) -> int:
    """How many leading tokens all of ``examples`` share, stopping before the position that predicts any row's
    first label (so every scored position lies after it); 0 for one row or a prefix too short to share."""
    if len(examples) < 2:
        return 0
    first = examples[0].input_ids
    shared = min(len(e.input_ids) for e in examples)
    for e in examples[1:]:
        shared = next((i for i, (a, b) in enumerate(zip(first[:shared], e.input_ids[:shared], strict=True))
                       if a != b), shared)
    labelled = min((i for e in examples for i, label in enumerate(e.labels) if label != IGNORE), default=shared + 1)
    shared = min(shared, labelled - 1)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def positions(examples: list[Example]) -> int:
    """Positions the decoder runs for ``examples`` padded as one batch: their shared prefix once, the rest once a row
    at the longest row's width (under gradient checkpointing, which shares nothing, the prefix once a row too). A
    training step's activations grow with them (about 1.3 MB a position on the embedded model in float32)."""
    prefix = shared_prefix(examples)
    return prefix + len(examples) * (max(len(e.input_ids) for e in examples) - prefix)


def pad_batch(examples: list[Example], pad_id: int, *, share_prefix: bool = True) -> Batch:
    """Right-padded, with the rows' shared prefix (``shared_prefix``; none without ``share_prefix``) noted for
    ``label_logits``."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return Batch(ids, mask, labels, tokens=sum(len(e.input_ids) for e in examples),
                 prefix=shared_prefix(examples) if share_prefix else 0)


def label_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits at the positions that predict a label token, and those labels ([n, vocab], [n]).

    The projection to the vocabulary (batch x seq x vocab) is the biggest tensor of a step, and most positions
    of a row are prompt (system prompt, tool specs, earlier turns) that score nothing; so only the decoder's
    hidden states at the positions that predict a label go through the output layer. Models whose logits are
    more than the output layer of the last hidden state (softcapping, a logit scale) need the full path.

    Rows that begin alike (the system prompt and tool specs of one tool set) share ``batch.prefix`` tokens: the
    decoder runs them once, for one row, and the rest of every row attends to that row's keys and values, repeated
    across the batch. The gradient flows back through the repetition into the one prefix, so loss and gradient
    are those of the full rows (to rounding), for a prefix's compute once instead of once a row. Not under
    gradient checkpointing, which turns the decoder's key-value cache off.
    """
    base = base_of(model)
    decoder = base.get_decoder()
    targets = F.pad(batch.labels, (0, 1), value=IGNORE)[:, 1:]
    start = batch.prefix if not (decoder.training and getattr(decoder, "gradient_checkpointing", False)) else 0
    if start:
        cache = decoder(input_ids=batch.input_ids[:1, :start], use_cache=True).past_key_values
        cache.batch_repeat_interleave(batch.input_ids.shape[0])
        hidden = decoder(input_ids=batch.input_ids[:, start:], attention_mask=batch.attention_mask,
                         past_key_values=cache, use_cache=True).last_hidden_state
        targets = targets[:, start:]  # no position before ``start`` is scored (shared_prefix)
    else:
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    scored = targets != IGNORE
    return base.get_output_embeddings()(hidden[scored]), targets[scored]


@torch.no_grad()
def example_losses(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[Example], *,
                   batch_size: int = 8) -> list[tuple[float, int]]:
    """Each example's summed negative log-likelihood of its label tokens and their number, in the examples' order,
    with whatever adapters are active (per example, so two models can be compared text by text)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
    # Similar lengths together: less padding computed for nothing.
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = pad_batch([examples[i] for i in rows], pad_id_of(tokenizer)).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits, targets = label_logits(model, batch)
            token_nll = F.cross_entropy(logits.float(), targets, reduction="none")
            # label_logits keeps the scored positions in row order: the row of each is its mask's row index.
            row_of = (F.pad(batch.labels, (0, 1), value=IGNORE)[:, 1:] != IGNORE).nonzero()[:, 0]
            nll = torch.zeros(len(rows), device=device).index_add_(0, row_of, token_nll)
            count = torch.bincount(row_of, minlength=len(rows))
            for j, i in enumerate(rows):
                losses[i] = (nll[j].item(), int(count[j].item()))
    finally:
        model.train(was_training)
    return losses


def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[Example], *,
               batch_size: int = 8) -> float:
    """exp of the mean negative log-likelihood of the label tokens, with whatever adapters are active."""
    if not examples:
        raise ValueError("perplexity of no examples")
    return perplexity_of(example_losses(model, tokenizer, examples, batch_size=batch_size))
