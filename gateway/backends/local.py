"""The embedded model as a ``Backend``: transformers on CPU with dynamic (continuous) batching.

Requests become jobs in an inbox. A scheduler task on the event loop waits for the first job,
gathers more for up to ``batch_wait_ms`` (or until ``max_batch_size`` sequences wait), then runs the
engine on its own thread until no work is left. The engine decodes all active sequences in one
forward pass per step, with one KV cache for the batch. Jobs that arrive while a batch runs join
it at the next step (their prompts are prefilled in a forward pass of their own and the caches are
merged), as long as the batch has room; so a long generation never makes a newcomer wait for it.

Prompts are left-padded, with an attention mask and explicit position ids, so padding never changes
what a sequence computes. A sequence leaves the batch as soon as it finishes or its request is
cancelled, and columns of padding no remaining sequence needs are trimmed off the cache.
Tokens travel back to each request's asyncio queue through ``loop.call_soon_threadsafe``.

LoRA adapters (peft) are loaded and unloaded at runtime. The model is wrapped in a ``PeftModel`` only
while at least one adapter is loaded, so a gateway that never loads one runs the plain model. One batch
mixes rows for different adapters and for the base model: every forward pass names each row's adapter
(peft's ``adapter_names``, ``__base__`` for the base). Loads and unloads change the model, so they are
operations the engine thread runs between two steps, never beside a forward pass; the scheduler runs the
engine for them when it is idle. An unloaded adapter's weights are deleted only once no admitted or
waiting request uses it any more.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from gateway.agent.parsing import ToolCallStreamFilter, parse_tool_calls, partial_suffix_length
from gateway.backends.base import (
    AdapterNotLoaded,
    BackendError,
    BackendUnavailable,
    CallExtras,
    ChatRequest,
    ChatResult,
)
from gateway.backends.local_model import LoadedModel, ModelLoadError, load_model
from gateway.config import BackendSettings
from gateway.prompting import encode_prompt

if TYPE_CHECKING:  # peft is imported on the first load: it takes over a second, and most gateways never load one
    from peft import LoraConfig, PeftModel

log = structlog.get_logger()

DEFAULT_MAX_TOKENS = 256
MAX_N = 128
_GREEDY_BELOW = 1e-5  # temperatures this small sample the argmax anyway
_BASE = "__base__"  # peft's name, in ``adapter_names``, for a row that runs without an adapter


def _invalid(message: str, param: str | None = None, code: str | None = None) -> BackendError:
    return BackendError(message, status_code=400, error_type="invalid_request_error", param=param, code=code)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SamplingParams:
        """Read and check the sampling fields of an OpenAI chat body (400 on bad values)."""

        def number(name: str, default: float, low: float, high: float) -> float:
            value = body.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise _invalid(f"{name} must be a number between {low} and {high}", name)
            return float(value)

        def integer(name: str, default: int | None, low: int, high: int) -> int | None:
            value = body.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise _invalid(f"{name} must be an integer between {low} and {high}", name)
            return value

        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise _invalid("stop must be a string or a list of strings", "stop")
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        top_p = number("top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise _invalid("top_p must be greater than 0", "top_p")
        return cls(
            max_tokens=integer(limit_name, DEFAULT_MAX_TOKENS, 1, 1 << 30),  # type: ignore[arg-type]
            temperature=number("temperature", 1.0, 0.0, 2.0),
            top_p=top_p,
            n=integer("n", 1, 1, MAX_N),  # type: ignore[arg-type]
            seed=integer("seed", None, -(1 << 63), (1 << 63) - 1),
            stop=tuple(s for s in stop or () if s),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )


@dataclass(frozen=True)
class _Adapter:
    name: str  # as requests name it (``sql@3``)
    # peft's name for it: request names hold characters peft's module dicts refuse (``.``), and a name
    # reloaded while its previous weights still serve a request must not collide with them.
    internal: str
    path: str


@dataclass(eq=False)
class _Op:
    """A change to the model that the engine thread runs between two steps."""

    run: Callable[[], Any]
    settle: Callable[[Any, BaseException | None], None]  # thread-safe: (result, error)


class _AdapterLoadError(Exception):
    """An adapter folder that cannot be served; the message says why."""


# Events from the engine thread to a request, delivered as one list per job and step.
@dataclass(frozen=True)
class _Token:
    index: int
    token_id: int
    logprob: float
    text: str  # newly releasable text; "" while a character or possible stop string is incomplete


@dataclass(frozen=True)
class _Finish:
    index: int
    reason: str  # stop | length


@dataclass(frozen=True)
class _Failure:
    error: BackendError


@dataclass(frozen=True)
class _Cancelled:
    """Posted by the request itself so a consumer blocked on the queue wakes up and ends."""


_Event = _Token | _Finish | _Failure | _Cancelled


@dataclass(eq=False)
class _Job:
    """One request as the engine sees it: a prompt and ``params.n`` sequences to generate from it."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[list[_Event]], None]  # thread-safe
    queue: asyncio.Queue[list[_Event]]
    adapter: _Adapter | None = None  # None: the base model
    cancelled: bool = False  # set on the event loop; the engine drops the job at its next step


class _TextTracker:
    """Incremental detokenization of one sequence, and its stop strings.

    Decodes a window of recent ids so multi-byte characters split across tokens are released only
    once complete, and holds back any end of the text that may be the start of a stop string.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._longest_stop = max((len(s) for s in stops), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to text already counted
        self._read = 0
        self._text = ""
        self._released = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_step(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token: (text to release, whether a stop string ended the sequence)."""
        self._ids.append(token_id)
        searched_from = max(0, len(self._text) - self._longest_stop + 1)
        self._text += self._decode_step(final=False)
        if self._stops:
            hits = [i for i in (self._text.find(s, searched_from) for s in self._stops) if i != -1]
            if hits:
                self._text = self._text[:min(hits)]
                out, self._released = self._text[self._released:], len(self._text)
                return out, True
        limit = len(self._text) - partial_suffix_length(self._text, self._stops)
        out = self._text[self._released:limit]
        self._released = max(self._released, limit)
        return out, False

    def flush(self) -> str:
        """Release everything held, an incomplete last character included: the sequence has ended."""
        self._text += self._decode_step(final=True)
        out, self._released = self._text[self._released:], len(self._text)
        return out


@dataclass(eq=False)
class _Sequence:
    job: _Job
    index: int
    generator: torch.Generator
    text: _TextTracker
    token_ids: list[int] = field(default_factory=list)


def _left_pad(tensor: torch.Tensor, amount: int, dim: int) -> torch.Tensor:
    if amount == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [amount, 0]  # F.pad lists the last dimension first
    return F.pad(tensor, pad)


class _Engine:
    """The batch, its KV cache and the model's adapters. Methods run on the engine thread, except
    ``pending_sequences`` and the ``fail_*`` trio, which the event loop calls only while the engine is idle."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int) -> None:
        self.base_model = loaded.model
        self.peft: PeftModel | None = None  # wraps base_model (in place) while any adapter is loaded
        self.adapters: set[str] = set()  # internal names of the adapters in the model
        self.ops: deque[_Op] = deque()  # appended on the event loop, drained here between steps
        self._retiring: dict[str, Callable[[], None]] = {}  # internal name -> thread-safe "deleted" callback
        self.tokenizer = loaded.tokenizer
        self.context_length = loaded.context_length
        self.max_batch_size = max_batch_size
        self.stop_token_ids = loaded.stop_token_ids
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.inbox: deque[_Job] = deque()
        self.closing = False
        self.forward_passes = 0  # model forward calls (prefills and decode steps), for tests and metrics
        self._rows: list[_Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, cached positions], 0 on left padding
        self._logits: torch.Tensor | None = None  # [rows, vocab]: next-token logits of each row

    def pending_sequences(self) -> int:
        return sum(job.params.n for job in self.inbox)

    def run(self) -> None:
        """Apply waiting operations; decode until no sequence is active and nothing waits, or the backend closes."""
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
        for job in {row.job: None for row in self._rows}:
            job.emit([_Failure(error)])
        self._reset()

    def fail_waiting(self, error: BackendError) -> None:
        while self.inbox:
            self.inbox.popleft().emit([_Failure(error)])

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
        from peft import PeftModel

        first = self.peft is None
        try:
            if self.peft is None:
                self.peft = PeftModel(self.base_model, config, adapter_name=internal)
            # load_adapter skips creating an adapter the constructor already made, and returns the missing
            # tensors (which from_pretrained only warns about), so both paths share it.
            result = self.peft.load_adapter(path, adapter_name=internal, torch_device=str(self.base_model.device))
            if result.missing_keys:
                raise _AdapterLoadError(f"its weights lack {len(result.missing_keys)} tensors its config asks for, "
                                        f"such as {result.missing_keys[0]}")
        except Exception:
            if first:
                self._unwrap()
            elif self.peft is not None and internal in self.peft.peft_config:
                self.peft.delete_adapter(internal)
            raise
        self.peft.eval()  # peft refuses adapter_names in training mode
        self.adapters.add(internal)

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
        # tuple() copies the deque in one C call, so the event loop cannot append halfway through.
        in_use = {row.job.adapter.internal for row in self._rows if row.job.adapter is not None}
        in_use.update(job.adapter.internal for job in tuple(self.inbox) if job.adapter is not None)
        for internal in [name for name in self._retiring if name not in in_use]:
            deleted = self._retiring.pop(internal)
            try:
                with torch.inference_mode(False), torch.no_grad():
                    self._delete_adapter(internal)
            except Exception:  # the adapter stays in memory, unused; serving goes on
                log.exception("local.adapter_delete_failed", adapter=internal)
            finally:
                deleted()

    def _delete_adapter(self, internal: str) -> None:
        self.adapters.discard(internal)
        assert self.peft is not None
        if not self.adapters:
            self._unwrap()  # back to the plain model: as fast as before any adapter was loaded
            return
        if self.peft.active_adapter == internal:
            # peft warns when the active adapter is deleted; no forward pass relies on which one is active
            # (each names its rows' adapters), so hand the role to a survivor first.
            self.peft.set_adapter(next(iter(self.adapters)))
        self.peft.delete_adapter(internal)

    def _unwrap(self) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if self.peft is not None:
            self.peft.unload()
        # A wrap that failed halfway leaves LoRA layers in the model with no PeftModel to unload them.
        for name, module in list(self.base_model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.base_model.get_submodule(parent), child, module.get_base_layer())
        self.peft = None
        self.adapters.clear()

    def _forward(self, adapters: list[_Adapter | None], **inputs: Any) -> Any:
        """One forward pass; ``adapters`` names each row's adapter (None: the base model)."""
        self.forward_passes += 1
        if self.peft is None:
            return self.base_model(**inputs)
        # Without adapter_names peft would apply its active adapter to every row, base rows included.
        return self.peft(**inputs, adapter_names=[_BASE if a is None else a.internal for a in adapters])

    def _reset(self) -> None:
        self._rows, self._cache, self._mask, self._logits = [], None, None, None

    # -- admission -------------------------------------------------------------------------------

    def _admit(self) -> None:
        room = self.max_batch_size - len(self._rows)
        jobs: list[_Job] = []
        while self.inbox:
            job = self.inbox[0]
            if job.cancelled:
                self.inbox.popleft()
                continue
            if job.adapter is not None and job.adapter.internal not in self.adapters:
                # Cannot happen while unloads wait for their requests; but a missing name would make peft
                # fail the whole batch, so refuse the one request instead.
                self.inbox.popleft().emit([_Failure(AdapterNotLoaded(
                    f"adapter {job.adapter.name!r} is not loaded", adapter=job.adapter.name))])
                continue
            # A job wider than the whole batch still runs, alone, rather than never.
            if job.params.n > room and (jobs or self._rows):
                break
            jobs.append(self.inbox.popleft())
            room -= job.params.n
        if jobs:
            self._prefill(jobs)

    def _prefill(self, jobs: list[_Job]) -> None:
        width = max(len(job.prompt_ids) for job in jobs)
        ids = torch.tensor([[self.pad_token_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs])
        cache = DynamicCache(config=self.base_model.config)
        out = self._forward([job.adapter for job in jobs], input_ids=ids, attention_mask=mask,
                            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        # The n samples of a job share its prompt: prefill it once, then copy its row.
        rows = [_Sequence(job, i, generator, _TextTracker(self.tokenizer, job.params.stop))
                for job in jobs for i, generator in enumerate(_generators(job.params))]
        if len(rows) != len(jobs):
            repeat = torch.tensor([k for k, job in enumerate(jobs) for _ in range(job.params.n)])
            cache.batch_select_indices(repeat)
            mask, logits = mask[repeat], logits[repeat]
        log.debug("local.admitted", requests=len(jobs), sequences=len(rows), running=len(self._rows))
        if not self._rows:
            self._rows, self._cache, self._mask, self._logits = rows, cache, mask, logits
            return
        assert self._cache is not None and self._mask is not None and self._logits is not None
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        self._cache = DynamicCache(ddp_cache_data=[
            (torch.cat([_left_pad(k0, width - old_len, 2), _left_pad(k1, width - new_len, 2)]),
             torch.cat([_left_pad(v0, width - old_len, 2), _left_pad(v1, width - new_len, 2)]))
            for (k0, v0), (k1, v1) in zip(self._cache.to_legacy_cache(), cache.to_legacy_cache(), strict=True)
        ], config=self.base_model.config)
        self._mask = torch.cat([_left_pad(self._mask, width - old_len, 1), _left_pad(mask, width - new_len, 1)])
        self._logits = torch.cat([self._logits, logits])
        self._rows += rows

    # -- one decoding step -----------------------------------------------------------------------

    def _advance(self) -> None:
        """Sample a token for every row, hand it out, drop finished rows, run the next forward pass."""
        assert self._logits is not None and self._mask is not None and self._cache is not None
        tokens, logprobs = self._choose(self._logits)
        events: dict[_Job, list[_Event]] = {}
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            job = row.job
            if job.cancelled:
                continue
            token = tokens[i]
            row.token_ids.append(token)
            reason = None
            if token in self.stop_token_ids and not job.params.ignore_eos:
                text, reason = row.text.flush(), "stop"
            else:
                text, stopped = row.text.push(token)
                reason = "stop" if stopped else None
            if reason is None and (len(row.token_ids) >= job.params.max_tokens
                                   or len(job.prompt_ids) + len(row.token_ids) >= self.context_length):
                text, reason = text + row.text.flush(), "length"
            batch = events.setdefault(job, [])
            batch.append(_Token(row.index, token, logprobs[i], text))
            if reason is None:
                keep.append(i)
            else:
                batch.append(_Finish(row.index, reason))
        for job, batch in events.items():
            job.emit(batch)
        if len(keep) < len(self._rows):
            self._select(keep)
        if not self._rows:
            return
        step = torch.tensor([[tokens[i]] for i in keep])
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
        self._cache = DynamicCache(ddp_cache_data=[
            (k[index, :, start:], v[index, :, start:]) for k, v in self._cache.to_legacy_cache()
        ], config=self.base_model.config)
        self._mask, self._logits = mask[:, start:], logits

    def _choose(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """The next token of each row and its log-probability under the model (temperature 1, no top-p),
        the quantity a policy-gradient trainer compares against."""
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logits.argmax(dim=-1)
        for i, row in enumerate(self._rows):
            params = row.job.params
            if params.temperature < _GREEDY_BELOW:
                continue
            probs = torch.softmax(logits[i] / params.temperature, dim=-1)
            if params.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keeps at least the top token
                probs = probs.scatter(0, order[outside], 0.0)
            chosen[i] = torch.multinomial(probs, 1, generator=row.generator)[0]
        tokens = chosen.tolist()
        return tokens, logprobs.gather(1, chosen[:, None])[:, 0].tolist()


def _generators(params: SamplingParams) -> list[torch.Generator]:
    """One generator per sequence; with a seed the whole request is reproducible, whatever it is batched with."""
    base = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    seeds = torch.randint(0, 1 << 62, (params.n,), generator=base).tolist()
    return [torch.Generator().manual_seed(s) for s in seeds]


def _lora_config(path: str) -> LoraConfig:
    """The LoRA config of the adapter folder ``path``, checked for what mixed-adapter batches support."""
    from peft import LoraConfig

    folder = Path(path)
    # peft takes a path that is not a local folder for a Hub repository id; never go looking there.
    if not folder.is_dir():
        raise _AdapterLoadError("no such folder")
    if not (folder / "adapter_model.safetensors").is_file() and not (folder / "adapter_model.bin").is_file():
        raise _AdapterLoadError("the folder holds no adapter_model.safetensors")
    try:
        raw = json.loads((folder / "adapter_config.json").read_text())
        peft_type = raw.get("peft_type") if isinstance(raw, dict) else None
        if peft_type != "LORA":
            raise _AdapterLoadError(f"only LoRA adapters are served; this one is {peft_type or 'of no known type'}")
        config = LoraConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as exc:
        raise _AdapterLoadError(f"cannot read adapter_config.json: {exc}") from exc
    # peft's mixed-adapter batches refuse both; better to say so now than fail a batch later.
    if config.use_dora:
        raise _AdapterLoadError("DoRA adapters cannot share a batch with other adapters")
    if getattr(config, "target_parameters", None):
        raise _AdapterLoadError("adapters on parameters (target_parameters) cannot share a batch")
    config.inference_mode = True
    return config


@dataclass(frozen=True)
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    tools_enabled: bool
    adapter: str | None = None  # the name the request gave


class LocalBackend:
    """The embedded transformers model, batching concurrent requests into shared forward passes.

    Serves LoRA adapters (``AdapterHost``): ``ChatRequest.adapter`` names one loaded with ``load_adapter``.
    """

    def __init__(self, settings: BackendSettings) -> None:
        self.name = settings.name
        self.models = list(settings.models)
        self._settings = settings
        self._loaded: LoadedModel | None = None
        self._engine: _Engine | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        # Changed on the event loop only; the engine learns of changes through its ops.
        self._adapters: dict[str, _Adapter] = {}
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._serial = itertools.count(1)

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise BackendUnavailable("the local model is not loaded", code="not_started")
        return self._loaded

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of ``messages`` as this model is prompted with them (the agent's context budget)."""
        return len(encode_prompt(self.loaded.tokenizer, messages))

    @property
    def forward_passes(self) -> int:
        return self._engine.forward_passes if self._engine else 0

    async def start(self) -> None:
        if self._settings.threads:
            torch.set_num_threads(self._settings.threads)
        try:
            self._loaded = await asyncio.to_thread(load_model, self._settings.model_path, self._settings.cache_dir)
        except ModelLoadError as exc:
            raise BackendUnavailable(str(exc), code="model_load_failed") from exc
        self._engine = _Engine(self._loaded, self._settings.max_batch_size)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-engine")
        self._scheduler = asyncio.create_task(self._schedule(self._engine), name=f"{self.name}-scheduler")
        log.info("local.started", backend=self.name, threads=torch.get_num_threads(),
                 max_batch_size=self._settings.max_batch_size, context_length=self._loaded.context_length)

    async def aclose(self) -> None:
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        engine.closing = True
        if self._scheduler is not None:
            self._scheduler.cancel()
            with suppress(asyncio.CancelledError):
                await self._scheduler
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)  # the running step completes
        closed = BackendUnavailable("the local backend is shutting down", code="backend_closed")
        engine.fail_active(closed)
        engine.fail_waiting(closed)
        engine.fail_ops(closed)
        self._adapters.clear()

    async def _schedule(self, engine: _Engine) -> None:
        loop = asyncio.get_running_loop()
        wait_s = self._settings.batch_wait_ms / 1000
        while True:
            # Jobs and ops are appended (and the event set) on this loop only, so check-clear-wait cannot miss one.
            if not engine.inbox and not engine.ops:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Let requests sent together share the first prefill instead of trickling in one by one
            # (an op alone has nothing to wait for).
            deadline = loop.time() + wait_s
            while (engine.inbox and engine.pending_sequences() < engine.max_batch_size
                   and (left := deadline - loop.time()) > 0):
                self._wakeup.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), left)
            await loop.run_in_executor(self._executor, engine.run)

    # -- adapters (AdapterHost) ------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter folder ``path`` under ``name``; a name already loaded is left as it is.

        Raises a 400 ``adapter_load_failed`` when the folder cannot be served (missing, not LoRA, made for
        another model, weights missing). Generation goes on meanwhile; the load happens between two steps.
        """
        engine = self._running_engine()
        if name in self._adapters:
            return
        pending = self._loading.get(name)
        if pending is None:
            pending = self._loading[name] = asyncio.create_task(self._load(engine, name, path), name=f"load {name}")
            pending.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved, even if unawaited
        try:
            await asyncio.shield(pending)
        except BackendError:
            raise
        except Exception as exc:
            reason = " ".join(str(exc).split())[:500]  # state-dict errors run to many lines
            raise _invalid(f"cannot load adapter {name!r} from {path}: {reason}", code="adapter_load_failed") from exc

    async def _load(self, engine: _Engine, name: str, path: str) -> None:
        """One load, as a task of its own: a caller cancelled meanwhile must not leave the adapter in the model
        but unknown here."""
        try:
            # Off the engine thread, which would otherwise stall every request: peft's first import takes over a
            # second, and checking the folder needs no model.
            config = await asyncio.to_thread(_lora_config, path)
            adapter = _Adapter(name, f"adapter_{next(self._serial):06d}", path)
            started = time.perf_counter()
            await self._on_engine(engine, lambda: engine.load_adapter(adapter.internal, path, config))
            if self._engine is engine:
                self._adapters[name] = adapter
                log.info("local.adapter_loaded", backend=self.name, adapter=name, path=path,
                         seconds=round(time.perf_counter() - started, 3))
        finally:
            self._loading.pop(name, None)

    async def unload_adapter(self, name: str) -> None:
        """Unload the adapter ``name``; a name not loaded is fine. Requests for it already accepted finish
        with it first: this returns once its weights are deleted. New requests for it fail at once."""
        pending = self._loading.get(name)
        if pending is not None:
            with suppress(Exception):
                await asyncio.shield(pending)
        adapter = self._adapters.pop(name, None)
        engine = self._engine
        if adapter is None or engine is None:
            return
        loop = asyncio.get_running_loop()
        deleted: asyncio.Future[None] = loop.create_future()

        def on_deleted() -> None:
            with suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, deleted, None, None)

        await asyncio.shield(self._on_engine(engine, lambda: engine.retire_adapter(adapter.internal, on_deleted)))
        await asyncio.shield(deleted)
        log.info("local.adapter_unloaded", backend=self.name, adapter=name)

    async def loaded_adapters(self) -> set[str]:
        """The names of the adapters loaded now (not those loading, nor those unloaded but still finishing)."""
        return set(self._adapters)

    def _running_engine(self) -> _Engine:
        if self._engine is None:
            raise BackendUnavailable("the local backend is not running", code="not_started")
        return self._engine

    def _on_engine(self, engine: _Engine, run: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``run`` on the engine thread between two steps; the future settles with its result."""
        if engine.closing:  # aclose fails the ops queued before it began; none may follow
            raise BackendUnavailable("the local backend is shutting down", code="backend_closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            with suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, future, result, error)

        engine.ops.append(_Op(run, settle))
        self._wakeup.set()
        return future

    def _adapter(self, name: str | None) -> _Adapter | None:
        if not name:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            raise AdapterNotLoaded(f"adapter {name!r} is not loaded on backend {self.name!r}", adapter=name)
        return adapter

    async def _prepare(self, request: ChatRequest) -> _Prepared:
        self._adapter(request.adapter)  # fail fast; _submit resolves it again after the awaits below
        body = request.body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _invalid("messages must be a non-empty list", "messages")
        params = SamplingParams.from_body(body)
        tools = _tools_for(body)
        try:
            prompt_ids = await asyncio.to_thread(encode_prompt, self.loaded.tokenizer, messages, tools)
        except Exception as exc:  # a template raising means the caller's messages are malformed
            raise _invalid(f"cannot render the messages: {exc}", "messages") from exc
        limit = self.loaded.context_length
        if len(prompt_ids) >= limit:
            raise _invalid(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit} tokens",
                           "messages", "context_length_exceeded")
        return _Prepared(prompt_ids, params, bool(tools), request.adapter)

    def _submit(self, prepared: _Prepared) -> _Job:
        engine = self._running_engine()
        # Resolved here, synchronously with the append below, so an unload that pops the name after this
        # point finds the job in the inbox and waits for it.
        adapter = self._adapter(prepared.adapter)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[_Event]] = asyncio.Queue()

        def emit(events: list[_Event]) -> None:
            with suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(queue.put_nowait, events)

        job = _Job(prepared.prompt_ids, prepared.params, emit, queue, adapter)
        engine.inbox.append(job)
        self._wakeup.set()
        return job

    async def chat(self, request: ChatRequest) -> ChatResult:
        prepared = await self._prepare(request)
        job = self._submit(prepared)
        n = prepared.params.n
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        try:
            async for event in _events(job):
                if isinstance(event, _Token):
                    ids[event.index].append(event.token_id)
                    logprobs[event.index].append(event.logprob)
                    texts[event.index].append(event.text)
                else:
                    reasons[event.index] = event.reason
        finally:
            job.cancelled = True  # stops the work if this task was cancelled; harmless when done
        choices = []
        for i in range(n):
            message, reason = _final_message("".join(texts[i]), reasons[i] or "stop", prepared.tools_enabled)
            choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": None})
        response = {
            "id": _completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": choices, "usage": _usage(prepared.prompt_ids, ids),
        }
        return ChatResult(response=response, extras=CallExtras(prepared.prompt_ids, ids, logprobs))

    async def stream(self, request: ChatRequest) -> LocalChunkStream:
        prepared = await self._prepare(request)
        return LocalChunkStream(self._submit(prepared), prepared, request.model)


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _events(job: _Job) -> AsyncIterator[_Token | _Finish]:
    """The job's tokens and finishes until every sequence has finished; failures are raised."""
    unfinished = job.params.n
    while unfinished:
        for event in await job.queue.get():
            if isinstance(event, _Failure):
                raise event.error
            if isinstance(event, _Cancelled):
                return
            if isinstance(event, _Finish):
                unfinished -= 1
            yield event


def _tools_for(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the prompt offers, after ``tool_choice``: none, all, or the one named."""
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise _invalid("tools must be a list", "tools")
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        named = [t for t in tools if (t.get("function") or {}).get("name") == name]
        if not named:
            raise _invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return named
    return tools


def _final_message(text: str, reason: str, tools_enabled: bool) -> tuple[dict[str, Any], str]:
    """The choice's message and finish reason. A generation cut off by the length limit keeps
    ``length`` even when it holds calls, so a client never executes a call that was truncated."""
    if not tools_enabled:
        return {"role": "assistant", "content": text}, reason
    parsed = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if not parsed.calls:
        return message, reason
    message["tool_calls"] = parsed.tool_calls
    return message, "tool_calls" if reason == "stop" else reason


def _completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def _usage(prompt_ids: list[int], completions: list[list[int]]) -> dict[str, int]:
    completion = sum(len(ids) for ids in completions)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


class LocalChunkStream:
    """OpenAI ``chat.completion.chunk`` dicts for one streamed request (see ``ChunkStream``)."""

    def __init__(self, job: _Job, prepared: _Prepared, model: str) -> None:
        n = prepared.params.n
        self.extras = CallExtras(prepared.prompt_ids, [[] for _ in range(n)], [[] for _ in range(n)])
        self._job = job
        self._prepared = prepared
        self._header = {"id": _completion_id(), "object": "chat.completion.chunk",
                        "created": int(time.time()), "model": model}
        self._chunks = self._generate()

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks

    async def aclose(self) -> None:
        self._job.cancelled = True
        self._job.queue.put_nowait([_Cancelled()])
        # Fails only while another task is inside the generator; the sentinel above ends that one.
        with suppress(RuntimeError):
            await self._chunks.aclose()

    def _chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**self._header, "choices": [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        n = self._prepared.params.n
        filters = [ToolCallStreamFilter() if self._prepared.tools_enabled else None for _ in range(n)]
        ids, logprobs = self.extras.completion_token_ids, self.extras.completion_logprobs
        assert ids is not None and logprobs is not None
        try:
            for i in range(n):
                yield self._chunk(i, {"role": "assistant", "content": ""})
            async for event in _events(self._job):
                i = event.index
                if isinstance(event, _Token):
                    ids[i].append(event.token_id)
                    logprobs[i].append(event.logprob)
                    text = filters[i].feed(event.text) if filters[i] else event.text
                    if text:
                        yield self._chunk(i, {"content": text})
                    continue
                reason = event.reason
                if filters[i] is not None:
                    tail, parsed = filters[i].finish()
                    if tail:
                        yield self._chunk(i, {"content": tail})
                    for k, call in enumerate(parsed.calls):
                        yield self._chunk(i, {"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                                              "function": {"name": call.name, "arguments": ""}}]})
                        yield self._chunk(i, {"tool_calls": [{"index": k,
                                                              "function": {"arguments": call.arguments}}]})
                    if parsed.calls and reason == "stop":
                        reason = "tool_calls"
                yield self._chunk(i, {}, reason)
            if self._job.cancelled:
                return
            yield {**self._header, "choices": [], "usage": _usage(self._prepared.prompt_ids, ids)}
        finally:
            self._job.cancelled = True
