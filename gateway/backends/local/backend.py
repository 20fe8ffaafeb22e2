"""The embedded model as a ``Backend``: transformers on CPU with dynamic (continuous) batching.

This is the asyncio side; the batching itself is ``engine.py``'s, on the engine's worker thread. Requests
become jobs in the engine's inbox. A scheduler task on the event loop waits for the first job, gathers more for
up to ``batch_wait_ms`` (or until ``max_batch_size`` sequences wait), then runs the engine on its thread until
no work is left; jobs that arrive meanwhile join the running batch. Events travel back to each request's
asyncio queue, and operations' results to their futures, through ``loop.call_soon_threadsafe``.

Adapter loads and unloads are engine operations, run between two steps; the scheduler runs the engine for them
when it is idle.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace
from typing import Any

import structlog
import torch

from gateway.backends.base import (
    AdapterNotLoaded,
    BackendError,
    BackendUnavailable,
    CallExtras,
    ChatRequest,
    ChatResult,
)
from gateway.backends.local.adapters import Adapter, lora_config, read_rendering
from gateway.backends.local.engine import Engine
from gateway.backends.local.grammar import answer_schema, compile_grammar
from gateway.backends.local.jobs import Job, JobEvent, Token
from gateway.backends.local.loading import LoadedModel, ModelLoadError, load_model
from gateway.backends.local.prefix_cache import PrefixCache, PrefixStats
from gateway.backends.local.replies import (
    Events,
    LocalChunkStream,
    Prepared,
    TextCompletionStream,
    completion_id,
    events,
    final_message,
    logprobs_of,
    usage,
)
from gateway.backends.local.request import check_completion_parameters, check_parameters, tools_for
from gateway.backends.local.sampling import SamplingParams, invalid_request
from gateway.config import LOCAL_MAX_OUTPUT_TOKENS, BackendSettings
from gateway.prompting import encode_prompt
from gateway.protocol.completions import text_completion

log = structlog.get_logger()


class LocalBackend:
    """The embedded transformers model, batching concurrent requests into shared forward passes.

    Serves LoRA adapters (``AdapterHost``): ``ChatRequest.adapter`` names one loaded with ``load_adapter``.
    """

    def __init__(self, settings: BackendSettings) -> None:
        self.name = settings.name
        self.models = list(settings.models)
        self.apis = frozenset(settings.apis or ())
        self._settings = settings
        self._loaded: LoadedModel | None = None
        self._engine: Engine | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        # Changed on the event loop only; the engine learns of changes through its ops.
        self._adapters: dict[str, Adapter] = {}
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._serial = itertools.count(1)

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise BackendUnavailable("the local model is not loaded", code="not_started")
        return self._loaded

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        """Tokens of ``messages`` (and the chat ``tools`` offered with them) as this model is prompted with them:
        the agent's context budget, and the Messages API's token count."""
        rendering = self._settings.tool_rendering
        return len(encode_prompt(self.loaded.tokenizer, messages, tools or None, rendering=rendering))

    @property
    def forward_passes(self) -> int:
        return self._engine.forward_passes if self._engine else 0

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters (a live object; its ints are read whole), or None when it is off."""
        engine = self._engine
        return engine.prefix.stats if engine is not None and engine.prefix is not None else None

    async def start(self) -> None:
        if self._settings.threads:
            torch.set_num_threads(self._settings.threads)
        try:
            self._loaded = await asyncio.to_thread(load_model, self._settings.model_path, self._settings.cache_dir)
        except ModelLoadError as exc:
            raise BackendUnavailable(str(exc), code="model_load_failed") from exc
        budget = self._settings.prefix_cache_mb * 2**20
        self._engine = Engine(self._loaded, self._settings.max_batch_size, PrefixCache(budget) if budget else None,
                              map_large=self._settings.map_large_allocations,
                              batch_cache_bytes=self._settings.batch_cache_mb * 2**20,
                              merge_lone_adapter=self._settings.merge_lone_adapter)
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

    async def _schedule(self, engine: Engine) -> None:
        loop = asyncio.get_running_loop()
        wait_s = self._settings.batch_wait_ms / 1000
        while True:
            # Jobs and ops are appended (and the event set) on this loop only, so check-clear-wait cannot miss one.
            if not engine.waiting():
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
            raise invalid_request(f"cannot load adapter {name!r} from {path}: {reason}",
                                  code="adapter_load_failed") from exc

    async def _load(self, engine: Engine, name: str, path: str) -> None:
        """One load, as a task of its own: a caller cancelled meanwhile must not leave the adapter in the model
        but unknown here."""
        try:
            # Off the engine thread, which would otherwise stall every request: peft's first import takes over a
            # second, and checking the folder needs no model.
            config, rendering = await asyncio.to_thread(lambda: (lora_config(path), read_rendering(path)))
            adapter = Adapter(name, f"adapter_{next(self._serial):06d}", path, rendering)
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

    def _running_engine(self) -> Engine:
        if self._engine is None:
            raise BackendUnavailable("the local backend is not running", code="not_started")
        return self._engine

    def _on_engine(self, engine: Engine, run: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``run`` on the engine thread between two steps; the future settles with its result."""
        if engine.closing:  # aclose fails the ops queued before it began; none may follow
            raise BackendUnavailable("the local backend is shutting down", code="backend_closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            with suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, future, result, error)

        engine.call(run, settle)
        self._wakeup.set()
        return future

    def _adapter(self, name: str | None) -> Adapter | None:
        if not name:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            raise AdapterNotLoaded(f"adapter {name!r} is not loaded on backend {self.name!r}", adapter=name)
        return adapter

    async def _prepare(self, request: ChatRequest) -> Prepared:
        adapter = self._adapter(request.adapter)  # fail fast; _submit resolves it again after the awaits below
        rendering = (adapter.rendering if adapter is not None else None) or self._settings.tool_rendering
        engine = self._running_engine()
        body = request.body
        check_parameters(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid_request("messages must be a non-empty list", "messages")
        params = SamplingParams.from_body(body)
        tools, calls = tools_for(body)
        parallel = body.get("parallel_tool_calls") is not False
        answer = answer_schema(body.get("response_format"))

        def render() -> list[int]:
            if params.logprobs:
                engine.grammar_tokenizer  # noqa: B018 - built here, off the event loop and the engine thread
            try:
                return encode_prompt(self.loaded.tokenizer, messages, tools, rendering=rendering)
            except Exception as exc:  # a template raising means the caller's messages are malformed
                raise invalid_request(f"cannot render the messages: {exc}", "messages") from exc

        # Built before the job reaches the engine, within a bound: its step never waits for a grammar's lexer.
        grammar = await compile_grammar(lambda: engine.grammar_tokenizer, params.n, answer=answer, tools=tools,
                                        calls=calls, parallel=parallel)
        prompt_ids = await asyncio.to_thread(render)
        limit = self.loaded.context_length
        if len(prompt_ids) >= limit:
            raise invalid_request(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit} tokens",
                                  "messages", "context_length_exceeded")
        if request.max_tokens_ceiling:
            ceiling = self._settings.max_output_tokens or LOCAL_MAX_OUTPUT_TOKENS
            params = replace(params, max_tokens=min(params.max_tokens, ceiling, limit - len(prompt_ids)))
        else:
            _check_room(body, params.max_tokens, len(prompt_ids), limit)
        params = replace(params, grammar=grammar, tool_stop=("last" if parallel else "first") if tools else None)
        return Prepared(prompt_ids, params, bool(tools), request.adapter,
                         engine.grammar_tokenizer if params.logprobs else None)

    def _submit(self, prepared: Prepared, tenant: str | None) -> tuple[Job, Events]:
        engine = self._running_engine()
        # Resolved here, synchronously with the append below, so an unload that pops the name after this
        # point finds the job in the inbox and waits for it.
        adapter = self._adapter(prepared.adapter)
        loop = asyncio.get_running_loop()
        queue: Events = asyncio.Queue()

        def deliver(events: list[JobEvent]) -> None:
            with suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(queue.put_nowait, events)

        job = Job(prepared.prompt_ids, prepared.params, deliver, adapter, tenant)
        engine.submit(job)
        self._wakeup.set()
        return job, queue

    async def _prepare_text(self, request: ChatRequest) -> Prepared:
        """A ``/v1/completions`` request: its prompt as it is, no chat template, and the sampling it asks for."""
        self._adapter(request.adapter)  # fail fast, as for chat
        body = request.body
        prompt = check_completion_parameters(body)
        params = SamplingParams.from_body(body)
        tokenizer = self.loaded.tokenizer
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt)
        elif any(t >= len(tokenizer) for t in prompt):
            raise invalid_request(f"the prompt holds a token id past this model's vocabulary of {len(tokenizer)}",
                                  "prompt")
        else:
            prompt_ids = list(prompt)
        limit = self.loaded.context_length
        if not prompt_ids:
            raise invalid_request("the prompt is empty: there is nothing to complete", "prompt")
        if len(prompt_ids) >= limit:
            raise invalid_request(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit} tokens",
                                  "prompt", "context_length_exceeded")
        _check_room(body, params.max_tokens, len(prompt_ids), limit)
        return Prepared(prompt_ids, params, False, request.adapter)

    async def chat(self, request: ChatRequest) -> ChatResult:
        return await self._generate(await self._prepare(request), request)

    async def completions(self, request: ChatRequest) -> ChatResult:
        """A raw prompt completed: the chat path's generation, its answer written as a ``text_completion``."""
        result = await self._generate(await self._prepare_text(request), request)
        return ChatResult(response=text_completion(result.response), extras=result.extras)

    async def stream_completions(self, request: ChatRequest) -> TextCompletionStream:
        prepared = await self._prepare_text(request)
        return TextCompletionStream(LocalChunkStream(*self._submit(prepared, request.tenant), prepared, request.model))

    async def _generate(self, prepared: Prepared, request: ChatRequest) -> ChatResult:
        job, queue = self._submit(prepared, request.tenant)
        n = prepared.params.n
        tokens: list[list[Token]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        try:
            async for event in events(job, queue):
                if isinstance(event, Token):
                    tokens[event.index].append(event)
                else:
                    reasons[event.index] = event.reason
        finally:
            job.cancelled = True  # stops the work if this task was cancelled; harmless when done
        choices = []
        for i in range(n):
            message, reason = final_message("".join(t.text for t in tokens[i]), reasons[i] or "stop",
                                             prepared.tools_enabled)
            choices.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": logprobs_of(prepared.token_bytes, tokens[i])})
        ids = [[t.token_id for t in seq] for seq in tokens]
        response = {
            "id": completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": choices, "usage": usage(prepared.prompt_ids, ids),
        }
        return ChatResult(response=response, extras=CallExtras(
            prepared.prompt_ids, ids, [[t.logprob for t in seq] for seq in tokens],
            [[t.sampled_logprob for t in seq] for seq in tokens]))

    async def stream(self, request: ChatRequest) -> LocalChunkStream:
        prepared = await self._prepare(request)
        return LocalChunkStream(*self._submit(prepared, request.tenant), prepared, request.model)


def _check_room(body: dict[str, Any], max_tokens: int, prompt: int, context: int) -> None:
    """A completion limit the context cannot hold is refused, as OpenAI refuses it, rather than generating until
    the context is full: that could keep the engine busy for minutes on a request nobody can use."""
    named = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(named) is not None and prompt + max_tokens > context:
        raise invalid_request(f"{named} is too large: {max_tokens}. The prompt has {prompt} tokens and this model's "
                              f"context is {context} tokens, which leaves at most {context - prompt} to complete.",
                              named, "context_length_exceeded")


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


