"""Key/value reuse across requests: a request prefills only the tokens after the longest prefix already computed.

An entry holds the keys and values of a token sequence for one adapter (or the base): a prompt once it is prefilled,
and a whole sequence (prompt and reply) once it finishes, so an agent's next step, which resends the conversation
with the reply and a tool result appended, finds all of it but the new turn. A request matches the entry sharing
the longest common run of leading token ids with its prompt, so requests that only share a system prompt and tool
specs share those too. The keys and values of a position depend on the tokens up to it alone (causal attention,
rotary positions from 0 in every row), so the reused part is what a fresh prefill would compute.

Entries are evicted least recently used first once their bytes pass the budget; one larger than the budget is not
kept. An entry the new one extends is dropped (the new one holds it). Everything here runs on the engine thread;
``stats`` is read from any thread (a snapshot of ints).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [1, kv heads, positions, head dim]
MIN_REUSE = 8  # fewer shared tokens than this are prefilled afresh: not worth a forward pass of their own


@dataclass
class _Entry:
    adapter: str | None
    ids: torch.Tensor  # [positions], the tokens whose keys and values ``layers`` hold
    layers: Layers
    nbytes: int


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    prefill_computed: int = 0  # prompt tokens run through the model
    prefill_saved: int = 0  # prompt tokens taken from the cache instead
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._serial = 0

    def longest(self, adapter: str | None, prompt_ids: list[int]) -> tuple[int, Layers | None]:
        """How many leading tokens of the prompt the cache holds (leaving at least one to prefill, whose logits
        the first sample needs), and their keys and values (views, valid until the next ``add``)."""
        prompt = torch.tensor(prompt_ids)
        best, best_key = 0, None
        for key, entry in self._entries.items():
            if entry.adapter != adapter:
                continue
            n = min(len(entry.ids), len(prompt) - 1)
            if n <= best:
                continue
            differs = (entry.ids[:n] != prompt[:n]).nonzero()
            shared = n if differs.numel() == 0 else int(differs[0])
            if shared > best:
                best, best_key = shared, key
        if best_key is None or best < MIN_REUSE:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in self._entries[best_key].layers]

    def count(self, *, computed: int, saved: int) -> None:
        self.stats.prefill_computed += computed
        self.stats.prefill_saved += saved
        if saved:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

    def add(self, adapter: str | None, ids: list[int], layers: Layers) -> None:
        """Keep the keys and values of ``ids`` (copied: the batch's tensors are freed as it moves on)."""
        if not ids:
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.budget_bytes:
            return
        tokens = torch.tensor(ids)
        for key in [k for k, e in self._entries.items() if e.adapter == adapter and len(e.ids) <= len(tokens)
                    and torch.equal(e.ids, tokens[:len(e.ids)])]:
            self._drop(key)
        self._serial += 1
        self._entries[self._serial] = _Entry(adapter, tokens, [(k.clone(), v.clone()) for k, v in layers], nbytes)
        self.stats.bytes += nbytes
        while self.stats.bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)

    def forget(self, adapter: str) -> None:
        """Drop an unloaded adapter's entries."""
        for key in [k for k, e in self._entries.items() if e.adapter == adapter]:
            self._drop(key)
        self.stats.entries = len(self._entries)

    def _drop(self, key: int) -> None:
        self.stats.bytes -= self._entries.pop(key).nbytes
