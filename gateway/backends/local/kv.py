"""The batch's keys and values: one buffer per layer with room to grow, written in place, and attention that reads
them without copying.

transformers' ``DynamicCache`` appends a decoding step's position with ``torch.cat``, which copies the whole cache of
every layer at every step; the buffers that copying leaves behind, each a little smaller than the next one needed,
fragmented the heap until the process held several times the cache's size. A ``BatchCache`` layer keeps its keys
and values in a buffer with room for ``BLOCK`` more positions and hands the model views of the filled part; it is
reallocated once every ``BLOCK`` positions, or when rows join the batch (``join``), one layer at a time, so the old
and the new buffers of only one layer ever exist together; rows that leave (``select``) are compacted in place.
Buffers are memory maps of their own (``zeros``), so a buffer let go goes back to the system at once rather than
staying in the allocator's heap.

The model's own SDPA attention copies every layer's keys and values three times over before each pass when a
padding mask is given (grouped-query attention: the model has three key/value heads for nine query heads); the
attention here (``ATTENTION``) lets ``scaled_dot_product_attention`` read the grouped heads as they are, with the
same result, which is most of a decoding step's time at long contexts.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

BLOCK = 128  # positions of room a buffer gets when it is (re)allocated
ATTENTION = "harness_sdpa"
MAPPED = 1 << 20


def capacity(length: int) -> int:
    """How many positions a buffer for ``length`` positions holds: room for 1 to ``BLOCK`` more."""
    return (length // BLOCK + 1) * BLOCK


def position_bytes(config: Any, dtype: torch.dtype) -> int:
    """What one position of one row takes in the cache: its keys and values in every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor of zeros; in host memory from ``MAPPED`` bytes on, in memory mapped for it alone, which starts as
    zeros without being written, takes pages only as they are written (the room a buffer keeps costs nothing until
    used) and goes back to the system as soon as the tensor is freed."""
    count = math.prod(shape)
    # A map per small tensor would waste pages and run into the map limit; an accelerator has its own allocator.
    if count * dtype.itemsize < MAPPED or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)


def _buffers(like: torch.Tensor, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values buffers of zeros for ``rows`` rows and ``length`` positions (and room), shaped like ``like``'s.
    Zeros, not garbage: left padding is masked out of attention, but a NaN there would still reach the output."""
    shape = (rows, like.shape[1], capacity(length), like.shape[3])
    return zeros(shape, like.dtype, like.device), zeros(shape, like.dtype, like.device)


class _Layer(DynamicLayer):
    """One layer's keys and values: ``keys``/``values`` are views of the first ``length`` positions of buffers that
    have room for more."""

    def __init__(self, buffers: tuple[torch.Tensor, torch.Tensor] | None = None, length: int = 0,
                 reserve: int = 0) -> None:
        super().__init__()
        self._reserve = reserve
        self._buffers = buffers
        self.length = length
        if buffers is not None:
            self._adopt(buffers[0])

    def _adopt(self, like: torch.Tensor) -> None:
        assert self._buffers is not None
        self.dtype, self.device, self.is_initialized = like.dtype, like.device, True
        self.keys, self.values = (buffer[:, :, :self.length] for buffer in self._buffers)

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        raise AssertionError("unused: update allocates the buffers")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if self._buffers is None or end > self._buffers[0].shape[2]:
            fresh = _buffers(key_states, key_states.shape[0], max(end, self._reserve))
            if self._buffers is not None:
                for old, new in zip(self._buffers, fresh, strict=True):
                    new[:, :, :self.length] = old[:, :, :self.length]
            self._buffers = fresh
        self._buffers[0][:, :, self.length:end] = key_states
        self._buffers[1][:, :, self.length:end] = value_states
        self.length = end
        self._adopt(key_states)
        return self.keys, self.values

    def release(self) -> None:
        self._buffers, self.keys, self.values, self.length = None, None, None, 0

    def compact(self, rows: torch.Tensor, start: int) -> None:
        """Keep only the rows ``rows``, from position ``start`` on, moved to the front of the buffers they are in.
        Fresh buffers would cost a page fault for every page written, which made this about three times as slow as
        the copy itself (92 against 33 ms for eight rows of 600 positions), and a batch does it every time a row
        finishes. The rows left behind stay allocated until the buffer is next reallocated, within ``BLOCK``
        positions."""
        assert self._buffers is not None
        for buffer, held in zip(self._buffers, (self.keys, self.values), strict=True):
            # The right side is gathered into a new tensor before anything is written: overlap is harmless.
            buffer[:len(rows), :, :self.length - start] = held[rows, :, start:]
        self.length, self._reserve = self.length - start, 0  # the prefill's width is no guide any more
        self._buffers = (self._buffers[0][:len(rows)], self._buffers[1][:len(rows)])
        self._adopt(self._buffers[0])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._buffers is not None:
            self._buffers = (self._buffers[0][indices], self._buffers[1][indices])
            self._adopt(self._buffers[0])


class BatchCache(DynamicCache):
    """The batch's cache, one ``_Layer`` per model layer; ``reserve``: how many positions to make room for when the
    first pass allocates the buffers (a prefill's whole width, though it runs in chunks)."""

    def __init__(self, layers: int | list[_Layer], reserve: int = 0) -> None:
        Cache.__init__(self, layers=layers if isinstance(layers, list) else
                       [_Layer(reserve=reserve) for _ in range(layers)])

    @classmethod
    def holding(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> BatchCache:
        """A cache of the buffers ``layers`` (per layer: keys and values, [rows, heads, capacity, dim]) whose first
        ``length`` positions are filled."""
        return cls([_Layer(buffers, length) for buffers in layers])

    def join(self, other: BatchCache) -> None:
        """Add ``other``'s rows after this batch's, each right-aligned in the wider of the two (zeros before); what
        ``other`` held is let go layer by layer as it is copied."""
        for i, (mine, theirs) in enumerate(zip(self.layers, other.layers, strict=True)):
            width, rows = max(mine.length, theirs.length), mine.keys.shape[0]
            buffers = _buffers(mine.keys, rows + theirs.keys.shape[0], width)
            for buffer, first, second in zip(buffers, (mine.keys, mine.values), (theirs.keys, theirs.values),
                                             strict=True):
                buffer[:rows, :, width - mine.length:width] = first
                buffer[rows:, :, width - theirs.length:width] = second
            self.layers[i] = _Layer(buffers, width)
            theirs.release()

    def select(self, rows: torch.Tensor, start: int) -> None:
        """Keep only the rows ``rows``, from position ``start`` on (the padding before it no kept row needs),
        compacted in place in every layer."""
        for layer in self.layers:
            layer.compact(rows, start)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=is_causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
