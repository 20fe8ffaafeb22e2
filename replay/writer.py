"""The store's one writer: a queue, and a task that commits whatever has gathered as one transaction.

Callers await their operation's commit, so a response is only ever sent for an exchange that is already
durable. A batch is written by one function on one writer thread (a single hop off the event loop, however
many statements it holds). Message bodies are content-addressed: each is written once, whatever refers to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from replay import hashing
from replay.database import Database, StoreUnavailable
from replay.records import CallRecord, Statement, WriteOp, new_id, pack, split_choices
from replay.search_text import call_text
from replay.stitching import LRU

log = structlog.get_logger()


class StoreClosed(RuntimeError):
    pass


class RecordRejected(ValueError):
    """One write the store could not take (its rows could not be built or committed); the batch it came in with
    was committed without it."""


@dataclass
class _Rows:
    blobs: list[tuple[str, bytes, float]]
    trajectories: list[tuple[Any, ...]]
    calls: list[tuple[Any, ...]]
    tool_calls: list[tuple[Any, ...]]
    texts: list[tuple[str, str]]
    statements: list[Statement]

    @staticmethod
    def merged(parts: list[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        blobs = {blob[0]: blob for part in parts for blob in part.blobs}  # two writes may carry one body
        return _Rows(list(blobs.values()), *([row for part in parts for row in getattr(part, name)]
                                             for name in ("trajectories", "calls", "tool_calls", "texts",
                                                          "statements")))

    def steps(self) -> list[tuple[str, list[tuple[Any, ...]]]]:
        return [(_UPSERT_BLOB, self.blobs), (_UPSERT_TRAJECTORY, self.trajectories), (_INSERT_CALL, self.calls),
                (_INSERT_TOOL_CALL, self.tool_calls), (_INSERT_TEXT, self.texts)]  # type: ignore[list-item]


# A body already stored is only touched (``stored_at``), which tells the collector of unreferenced bodies that some
# writer still counts on it (see ``Writer.known_blobs``).
_UPSERT_BLOB = """
    INSERT INTO blobs(hash, body, stored_at) VALUES (?, ?, ?)
    ON CONFLICT(hash) DO UPDATE SET stored_at = excluded.stored_at"""

# Columns are named with their table: PostgreSQL reads a bare name beside ``excluded`` as ambiguous.
_UPSERT_TRAJECTORY = """
    INSERT INTO trajectories(id, source, tenant, key_id, session_key, requested_model, base_model, adapter, group_id,
        parent_id, status, head_hash, message_count, n_calls, next_seq, prompt_tokens, completion_tokens, latency_ms,
        created_at, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?)
    ON CONFLICT(id) DO UPDATE SET
        status = excluded.status,
        group_id = COALESCE(trajectories.group_id, excluded.group_id),
        head_hash = COALESCE(excluded.head_hash, trajectories.head_hash),
        message_count = CASE WHEN excluded.message_count > trajectories.message_count
                             THEN excluded.message_count ELSE trajectories.message_count END,
        n_calls = trajectories.n_calls + 1,
        next_seq = CASE WHEN excluded.next_seq > trajectories.next_seq
                        THEN excluded.next_seq ELSE trajectories.next_seq END,
        prompt_tokens = trajectories.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = trajectories.completion_tokens + excluded.completion_tokens,
        latency_ms = trajectories.latency_ms + excluded.latency_ms,
        updated_at = excluded.updated_at"""

_INSERT_CALL = """
    INSERT INTO model_calls(id, trajectory_id, seq, created_at, backend, model, adapter, stream, request_messages,
        tools_hash, params, response, response_messages, status, error, prompt_tokens, completion_tokens,
        latency_ms, ttft_ms, prompt_token_ids, completion_token_ids, completion_logprobs, completion_sampled_logprobs,
        native_api, native_bodies, cost_usd)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""

_INSERT_TOOL_CALL = """
    INSERT INTO tool_calls(id, trajectory_id, step, call_id, name, raw_arguments, parsed, repaired, valid,
        validation_error, status, result, duration_ms, created_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""

_INSERT_TEXT = "INSERT INTO trajectory_text(body, trajectory_id) VALUES (?, ?)"



def _reject(fut: asyncio.Future[None], exc: Exception, stage: str) -> None:
    log.error("store.record_rejected", error=str(exc), stage=stage)
    if not fut.done():
        fut.set_exception(RecordRejected(str(exc)))


class Writer:
    def __init__(self, *, db: Database, advance: Callable[[CallRecord, str | None], None], max_batch: int,
                 max_queue: int, commit_delay: float, on_commit: Callable[[int, float], None] | None,
                 known_blobs: int, trust_seconds: float) -> None:
        self.max_batch = max_batch
        self.commit_delay = commit_delay
        # Bodies this writer stored, and when: a miss costs one more row in the batch. Another process may collect
        # a body no committed call refers to, but never one stored (or touched) less than twice ``trust_seconds``
        # ago, so an entry is trusted that long and no longer.
        self.known_blobs = LRU(known_blobs)
        self.trust_seconds = trust_seconds
        self._queue: asyncio.Queue[tuple[WriteOp, asyncio.Future[None]]] = asyncio.Queue(max_queue)
        self._db = db
        self._lock = db.write_lock  # SQLite: one transaction at a time on the store (batches, deletes, changes)
        self._advance = advance  # stitching learns each call's new head as its row is built
        self._on_commit = on_commit  # callback(batch_size, seconds) for metrics
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="store-writer")

    async def stop(self) -> None:
        """Commit everything already accepted, then stop."""
        self._closing = True
        if self._task:
            await self._queue.join()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._thread.shutdown(wait=True)

    async def write(self, op: WriteOp) -> None:
        if self._closing or self._task is None:
            raise StoreClosed("the store is closed")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put((op, fut))
        await fut

    async def _loop(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            started = time.perf_counter()
            try:
                async with self._lock:
                    await self._commit_batch(batch)
            except Exception as exc:  # noqa: BLE001 - every waiter must hear of the failure
                log.error("store.commit_failed", error=str(exc), batch=len(batch))
                failure = StoreUnavailable(str(exc)) if self._db.whole_store(exc) else exc
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(failure)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if self._on_commit is not None:
                self._on_commit(len(batch), time.perf_counter() - started)

    async def _commit_batch(self, batch: list[tuple[WriteOp, asyncio.Future[None]]]) -> None:
        """Commit a batch as one transaction; a write that cannot be stored fails alone.

        Each write's rows are built apart (under the lock: a delete in between could collect blobs these rows
        rely on), so one whose rows cannot be built is refused before the transaction. If the transaction itself
        fails, each write is committed on its own, so the failure stays with the write that caused it and every
        other write in the batch is stored."""
        built: list[tuple[_Rows, list[str], asyncio.Future[None]]] = []
        for op, fut in batch:
            try:
                rows, new_blobs = self._rows(op)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this write's alone
                _reject(fut, exc, "rows")
                continue
            built.append((rows, new_blobs, fut))
        if not built:
            return
        run = asyncio.get_running_loop().run_in_executor
        try:
            await run(self._thread, self._commit, _Rows.merged([rows for rows, _, _ in built]))
        except Exception as exc:  # noqa: BLE001 - find the write to blame by committing each alone
            if self._db.whole_store(exc):
                raise
            for rows, new_blobs, fut in built:
                try:
                    await run(self._thread, self._commit, rows)
                except Exception as exc:  # noqa: BLE001
                    if self._db.whole_store(exc):
                        raise
                    _reject(fut, exc, "commit")
                else:
                    self._committed(new_blobs, fut)
            return
        for _, new_blobs, fut in built:
            self._committed(new_blobs, fut)

    def _committed(self, new_blobs: list[str], fut: asyncio.Future[None]) -> None:
        now = time.monotonic()
        for key in new_blobs:
            self.known_blobs.put(key, now)
        if not fut.done():
            fut.set_result(None)

    def _rows(self, op: WriteOp) -> tuple[_Rows, list[str]]:
        """The rows a write makes (built on the event loop, where the caches live), and its new blob keys."""
        blobs: dict[str, tuple[str, bytes, float]] = {}
        heads: list[tuple[CallRecord, str | None]] = []
        trajectories = []
        calls = []
        tool_calls = []
        texts = []
        now, trusted_since = time.time(), time.monotonic() - self.trust_seconds

        def put_blob(value: Any) -> str:
            body = hashing.exact_json(value)
            key = hashing.blob_hash(body)
            stored = self.known_blobs.get(key)
            if stored is None or stored < trusted_since:
                blobs[key] = (key, body, now)
            return key

        for rec in (one for call in op.records for one in split_choices(call)):
            request_keys = [put_blob(m) for m in rec.request_messages]
            tools_key = put_blob(rec.tools) if rec.tools else None
            response = rec.response
            response_keys: list[str] = []
            replies: list[Any] = []
            head = rec.request_prefix[-1] if rec.request_prefix else None
            if response is not None:
                choices = response.get("choices") or []
                replies = [c.get("message") for c in choices]
                response_keys = [put_blob(c.get("message") or {}) for c in choices]
                if choices and choices[0].get("message"):
                    head = hashing.chain(head or "", hashing.stitch_hash(choices[0]["message"]))
                # Bodies live in blobs; the response keeps everything else.
                response = {**response, "choices": [
                    {k: v for k, v in c.items() if k != "message"} for c in choices]}
            heads.append((rec, head))
            native = rec.native
            native_keys = ([put_blob(native["request"])] + ([put_blob(native["response"])]
                                                           if native.get("response") is not None else [])
                           if native else None)
            status = "completed" if rec.status == "ok" else rec.status
            ref = rec.trajectory
            message_count = len(rec.request_messages) + (1 if response_keys else 0)
            trajectories.append((
                ref.id, rec.source, rec.tenant, rec.key_id, ref.session_key, rec.requested_model,
                rec.base_model, rec.adapter, ref.group_id, ref.parent_id, status, head, message_count, ref.seq + 1,
                rec.prompt_tokens, rec.completion_tokens, rec.latency_ms, rec.created_at, rec.created_at,
            ))
            calls.append((
                new_id(), ref.id, ref.seq, rec.created_at, rec.backend, rec.base_model, rec.adapter,
                int(rec.stream), orjson.dumps(request_keys).decode(), tools_key,
                orjson.dumps(rec.params).decode(), orjson.dumps(response).decode() if response else None,
                orjson.dumps(response_keys).decode(), rec.status, rec.error, rec.prompt_tokens,
                rec.completion_tokens, rec.latency_ms, rec.ttft_ms, pack(rec.prompt_token_ids),
                pack(rec.completion_token_ids), pack(rec.completion_logprobs), pack(rec.completion_sampled_logprobs),
                native["api"] if native else None, orjson.dumps(native_keys).decode() if native_keys else None,
                rec.cost_usd,
            ))
            tool_calls.extend(
                (new_id(), ref.id, ref.seq, t["call_id"], t["name"], t["raw_arguments"], int(t["parsed"]),
                 int(t["repaired"]), int(t["valid"]), t["validation_error"], t["status"], t.get("result"),
                 t.get("duration_ms"), rec.created_at)
                for t in rec.tool_calls)
            text = call_text(ref.seq, rec.request_messages, replies)
            if text:
                texts.append((text, ref.id))
        # Stitching learns the new heads only once every row of the write is built: a write refused half-way
        # must not leave a head behind.
        for rec, head in heads:
            self._advance(rec, head)
        return _Rows(list(blobs.values()), trajectories, calls, tool_calls, texts, list(op.statements)), list(blobs)

    def _commit(self, rows: _Rows) -> None:
        """One transaction on the writer thread; all of it or none of it."""
        self._db.commit_steps(rows.steps(), rows.statements, self.commit_delay)
