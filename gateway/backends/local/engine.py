"""The engine: the batch, its KV cache and the model's LoRA adapters, on one worker thread, with torch alone.

The engine knows nothing of asyncio. Its owner appends jobs (``submit``) and operations (``call``) from one
thread, its event loop, and runs ``run`` on a single worker thread whenever work waits; ``run`` returns once
the batch is empty. Each job's events leave through the job's own ``deliver`` callback, and each operation's
result through its ``settle`` callback, both called on the worker thread; the owner makes them thread-safe.

The engine decodes all active sequences in one forward pass per step, with one KV cache for the batch. Jobs
that arrive while a batch runs join it at the next step (their prompts are prefilled in a forward pass of
their own and the caches are merged), as long as the batch has room; so a long generation never makes a
newcomer wait for it.

Prompts are left-padded, with an attention mask and explicit position ids, so padding never changes what a
sequence computes. A sequence leaves the batch as soon as it finishes or its job is cancelled, and columns of
padding no remaining sequence needs are trimmed off the cache.

LoRA adapters (``adapters.py``) are loaded and unloaded at runtime. Loads and unloads change the model, so
they are operations ``run`` applies between two steps, never beside a forward pass. An unloaded adapter's
weights are deleted only once no admitted or waiting job uses it any more.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F

from gateway.backends.base import AdapterNotLoaded, BackendError
from gateway.backends.local.adapters import Adapter, LoraModel
from gateway.backends.local.grammar import Constraint, Masks, tokenizer_for
from gateway.backends.local.heap import map_large_allocations
from gateway.backends.local.jobs import Failure, Finish, Job, JobEvent, Op, Token
from gateway.backends.local.kv import ATTENTION, BatchCache, capacity, position_bytes, zeros
from gateway.backends.local.loading import LoadedModel
from gateway.backends.local.prefix_cache import Key, Layers, Prefix, PrefixCache
from gateway.backends.local.sampling import Choice, choose, generators, shape_logits
from gateway.backends.local.text import TextTracker

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from peft import LoraConfig, PeftModel

log = structlog.get_logger()


@dataclass(eq=False)
class _Sequence:
    job: Job
    index: int
    generator: torch.Generator
    text: TextTracker
    matcher: Constraint | None = None  # what the output must match, when the job is constrained
    token_ids: list[int] = field(default_factory=list)


# Prompt tokens per row and forward pass in a prefill: the activations of a pass (attention scores grow with chunk x
# context) stay bounded however long the prompts are, for one more pass per chunk.
PREFILL_CHUNK = 256


def _left_pad(tensor: torch.Tensor, amount: int, dim: int) -> torch.Tensor:
    if amount == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [amount, 0]  # F.pad lists the last dimension first
    return F.pad(tensor, pad)


class Engine:
    """The batch, its KV cache and the model's adapters. ``run`` and what it calls run on the engine thread;
    ``submit``, ``call``, ``waiting`` and ``pending_sequences`` on the owner's thread; the ``fail_*`` trio on
    the owner's thread only while ``run`` is not running."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int, prefix: PrefixCache | None = None, *,
                 map_large: bool = True, merge_lone_adapter: bool = False, batch_cache_bytes: int = 0) -> None:
        """``map_large``: have glibc map large allocations (``heap.py``), for the whole process;
        ``merge_lone_adapter``: run a batch of one adapter's rows with its weights merged (``LoraModel``);
        ``batch_cache_bytes``: most the batch's keys and values may take, padding included, as a job joins (0: no
        limit)."""
        self.base_model = loaded.model
        loaded.model.set_attn_implementation(ATTENTION)
        if map_large:
            map_large_allocations()
        # the base model, wrapped in peft while any adapter is loaded
        self.model = LoraModel(loaded.model, merge_lone=merge_lone_adapter)
        self.ops: deque[Op] = deque()  # appended by the owner, drained here between steps
        self._retiring: dict[str, Callable[[], None]] = {}  # internal name -> "deleted" callback
        self.tokenizer = loaded.tokenizer
        self.context_length = loaded.context_length
        self.max_batch_size = max_batch_size
        self.batch_cache_positions = batch_cache_bytes // position_bytes(loaded.model.config, loaded.model.dtype) \
            if batch_cache_bytes else 0
        self.stop_token_ids = loaded.stop_token_ids
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.prefix = prefix  # keys and values kept across requests; None: every prompt is prefilled whole
        self.inbox: deque[Job] = deque()
        self.closing = False
        self.forward_passes = 0  # model forward calls (prefills and decode steps), for tests and metrics
        self._rows: list[_Sequence] = []
        self._cache: BatchCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, cached positions], 0 on left padding
        self._logits: torch.Tensor | None = None  # [rows, vocab]: next-token logits of each row
        self._grammar_tokenizer: LLTokenizer | None = None  # built for the first constrained job (~0.3 s)
        self._masks: Masks | None = None
        self._admitting: list[Job] = []  # popped from the inbox by the admission under way

    def submit(self, job: Job) -> None:
        """Queue ``job``; the next ``run`` admits it, at the next step of a running batch."""
        self.inbox.append(job)

    def call(self, run: Callable[[], Any], settle: Callable[[Any, BaseException | None], None]) -> None:
        """Queue ``run`` for the engine thread, between two steps; ``settle`` hears its result or error."""
        self.ops.append(Op(run, settle))

    def waiting(self) -> bool:
        """Whether jobs or operations wait for a ``run``."""
        return bool(self.inbox or self.ops)

    def pending_sequences(self) -> int:
        return sum(job.params.n for job in self.inbox)

    def run(self) -> None:
        """Apply waiting operations; decode until no sequence is active and nothing waits, or the engine closes."""
        with torch.inference_mode():
            try:
                while not self.closing:
                    self._run_ops()
                    self._admit()
                    self._reap()
                    if not self._rows:
                        return
                    self._advance()
            except Exception as exc:  # the batch's requests must hear of any failure, whatever it is
                log.exception("local.generation_failed")
                self.fail_active(BackendError(f"local generation failed: {exc}", status_code=500,
                                              error_type="server_error"))

    def fail_active(self, error: BackendError) -> None:
        """Fail every running job, and those being admitted when the failure came."""
        for job in {**{row.job: None for row in self._rows}, **dict.fromkeys(self._admitting)}:
            job.deliver([Failure(error)])
        self._admitting = []
        self._reset()

    def fail_waiting(self, error: BackendError) -> None:
        while self.inbox:
            self.inbox.popleft().deliver([Failure(error)])

    def fail_ops(self, error: BackendError) -> None:
        """Fail operations never run; an unload still waiting for its requests counts as done (nothing is loaded)."""
        while self.ops:
            self.ops.popleft().settle(None, error)
        retiring, self._retiring = self._retiring, {}
        for deleted in retiring.values():
            deleted()

    # -- adapters --------------------------------------------------------------------------------

    def _run_ops(self) -> None:
        while self.ops:
            op = self.ops.popleft()
            # Outside inference mode: peft later sets requires_grad on adapter weights (when the active
            # adapter is deleted), which PyTorch refuses on tensors created in inference mode.
            with torch.inference_mode(False), torch.no_grad():
                try:
                    result = op.run()
                except Exception as exc:  # the caller hears of it; the batch goes on
                    op.settle(None, exc)
                else:
                    op.settle(result, None)

    def load_adapter(self, internal: str, path: str, config: LoraConfig) -> None:
        """Load the adapter folder ``path`` as ``internal``; raises, leaving the model as it was, if it cannot."""
        self.model.load(internal, path, config)

    @property
    def peft(self) -> PeftModel | None:
        return self.model.peft

    @property
    def adapters(self) -> set[str]:
        """The internal names of the adapters in the model."""
        return self.model.adapters

    def retire_adapter(self, internal: str, deleted: Callable[[], None]) -> None:
        """Delete the adapter once no request admitted or waiting uses it; ``deleted`` is called then."""
        if internal not in self.adapters:
            deleted()
            return
        self._retiring[internal] = deleted
        self._reap()

    def _reap(self) -> None:
        if not self._retiring:
            return
        # tuple() copies the deque in one C call, so the owner cannot append halfway through.
        in_use = {row.job.adapter.internal for row in self._rows if row.job.adapter is not None}
        in_use.update(job.adapter.internal for job in tuple(self.inbox) if job.adapter is not None)
        for internal in [name for name in self._retiring if name not in in_use]:
            deleted = self._retiring.pop(internal)
            if self.prefix is not None:
                self.prefix.forget(internal)
            try:
                with torch.inference_mode(False), torch.no_grad():
                    self.model.delete(internal)
            except Exception:  # the adapter stays in memory, unused; serving goes on
                log.exception("local.adapter_delete_failed", adapter=internal)
            finally:
                deleted()

    def _forward(self, adapters: list[Adapter | None], **inputs: Any) -> Any:
        """One forward pass; ``adapters`` names each row's adapter (None: the base model)."""
        self.forward_passes += 1
        return self.model(adapters, **inputs)

    def _reset(self) -> None:
        self._rows, self._cache, self._mask, self._logits = [], None, None, None

    # -- admission -------------------------------------------------------------------------------

    def _admit(self) -> None:
        # The batch is as wide as its longest row, so a row's keys and values cost that width, not its own length.
        rows, width = len(self._rows), self._mask.shape[1] if self._mask is not None else 0
        jobs: list[Job] = []
        while self.inbox:
            job = self.inbox[0]
            if job.cancelled:
                self.inbox.popleft()
                continue
            if job.adapter is not None and job.adapter.internal not in self.adapters:
                # Cannot happen while unloads wait for their requests; but a missing name would make peft
                # fail the whole batch, so refuse the one request instead.
                self.inbox.popleft().deliver([Failure(AdapterNotLoaded(
                    f"adapter {job.adapter.name!r} is not loaded", adapter=job.adapter.name))])
                continue
            # A job wider than the whole batch still runs, alone, rather than never.
            wider = max(width, len(job.prompt_ids))
            more = rows + job.params.n
            if (jobs or self._rows) and (more > self.max_batch_size or self.batch_cache_positions
                                         and more * wider > self.batch_cache_positions):
                break
            jobs.append(self.inbox.popleft())
            rows, width = more, wider
        if jobs:
            self._admitting = jobs  # out of the inbox, not yet rows: a failure must still reach them
            self._prefill(jobs)
            self._admitting = []

    def _prefill(self, jobs: list[Job]) -> None:
        """Prefill the admitted jobs and join them to the batch: those whose prompt starts with cached keys and
        values from where their cache ends, together with those that have about as many new tokens; the others
        together from the start."""
        fresh, hits = [], []
        for job in jobs:
            hit = self.prefix.longest(_key(job), job.prompt_ids) if self.prefix else None
            if hit is None:
                fresh.append(job)
            else:
                hits.append((job, hit))
        by_new: dict[int, list[tuple[Job, Prefix]]] = {}
        for job, hit in hits:
            by_new.setdefault((len(job.prompt_ids) - hit.length - 1) // PREFILL_CHUNK, []).append((job, hit))
        for group in by_new.values():
            # A row recomputes the end of its cached part up to the group's most new tokens; a prompt shorter than
            # that has too little to recompute and is prefilled from the start instead.
            new = max(len(job.prompt_ids) - hit.length for job, hit in group)
            fresh += [job for job, _ in group if len(job.prompt_ids) <= new]
            group = [(job, hit) for job, hit in group if len(job.prompt_ids) > new]
            if group:
                self._join(*self._prefill_after(group))
        if fresh:
            self._join(*self._prefill_fresh(fresh))

    def _prefill_fresh(self, jobs: list[Job]) -> tuple[list[_Sequence], BatchCache, torch.Tensor, torch.Tensor]:
        width = max(len(job.prompt_ids) for job in jobs)
        ids = torch.tensor([[self.pad_token_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs])
        cache = BatchCache(self.base_model.config.num_hidden_layers, reserve=width)
        logits = self._prefill_chunks(jobs, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        if self.prefix is not None:
            for job in jobs:
                self.prefix.count(computed=len(job.prompt_ids), saved=0)
            self._remember(jobs, [job.prompt_ids for job in jobs], cache, mask)
        return self._rows_of(jobs, cache, mask, logits)

    def _prefill_chunks(self, jobs: list[Job], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                        cache: BatchCache) -> torch.Tensor:
        """Run ``ids`` into ``cache`` (which holds the first columns of ``mask`` already), ``PREFILL_CHUNK``
        columns a pass; the last position's logits."""
        past = mask.shape[1] - ids.shape[1]
        for start in range(0, ids.shape[1], PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, ids.shape[1])
            out = self._forward([job.adapter for job in jobs], input_ids=ids[:, start:end],
                                attention_mask=mask[:, :past + end], position_ids=positions[:, start:end],
                                past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _prefill_after(self, hits: list[tuple[Job, Prefix]]
                       ) -> tuple[list[_Sequence], BatchCache, torch.Tensor, torch.Tensor]:
        """Prefill each prompt's tokens after its cached prefix.

        One prefill for all (in chunks of ``PREFILL_CHUNK``), the new tokens in the last columns: a row with fewer
        new tokens than the most recomputes the end of its cached part instead, so every row reads [padding, cached,
        new] and the batch is no wider than its longest prompt (a gap of padding would stay in the batch, and be
        attended over, until the row ends). ``_prefill`` groups hits by how many new tokens they have, which bounds
        what is recomputed.
        """
        assert self.prefix is not None
        jobs = [job for job, _ in hits]
        new = max(len(job.prompt_ids) - hit.length for job, hit in hits)
        hits = [(job, Prefix(hit.node, len(job.prompt_ids) - new)) for job, hit in hits]
        cached = max(hit.length for _, hit in hits)
        layers = self.prefix.gather([hit for _, hit in hits], cached, capacity(cached + new))
        cache = BatchCache.holding(layers, cached)
        ids, mask, positions = [], [], []
        for job, hit in hits:
            reused = hit.length
            ids.append(job.prompt_ids[reused:])
            mask.append([0] * (cached - reused) + [1] * len(job.prompt_ids))
            positions.append(list(range(reused, len(job.prompt_ids))))
            self.prefix.count(computed=new, saved=reused)
        mask_tensor = torch.tensor(mask)
        logits = self._prefill_chunks(jobs, torch.tensor(ids), mask_tensor, torch.tensor(positions), cache)
        self._remember(jobs, [job.prompt_ids for job in jobs], cache, mask_tensor)
        return self._rows_of(jobs, cache, mask_tensor, logits)

    def _remember(self, jobs: list[Job], ids: list[list[int]], cache: BatchCache, mask: torch.Tensor,
                  rows: list[int] | None = None) -> None:
        """Keep the keys and values of each job's row of the batch (``rows``, else the first ones in order): its
        real positions (``mask``), which hold the tokens ``ids``."""
        assert self.prefix is not None
        layers = cache.to_legacy_cache()
        for job, tokens, k in zip(jobs, ids, rows or range(len(jobs)), strict=True):
            real = mask[k].nonzero()[:, 0]
            if len(real) == len(tokens):
                self.prefix.add(_key(job), tokens, partial(_positions, layers, k, real))

    def _rows_of(self, jobs: list[Job], cache: BatchCache, mask: torch.Tensor, logits: torch.Tensor
                 ) -> tuple[list[_Sequence], BatchCache, torch.Tensor, torch.Tensor]:
        # The n samples of a job share its prompt: prefilled once, then its row is copied.
        rows = [_Sequence(job, i, generator, TextTracker(self.tokenizer, job.params.stop, job.params.tool_stop),
                          job.params.grammar.constraint(i) if job.params.grammar is not None else None)
                for job in jobs for i, generator in enumerate(generators(job.params))]
        if len(rows) != len(jobs):
            repeat = torch.tensor([k for k, job in enumerate(jobs) for _ in range(job.params.n)])
            cache.batch_select_indices(repeat)
            mask, logits = mask[repeat], logits[repeat]
        return rows, cache, mask, logits

    def _join(self, rows: list[_Sequence], cache: BatchCache, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Add prefilled rows to the batch, left-padding whichever side is shorter."""
        log.debug("local.admitted", requests=len({row.job for row in rows}), sequences=len(rows),
                  running=len(self._rows))
        if not self._rows:
            self._rows, self._cache, self._mask, self._logits = rows, cache, mask, logits
            return
        assert self._cache is not None and self._mask is not None and self._logits is not None
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        self._cache.join(cache)
        self._mask = torch.cat([_left_pad(self._mask, width - old_len, 1), _left_pad(mask, width - new_len, 1)])
        self._logits = torch.cat([self._logits, logits])
        self._rows += rows

    def _keep(self, finished: list[int]) -> None:
        """Keep the keys and values of the rows that just finished: the prompt and the reply up to its last token
        (which was sampled, never fed), where the next turn of the conversation will start."""
        assert self._cache is not None and self._mask is not None
        rows = [self._rows[i] for i in finished]
        self._remember([row.job for row in rows], [row.job.prompt_ids + row.token_ids[:-1] for row in rows],
                       self._cache, self._mask, finished)

    # -- one decoding step -----------------------------------------------------------------------

    def _advance(self) -> None:
        """Sample a token for every row, hand it out, drop finished rows, run the next forward pass."""
        assert self._logits is not None and self._mask is not None and self._cache is not None
        choices = self._choose(self._logits)
        events: dict[Job, list[JobEvent]] = {}
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            job = row.job
            if job.cancelled:
                continue
            choice = choices[i]
            token = choice.token
            row.token_ids.append(token)
            reason = None
            if token in self.stop_token_ids and not job.params.ignore_eos:
                text, reason = row.text.flush(), "stop"
            else:
                text, stopped = row.text.push(token)
                reason = "stop" if stopped else None
            # A grammar that failed ends its row with an error finish, even on the end of turn its mask left.
            if row.matcher is not None and (ended := row.matcher.advance(token, reason is None)) is not None:
                text, reason = text + row.text.flush() if reason is None else text, ended
            if reason is None and (len(row.token_ids) >= job.params.max_tokens
                                   or len(job.prompt_ids) + len(row.token_ids) >= self.context_length):
                text, reason = text + row.text.flush(), "length"
            batch = events.setdefault(job, [])
            batch.append(Token(row.index, token, choice.logprob, choice.sampled_logprob, text, choice.top))
            if reason is None:
                keep.append(i)
            else:
                batch.append(Finish(row.index, reason))
        for job, batch in events.items():
            job.deliver(batch)
        if self.prefix is not None and len(keep) < len(self._rows):
            kept = set(keep)
            self._keep([i for i, row in enumerate(self._rows) if i not in kept and not row.job.cancelled])
        if len(keep) < len(self._rows):
            self._select(keep)
        if not self._rows:
            return
        step = torch.tensor([[choices[i].token] for i in keep])
        self._mask = F.pad(self._mask, (0, 1), value=1)
        out = self._forward([row.job.adapter for row in self._rows], input_ids=step, attention_mask=self._mask,
                            position_ids=self._mask.sum(-1, keepdim=True) - 1,
                            past_key_values=self._cache, use_cache=True)
        self._logits = out.logits[:, -1, :].float()

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep``, and cut padding columns that no kept row needs any more."""
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._reset()
            return
        assert self._cache is not None and self._mask is not None and self._logits is not None
        index = torch.tensor(keep)
        mask, logits = self._mask[index], self._logits[index]
        start = int(mask.argmax(dim=1).min())  # first real position of the least padded row
        self._cache.select(index, start)
        self._mask, self._logits = mask[:, start:], logits

    def _choose(self, logits: torch.Tensor) -> list[Choice]:
        # A method of its own so tests can script the tokens (the tiny random model writes no tool calls).
        return choose(logits, self._shaped(logits), [(row.job.params, row.generator) for row in self._rows])

    # -- what the sampled distribution is drawn from ---------------------------------------------

    def _shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits to sample from: penalties and biases applied, and each constrained row's grammar mask."""
        constrained = [(i, row.matcher) for i, row in enumerate(self._rows) if row.matcher is not None]
        shaping = [i for i, row in enumerate(self._rows) if row.job.params.shapes_logits]
        if not constrained and not shaping:
            return logits
        shaped = logits.clone()
        for i in shaping:
            shaped[i] = shape_logits(logits[i], self._rows[i].job.params, self._rows[i].token_ids)
        if constrained:
            if self._masks is None:
                self._masks = Masks(logits.shape[-1])
            self._masks.apply(shaped, constrained)
        return shaped

    @property
    def grammar_tokenizer(self) -> LLTokenizer:
        """The grammar engine's tokenizer (each token's bytes), built on first use from either thread: a race
        builds it twice, harmlessly."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = tokenizer_for(self.tokenizer, self.base_model.config.vocab_size,
                                                    self.stop_token_ids)
        return self._grammar_tokenizer


def _positions(layers: Layers, row: int, real: torch.Tensor, start: int) -> Layers:
    """Row ``row``'s keys and values at its real positions ``real`` from the ``start``-th on (what the prefix cache
    does not hold yet), every layer's copied into one block of memory, which goes back to the system whole when the
    entry is evicted (a small tensor per layer would stay in the heap)."""
    index = real[start:]
    keys = layers[0][0]
    block = zeros((len(layers), 2, 1, keys.shape[1], len(index), keys.shape[3]), keys.dtype, keys.device)
    for layer, (key, value) in zip(block, layers, strict=True):
        torch.index_select(key[row:row + 1], 2, index, out=layer[0])
        torch.index_select(value[row:row + 1], 2, index, out=layer[1])
    return [(layer[0], layer[1]) for layer in block]


def _key(job: Job) -> Key:
    """Whose keys and values a job's are: its tenant's, under its adapter (by internal name, never reused) or the
    base model."""
    return job.tenant, job.adapter.internal if job.adapter is not None else None
