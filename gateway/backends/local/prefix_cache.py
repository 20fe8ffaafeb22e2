"""Key/value reuse across requests: a request prefills only the tokens after the longest prefix already computed.

An entry holds the keys and values of a token sequence for one adapter (or the base) and one tenant (a ``Key``):
a prompt once it is prefilled,
and a whole sequence (prompt and reply) once it finishes, so an agent's next step, which resends the conversation
with the reply and a tool result appended, finds all of it but the new turn. A request matches the entry sharing
the longest common run of leading token ids with its prompt, so requests that only share a system prompt and tool
specs share those too. The keys and values of a position depend on the tokens up to it alone (causal attention,
rotary positions from 0 in every row), so the reused part is what a fresh prefill would compute.

Entries form a tree: a new entry keeps only the positions after the longest prefix an entry already holds and
points at that entry for the rest, so eight episodes that share a 440-token system prompt and tool specs hold it
once, and each step of an episode adds only its new turn. An entry the new one extends is hidden (no longer matched:
the new one covers it) and lives on only while entries point at it. Entries are evicted least recently used first
once the bytes of all nodes pass the budget; evicting one frees it and every hidden node nothing else points at.
A hit's keys and values are copied into the batch's own cache before anything is added, so eviction can never take
them from under a running request: nothing needs pinning. Everything here runs on the engine thread; ``stats`` is
read from any thread (a snapshot of ints).

Entries are never shared across tenants: a hit is much faster than a prefill, so a tenant could otherwise learn
whether a guess of another tenant's prompt (a system prompt holding a secret) had been seen, by its latency alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gateway.backends.local.kv import zeros

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [1, kv heads, positions, head dim]
Key = tuple[str | None, str | None]  # whose entries: (tenant, adapter's internal name), None for none and the base
MIN_REUSE = 8  # fewer shared tokens than this are prefilled afresh: not worth a forward pass of their own


@dataclass(eq=False)
class _Node:
    key: Key
    ids: torch.Tensor  # [positions], every token from the first: the parent's ``start`` and this node's own
    parent: _Node | None
    start: int  # positions before this one are the parent's
    layers: Layers  # this node's own positions, ``start`` to ``len(ids)``
    nbytes: int
    children: int = 0
    visible: bool = True  # matched by lookups; a hidden node is kept only for its children

    def pieces(self, n: int) -> list[tuple[_Node, int, int]]:
        """Which nodes hold positions 0..n, as (node, first position, end), first position first."""
        out, node, end = [], self, n
        while node is not None:
            if end > node.start:
                out.append((node, node.start, end))
                end = node.start
            node = node.parent
        return out[::-1]


@dataclass(frozen=True)
class Prefix:
    """A hit: the first ``length`` positions of an entry."""

    node: _Node
    length: int


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    prefill_computed: int = 0  # prompt tokens run through the model
    prefill_saved: int = 0  # prompt tokens taken from the cache instead
    evictions: int = 0
    entries: int = 0  # sequences a lookup can match
    bytes: int = 0  # every node's own keys and values


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.stats = PrefixStats()
        self._visible: OrderedDict[int, _Node] = OrderedDict()  # by id(node), least recently used first

    def _match(self, key: Key, ids: torch.Tensor, limit: int) -> tuple[int, _Node | None]:
        """The entry sharing the most leading tokens with ``ids`` (at most ``limit``), and how many."""
        best, best_node = 0, None
        for node in self._visible.values():
            if node.key != key:
                continue
            n = min(len(node.ids), limit)
            if n <= best:
                continue
            differs = (node.ids[:n] != ids[:n]).nonzero()
            shared = n if differs.numel() == 0 else int(differs[0])
            if shared > best:
                best, best_node = shared, node
        return best, best_node

    def longest(self, key: Key, prompt_ids: list[int]) -> Prefix | None:
        """The longest cached prefix of the prompt, leaving at least one token to prefill (whose logits the first
        sample needs); None below ``MIN_REUSE`` tokens. Valid until the next ``add``."""
        shared, node = self._match(key, torch.tensor(prompt_ids), len(prompt_ids) - 1)
        if node is None or shared < MIN_REUSE:
            return None
        self._visible.move_to_end(id(node))
        return Prefix(node, shared)

    def gather(self, hits: list[Prefix], width: int, capacity: int) -> Layers:
        """The hits' keys and values as one batch, each row's right-aligned in the first ``width`` positions (zeros
        before) of buffers of ``capacity`` positions, so the prefill that follows writes into them in place."""
        out = []
        for layer in range(len(hits[0].node.layers)):
            k0 = hits[0].node.layers[layer][0]
            shape = (len(hits), k0.shape[1], capacity, k0.shape[3])
            keys, values = zeros(shape, k0.dtype, k0.device), zeros(shape, k0.dtype, k0.device)
            for row, hit in enumerate(hits):
                offset = width - hit.length
                for node, first, end in hit.node.pieces(hit.length):
                    k, v = node.layers[layer]
                    keys[row, :, offset + first:offset + end] = k[0, :, first - node.start:end - node.start]
                    values[row, :, offset + first:offset + end] = v[0, :, first - node.start:end - node.start]
            out.append((keys, values))
        return out

    def count(self, *, computed: int, saved: int) -> None:
        self.stats.prefill_computed += computed
        self.stats.prefill_saved += saved
        if saved:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

    def add(self, key: Key, ids: list[int], positions_from: Callable[[int], Layers]) -> None:
        """Keep the keys and values of ``ids``: only those after the longest prefix already held, which
        ``positions_from(start)`` gives as new tensors (not views of the batch's, which it frees as it moves on)."""
        if not ids:
            return
        tokens = torch.tensor(ids)
        shared, parent = self._match(key, tokens, len(tokens))
        if shared == len(tokens):  # an entry already holds all of it
            self._visible.move_to_end(id(parent))
            return
        if shared < MIN_REUSE:
            shared, parent = 0, None
        own = positions_from(shared)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in own)
        if nbytes > self.budget_bytes:
            return
        node = _Node(key, tokens, parent, shared, own, nbytes)
        if parent is not None:
            parent.children += 1
        for extended in [n for n in self._visible.values() if n.key == key and len(n.ids) <= len(tokens)
                         and torch.equal(n.ids, tokens[:len(n.ids)])]:
            self._hide(extended)
        self._visible[id(node)] = node
        self.stats.bytes += nbytes
        while self.stats.bytes > self.budget_bytes:
            self._hide(next(iter(self._visible.values())))
            self.stats.evictions += 1
        self.stats.entries = len(self._visible)

    def forget(self, adapter: str) -> None:
        """Drop an unloaded adapter's entries, every tenant's."""
        for node in [n for n in self._visible.values() if n.key[1] == adapter]:
            self._hide(node)
        self.stats.entries = len(self._visible)

    def _hide(self, node: _Node) -> None:
        """No longer match ``node``; free it, and the hidden nodes above it, once nothing points at them."""
        del self._visible[id(node)]
        node.visible = False
        while node is not None and not node.visible and node.children == 0:
            self.stats.bytes -= node.nbytes
            parent, node.parent = node.parent, None
            if parent is not None:
                parent.children -= 1
            node = parent
