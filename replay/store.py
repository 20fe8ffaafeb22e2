"""The trajectory store: SQLite, one writer task with group commit.

Every write goes through one queue to one writer task, which commits whatever has gathered as one
transaction (WAL; ``synchronous=NORMAL`` survives a process crash, ``FULL`` also a power loss). Callers
await their record's commit, so a response is only ever sent for an exchange that is already durable.

Connections, each for a reason: a batch is written by one function on one writer thread (a single hop
off the event loop, however many statements it holds); stitching's indexed point look-ups run on the
event loop itself (microseconds, less than a hop to another thread and back); everything else (listing,
showing, keys, deletes) goes through aiosqlite. WAL lets readers run beside the writer.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import aiosqlite
import orjson
import structlog
from ulid import ULID

from replay import hashing
from replay.schema import migrate

log = structlog.get_logger()

CAPTURE_STATUSES = ("ok", "error", "client_disconnected")


def new_id() -> str:
    """Sortable identifiers: time order is id order."""
    return str(ULID())


def _pack(value: Any) -> bytes | None:
    return None if value is None else zlib.compress(orjson.dumps(value), 1)


def unpack(value: bytes | None) -> Any:
    return None if value is None else orjson.loads(zlib.decompress(value))


class _LRU(OrderedDict):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


@dataclass
class TrajectoryRef:
    """Where a call belongs: decided before the call runs, so its id can go out in the response headers."""

    id: str
    seq: int
    is_new: bool
    session_key: str | None = None
    parent_id: str | None = None
    group_id: str | None = None


@dataclass
class CallRecord:
    """One backend call and the trajectory it extends."""

    trajectory: TrajectoryRef
    request_messages: list[dict[str, Any]]
    request_prefix: list[str]  # stitch hashes of the request's message prefixes
    status: str
    source: str = "proxy"
    tenant: str | None = None
    key_id: str | None = None
    requested_model: str | None = None
    base_model: str | None = None
    adapter: str | None = None
    backend: str | None = None
    tools: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] | None = None
    error: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[list[int]] | None = None
    completion_logprobs: list[list[float]] | None = None
    # Tool calls of this step: call_id, name, raw_arguments, parsed, repaired, valid, validation_error,
    # status, and where they ran, result and duration_ms.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)


def split_choices(rec: CallRecord) -> list[CallRecord]:
    """A call that sampled ``n > 1`` choices becomes a group: one trajectory per choice.

    The first choice continues the request's trajectory; every other choice starts a sibling that
    shares its history and a ``group_id``, so a client that continues any choice extends its own
    trajectory, and RL sees the samples of one request as one group.
    """
    choices = (rec.response or {}).get("choices") or []
    if len(choices) < 2:
        return [rec]
    ref = rec.trajectory
    group = ref.group_id or new_id()
    out = []
    for i, choice in enumerate(choices):
        if i == 0:
            sibling_ref = replace(ref, group_id=group)
        else:
            sibling_ref = TrajectoryRef(id=new_id(), seq=0, is_new=True, session_key=ref.session_key,
                                        parent_id=ref.parent_id if ref.is_new else ref.id, group_id=group)
        usage = rec.response.get("usage") if i == 0 else None  # type: ignore[union-attr]
        out.append(replace(
            rec, trajectory=sibling_ref,
            response={**rec.response, "choices": [choice], **({"usage": usage} if usage else {})},  # type: ignore[dict-item]
            completion_tokens=(len(rec.completion_token_ids[i]) if rec.completion_token_ids
                               else rec.completion_tokens if i == 0 else 0),
            completion_token_ids=_pick(rec.completion_token_ids, i),
            completion_logprobs=_pick(rec.completion_logprobs, i),
        ))
    return out


def _pick(per_choice: list[Any] | None, i: int) -> list[Any] | None:
    return [per_choice[i]] if per_choice is not None and i < len(per_choice) else None


@dataclass
class WriteOp:
    """What one caller commits at once: model calls, then plain statements (events, run state).

    Statements run after every call of their batch, so they may refer to the trajectories those calls create.
    """

    records: list[CallRecord] = field(default_factory=list)
    statements: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)


@dataclass
class _Rows:
    blobs: list[tuple[str, bytes]]
    trajectories: list[tuple[Any, ...]]
    calls: list[tuple[Any, ...]]
    tool_calls: list[tuple[Any, ...]]
    statements: list[tuple[str, tuple[Any, ...]]]


_UPSERT_TRAJECTORY = """
    INSERT INTO trajectories(id, source, tenant, key_id, session_key, requested_model, base_model, adapter, group_id,
        parent_id, status, head_hash, message_count, n_calls, prompt_tokens, completion_tokens, latency_ms,
        created_at, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?)
    ON CONFLICT(id) DO UPDATE SET
        status = excluded.status,
        group_id = COALESCE(group_id, excluded.group_id),
        head_hash = COALESCE(excluded.head_hash, head_hash),
        message_count = MAX(message_count, excluded.message_count),
        n_calls = n_calls + 1,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens,
        latency_ms = latency_ms + excluded.latency_ms,
        updated_at = excluded.updated_at"""

_INSERT_CALL = """
    INSERT INTO model_calls(id, trajectory_id, seq, created_at, backend, model, adapter, stream, request_messages,
        tools_hash, params, response, response_messages, status, error, prompt_tokens, completion_tokens,
        latency_ms, ttft_ms, prompt_token_ids, completion_token_ids, completion_logprobs)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""

_INSERT_TOOL_CALL = """
    INSERT INTO tool_calls(id, trajectory_id, step, call_id, name, raw_arguments, parsed, repaired, valid,
        validation_error, status, result, duration_ms, created_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""


class StoreClosed(RuntimeError):
    pass


class TrajectoryStore:
    def __init__(self, path: str, *, synchronous: str = "NORMAL", max_batch: int = 256,
                 max_queue: int = 100_000, commit_delay_ms: float = 0.0,
                 on_commit: Any = None) -> None:
        self.path = path
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.commit_delay = commit_delay_ms / 1000
        self._queue: asyncio.Queue[tuple[WriteOp, asyncio.Future[None]]] = asyncio.Queue(max_queue)
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._batch_conn: sqlite3.Connection | None = None  # used only on the writer thread
        self._lookup: sqlite3.Connection | None = None  # used only on the event loop
        self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._known_blobs = _LRU(200_000)
        # Stitching caches, refilled from the database on a miss: a head hash -> the trajectory that
        # had it (maybe no longer), a trajectory -> [its current head, next seq], a session -> newest trajectory.
        self._heads = _LRU(100_000)
        self._state = _LRU(100_000)
        self._sessions = _LRU(100_000)
        self._resolve_lock = asyncio.Lock()
        # One transaction at a time on the writer connection: batches, deletes and key changes.
        self._write_lock = asyncio.Lock()
        self._on_commit = on_commit  # callback(batch_size, seconds) for metrics

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        conn = sqlite3.connect(self.path)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            migrate(conn)
        finally:
            conn.close()
        self._writer = await self._connect()
        self._reader = await self._connect()
        self._batch_conn = self._connect_sync()
        self._lookup = self._connect_sync()
        self._task = asyncio.create_task(self._write_loop(), name="store-writer")

    async def _connect(self) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self.path)
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute(f"PRAGMA synchronous={self.synchronous}")
        await conn.execute("PRAGMA foreign_keys=ON")
        await conn.execute("PRAGMA busy_timeout=10000")
        conn.row_factory = aiosqlite.Row
        return conn

    def _connect_sync(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        for pragma in ("journal_mode=WAL", f"synchronous={self.synchronous}", "foreign_keys=ON",
                       "busy_timeout=10000"):
            conn.execute(f"PRAGMA {pragma}")
        return conn

    async def close(self) -> None:
        """Commit everything already accepted, then close."""
        self._closing = True
        if self._task:
            await self._queue.join()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for conn in (self._writer, self._reader):
            if conn is not None:
                await conn.close()
        for sync_conn in (self._batch_conn, self._lookup):
            if sync_conn is not None:
                sync_conn.close()
        self._write_thread.shutdown(wait=True)
        self._writer = self._reader = self._batch_conn = self._lookup = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- stitching ---------------------------------------------------------------------------------

    async def resolve(self, *, session_key: str | None, prefix: list[str], anchor: str,
                      tenant: str | None) -> TrajectoryRef:
        """Decide which trajectory a request extends, or start a new one (recording its parent).

        With a session key, the newest trajectory of that session is extended when the request's
        history starts with everything it holds; otherwise the request forks it. Without one, the
        trajectory whose conversation is the longest prefix of the request is extended if that prefix
        is still its whole conversation, and forked if it has moved on since (an edit or a retry); a
        request that shares only the opening (system prompt and first user message) forks it too.
        """
        async with self._resolve_lock:
            scope = f"{tenant or ''}\x00"
            if session_key is not None:
                tid = self._sessions.get(scope + session_key) or await self._session_from_db(session_key, tenant)
                if tid is not None:
                    state = await self._state_of(tid)
                    if state[0] in set(prefix):
                        return self._claim(tid, state)
                return self._new(scope, session_key, parent=tid)
            cached = {h: t for h in prefix if (t := self._heads.get(scope + h)) is not None}
            stored = await self._heads_from_db([h for h in prefix if h not in cached], tenant)
            for head in reversed(prefix):
                tid = cached.get(head) or stored.get(head)
                if tid is not None:
                    state = await self._state_of(tid)
                    if state[0] == head:
                        return self._claim(tid, state)
                    return self._new(scope, f"prefix:{anchor}", parent=tid)
            anchor_key = f"prefix:{anchor}"
            parent = self._sessions.get(scope + anchor_key) or await self._session_from_db(anchor_key, tenant)
            return self._new(scope, anchor_key, parent=parent)

    def _claim(self, tid: str, state: list[Any]) -> TrajectoryRef:
        # Reserve the sequence number now so concurrent calls on one trajectory never collide.
        seq = state[1]
        state[1] += 1
        return TrajectoryRef(id=tid, seq=seq, is_new=False)

    def _new(self, scope: str, session_key: str, parent: str | None) -> TrajectoryRef:
        tid = new_id()
        self._sessions.put(scope + session_key, tid)
        self._state.put(tid, [None, 1])
        return TrajectoryRef(id=tid, seq=0, is_new=True, session_key=session_key, parent_id=parent)

    async def _state_of(self, tid: str) -> list[Any]:
        """[current head hash, next call sequence number] of a trajectory."""
        state = self._state.get(tid)
        if state is None:
            row = self._point("SELECT head_hash, n_calls FROM trajectories WHERE id = ?", (tid,))
            state = [row[0], row[1]] if row else [None, 0]
            self._state.put(tid, state)
        return state

    def _point(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self._lookup is not None
        return self._lookup.execute(sql, args).fetchone()

    async def _session_from_db(self, session_key: str, tenant: str | None) -> str | None:
        row = self._point("SELECT id FROM trajectories WHERE session_key = ? AND tenant IS ? "
                          "ORDER BY updated_at DESC LIMIT 1", (session_key, tenant))
        return row[0] if row else None

    async def _heads_from_db(self, heads: list[str], tenant: str | None) -> dict[str, str]:
        """Which of ``heads`` some trajectory has now: head → the newest such trajectory."""
        assert self._lookup is not None
        found: dict[str, str] = {}
        for i in range(0, len(heads), 500):
            chunk = heads[i:i + 500]
            marks = ",".join("?" * len(chunk))
            for head, tid in self._lookup.execute(
                    f"SELECT head_hash, id FROM trajectories WHERE head_hash IN ({marks}) AND tenant IS ? "
                    "ORDER BY updated_at", (*chunk, tenant)):
                found[head] = tid
        return found

    def _advance(self, rec: CallRecord, head: str | None) -> None:
        """After a call, its conversation (request plus the first choice) is the trajectory's new head."""
        if head is None:
            return
        tid = rec.trajectory.id
        self._heads.put(f"{rec.tenant or ''}\x00" + head, tid)
        state = self._state.get(tid)
        if state is None:
            self._state.put(tid, [head, rec.trajectory.seq + 1])
        else:
            state[0] = head

    # -- writing -----------------------------------------------------------------------------------

    async def record(self, rec: CallRecord) -> None:
        """Queue a call for the next commit and wait until it is durable."""
        await self.write(WriteOp(records=[rec]))

    async def write(self, op: WriteOp) -> None:
        """Queue calls and statements to commit together, and wait until they are durable."""
        if self._closing or self._task is None:
            raise StoreClosed("the store is closed")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put((op, fut))
        await fut

    async def _write_loop(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            started = time.perf_counter()
            try:
                async with self._write_lock:
                    # Built under the lock: a delete in between could collect blobs these rows rely on.
                    rows, new_blobs = self._rows([op for op, _ in batch])
                    await asyncio.get_running_loop().run_in_executor(self._write_thread, self._commit_rows, rows)
                for key in new_blobs:
                    self._known_blobs.put(key, True)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)
            except Exception as exc:  # noqa: BLE001 - every waiter must hear of the failure
                log.error("store.commit_failed", error=str(exc), batch=len(batch))
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if self._on_commit is not None:
                self._on_commit(len(batch), time.perf_counter() - started)

    def _rows(self, batch: list[WriteOp]) -> tuple[_Rows, list[str]]:
        """The rows a batch writes (built on the event loop, where the caches live), and its new blob keys."""
        blobs: dict[str, bytes] = {}
        trajectories = []
        calls = []
        tool_calls = []

        def put_blob(value: Any) -> str:
            body = hashing.exact_json(value)
            key = hashing.blob_hash(body)
            if key not in self._known_blobs:
                blobs[key] = body
            return key

        for rec in (one for op in batch for call in op.records for one in split_choices(call)):
            request_keys = [put_blob(m) for m in rec.request_messages]
            tools_key = put_blob(rec.tools) if rec.tools else None
            response = rec.response
            response_keys: list[str] = []
            head = rec.request_prefix[-1] if rec.request_prefix else None
            if response is not None:
                choices = response.get("choices") or []
                response_keys = [put_blob(c.get("message") or {}) for c in choices]
                if choices and choices[0].get("message"):
                    head = hashing.chain(head or "", hashing.stitch_hash(choices[0]["message"]))
                # Bodies live in blobs; the response keeps everything else.
                response = {**response, "choices": [
                    {k: v for k, v in c.items() if k != "message"} for c in choices]}
            self._advance(rec, head)
            status = "completed" if rec.status == "ok" else rec.status
            ref = rec.trajectory
            message_count = len(rec.request_messages) + (1 if response_keys else 0)
            trajectories.append((
                ref.id, rec.source, rec.tenant, rec.key_id, ref.session_key, rec.requested_model,
                rec.base_model, rec.adapter, ref.group_id, ref.parent_id, status, head, message_count,
                rec.prompt_tokens, rec.completion_tokens, rec.latency_ms, rec.created_at, rec.created_at,
            ))
            calls.append((
                new_id(), ref.id, ref.seq, rec.created_at, rec.backend, rec.base_model, rec.adapter,
                int(rec.stream), orjson.dumps(request_keys).decode(), tools_key,
                orjson.dumps(rec.params).decode(), orjson.dumps(response).decode() if response else None,
                orjson.dumps(response_keys).decode(), rec.status, rec.error, rec.prompt_tokens,
                rec.completion_tokens, rec.latency_ms, rec.ttft_ms, _pack(rec.prompt_token_ids),
                _pack(rec.completion_token_ids), _pack(rec.completion_logprobs),
            ))
            tool_calls.extend(
                (new_id(), ref.id, ref.seq, t["call_id"], t["name"], t["raw_arguments"], int(t["parsed"]),
                 int(t["repaired"]), int(t["valid"]), t["validation_error"], t["status"], t.get("result"),
                 t.get("duration_ms"), rec.created_at)
                for t in rec.tool_calls)
        statements = [st for op in batch for st in op.statements]
        return _Rows(list(blobs.items()), trajectories, calls, tool_calls, statements), list(blobs)

    def _commit_rows(self, rows: _Rows) -> None:
        """One transaction on the writer thread; all of it or none of it."""
        db = self._batch_conn
        assert db is not None
        db.execute("BEGIN")
        try:
            if rows.blobs:
                db.executemany("INSERT OR IGNORE INTO blobs(hash, body) VALUES (?, ?)", rows.blobs)
            db.executemany(_UPSERT_TRAJECTORY, rows.trajectories)
            db.executemany(_INSERT_CALL, rows.calls)
            if rows.tool_calls:
                db.executemany(_INSERT_TOOL_CALL, rows.tool_calls)
            for sql, args in rows.statements:
                db.execute(sql, args)
            if self.commit_delay:
                time.sleep(self.commit_delay)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    # -- reading -----------------------------------------------------------------------------------

    async def list_trajectories(self, *, tenant: str | None = None, all_tenants: bool = False,
                                limit: int = 50, before: str | None = None) -> list[dict[str, Any]]:
        assert self._reader is not None
        where, args = [], []
        if not all_tenants:
            where.append("tenant IS ?")
            args.append(tenant)
        if before:
            where.append("id < ?")
            args.append(before)
        sql = "SELECT * FROM trajectories" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY id DESC LIMIT ?"
        async with self._reader.execute(sql, (*args, limit)) as cur:
            return [_trajectory_row(r) for r in await cur.fetchall()]

    async def get_trajectory(self, trajectory_id: str, *, tenant: str | None = None,
                             all_tenants: bool = False) -> dict[str, Any] | None:
        """A trajectory with its calls, message bodies resolved from the blob table."""
        assert self._reader is not None
        async with self._reader.execute("SELECT * FROM trajectories WHERE id = ?", (trajectory_id,)) as cur:
            row = await cur.fetchone()
        if row is None or (not all_tenants and row["tenant"] != tenant):
            return None
        out = _trajectory_row(row)
        async with self._reader.execute(
                "SELECT * FROM model_calls WHERE trajectory_id = ? ORDER BY seq, created_at",
                (trajectory_id,)) as cur:
            call_rows = await cur.fetchall()
        keys: set[str] = set()
        for c in call_rows:
            keys.update(orjson.loads(c["request_messages"]))
            keys.update(orjson.loads(c["response_messages"] or "[]"))
            if c["tools_hash"]:
                keys.add(c["tools_hash"])
        bodies = await self._blobs(keys)
        calls = []
        for c in call_rows:
            response = orjson.loads(c["response"]) if c["response"] else None
            response_keys = orjson.loads(c["response_messages"] or "[]")
            if response is not None:
                for choice, key in zip(response.get("choices", []), response_keys, strict=False):
                    choice["message"] = bodies.get(key)
            calls.append({
                "id": c["id"], "seq": c["seq"], "created_at": c["created_at"], "backend": c["backend"],
                "model": c["model"], "adapter": c["adapter"], "stream": bool(c["stream"]),
                "status": c["status"], "error": c["error"],
                "request": {"messages": [bodies.get(k) for k in orjson.loads(c["request_messages"])],
                            "tools": bodies.get(c["tools_hash"]) if c["tools_hash"] else None,
                            **orjson.loads(c["params"] or "{}")},
                "response": response,
                "prompt_tokens": c["prompt_tokens"], "completion_tokens": c["completion_tokens"],
                "latency_ms": c["latency_ms"], "ttft_ms": c["ttft_ms"],
                "prompt_token_ids": unpack(c["prompt_token_ids"]),
                "completion_token_ids": unpack(c["completion_token_ids"]),
                "completion_logprobs": unpack(c["completion_logprobs"]),
            })
        out["calls"] = calls
        return out

    async def _blobs(self, keys: Iterable[str]) -> dict[str, Any]:
        assert self._reader is not None
        keys = list(keys)
        out: dict[str, Any] = {}
        for i in range(0, len(keys), 500):
            chunk = keys[i:i + 500]
            marks = ",".join("?" * len(chunk))
            async with self._reader.execute(f"SELECT hash, body FROM blobs WHERE hash IN ({marks})", chunk) as cur:
                for h, body in await cur.fetchall():
                    out[h] = orjson.loads(body)
        return out

    async def delete(self, *, ids: list[str] | None = None, before: float | None = None) -> int:
        """Delete trajectories by id or age, then the bodies no remaining call refers to."""
        # Shielded like ``transaction``: cancelling it half-way would leave the writer's transaction open.
        return await asyncio.shield(self._locked_delete(ids, before))

    async def _locked_delete(self, ids: list[str] | None, before: float | None) -> int:
        async with self._write_lock:
            return await self._delete(ids, before)

    async def _delete(self, ids: list[str] | None, before: float | None) -> int:
        assert self._writer is not None
        db = self._writer
        if ids is not None:
            marks = ",".join("?" * len(ids))
            cur = await db.execute(f"DELETE FROM trajectories WHERE id IN ({marks})", ids)
        elif before is not None:
            cur = await db.execute("DELETE FROM trajectories WHERE created_at < ?", (before,))
        else:
            raise ValueError("delete needs ids or before")
        count = cur.rowcount
        if count:
            await db.execute(
                """DELETE FROM blobs WHERE hash NOT IN (
                       SELECT j.value FROM model_calls, json_each(model_calls.request_messages) AS j
                       UNION SELECT j.value FROM model_calls, json_each(model_calls.response_messages) AS j
                       UNION SELECT tools_hash FROM model_calls WHERE tools_hash IS NOT NULL)""")
        await db.commit()
        if count:
            # Caches may name what is gone; they refill from the database on demand.
            self._known_blobs.clear()
            self._heads.clear()
            self._state.clear()
            self._sessions.clear()
        return count

    # -- Responses API objects ----------------------------------------------------------------------

    @staticmethod
    def response_statement(response: dict[str, Any], *, trajectory_id: str | None, tenant: str | None,
                           messages: list[dict[str, Any]]) -> tuple[str, tuple[Any, ...]]:
        """The statement keeping a response (and the chat history it ends) with its exchange's commit."""
        return ("INSERT OR REPLACE INTO responses(id, trajectory_id, tenant, body, messages, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (response["id"], trajectory_id, tenant, orjson.dumps(response).decode(),
                 orjson.dumps(messages).decode(), time.time()))

    async def get_response(self, response_id: str, *, tenant: str | None,
                           all_tenants: bool = False) -> dict[str, Any] | None:
        """``{"body": the response object, "messages": the chat history it ends}``, or None."""
        assert self._reader is not None
        async with self._reader.execute("SELECT tenant, body, messages FROM responses WHERE id = ?",
                                        (response_id,)) as cur:
            row = await cur.fetchone()
        if row is None or (not all_tenants and row["tenant"] != tenant):
            return None
        return {"body": orjson.loads(row["body"]), "messages": orjson.loads(row["messages"])}

    # -- feedback and rewards ---------------------------------------------------------------------

    @staticmethod
    def feedback_statement(trajectory_id: str, *, source: str, name: str, value: float | None = None,
                           label: str | None = None, comment: str | None = None,
                           model_call_seq: int | None = None,
                           created_at: float | None = None) -> tuple[str, tuple[Any, ...]]:
        """The statement adding one feedback row (a reward or a label) to a ``WriteOp``.

        It inserts nothing when the trajectory is gone, so a concurrent delete never fails the batch
        it commits with.
        """
        return ("INSERT INTO feedback(id, trajectory_id, model_call_seq, source, name, value, label, comment, "
                "created_at) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM trajectories WHERE id = ?)",
                (new_id(), trajectory_id, model_call_seq, source, name, value, label, comment,
                 time.time() if created_at is None else created_at, trajectory_id))

    @staticmethod
    def replace_feedback_statements(trajectory_id: str, source: str, rows: list[dict[str, Any]],
                                    final_reward: float | None = None, *,
                                    set_final_reward: bool = False) -> list[tuple[str, tuple[Any, ...]]]:
        """Statements replacing every row of ``source`` for a trajectory (recomputing is idempotent) and,
        with ``set_final_reward``, its ``final_reward``. Each row: name, value, label, comment, model_call_seq."""
        now = time.time()
        out: list[tuple[str, tuple[Any, ...]]] = [
            ("DELETE FROM feedback WHERE trajectory_id = ? AND source = ?", (trajectory_id, source))]
        out.extend(TrajectoryStore.feedback_statement(
            trajectory_id, source=source, name=r["name"], value=r.get("value"), label=r.get("label"),
            comment=r.get("comment"), model_call_seq=r.get("model_call_seq"), created_at=now) for r in rows)
        if set_final_reward:
            # updated_at is left alone: stitching orders a session's trajectories by it.
            out.append(("UPDATE trajectories SET final_reward = ? WHERE id = ?", (final_reward, trajectory_id)))
        return out

    async def add_feedback(self, trajectory_id: str, *, source: str, name: str, value: float | None = None,
                           label: str | None = None, comment: str | None = None,
                           model_call_seq: int | None = None) -> None:
        """Record one feedback row (a user's thumbs, a verifier's verdict, ...) through the writer."""
        await self.write(WriteOp(statements=[self.feedback_statement(
            trajectory_id, source=source, name=name, value=value, label=label, comment=comment,
            model_call_seq=model_call_seq)]))

    async def feedback_rows(self, trajectory_id: str, *, source: str | None = None) -> list[dict[str, Any]]:
        """A trajectory's feedback rows, oldest first (then by id, so the order is stable)."""
        assert self._reader is not None
        sql = "SELECT * FROM feedback WHERE trajectory_id = ?"
        args: list[Any] = [trajectory_id]
        if source is not None:
            sql += " AND source = ?"
            args.append(source)
        async with self._reader.execute(sql + " ORDER BY created_at, id", args) as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def tool_call_rows(self, trajectory_id: str) -> list[dict[str, Any]]:
        """A trajectory's tool calls in the order they were made (``step`` is the model call's seq)."""
        assert self._reader is not None
        async with self._reader.execute(
                "SELECT * FROM tool_calls WHERE trajectory_id = ? ORDER BY step, created_at, rowid",
                (trajectory_id,)) as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def select_ids(self, filters: Any) -> list[str]:
        """Ids of the trajectories a ``replay.filters.Filters`` selects, oldest first."""
        assert self._reader is not None
        where, args = filters.where("t")
        async with self._reader.execute(f"SELECT t.id FROM trajectories t WHERE {where} ORDER BY t.id", args) as cur:
            return [r[0] for r in await cur.fetchall()]

    # -- agent runs -------------------------------------------------------------------------------

    async def agent_run(self, run_id: str) -> dict[str, Any] | None:
        assert self._reader is not None
        async with self._reader.execute(
                "SELECT r.*, t.tenant, t.key_id, t.source FROM agent_runs r JOIN trajectories t ON t.id = r.id "
                "WHERE r.id = ?",
                (run_id,)) as cur:
            row = await cur.fetchone()
        return dict(row) if row else None

    async def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        """Rows of a read-only statement, as dicts: for modules that own tables of their own."""
        assert self._reader is not None
        async with self._reader.execute(sql, args) as cur:
            return [dict(row) for row in await cur.fetchall()]

    async def execute(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        """One statement in a transaction of its own, committed before this returns; the rows it changed."""
        return (await self.transaction([(sql, args)]))[0]

    async def execute_returning(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        """Like ``execute``, for a statement with a ``RETURNING`` clause: the rows it returned."""
        return (await asyncio.shield(self._transaction([(sql, args)], returning=True)))[0]

    async def transaction(self, statements: list[tuple[str, tuple[Any, ...]]]) -> list[int]:
        """Statements committed together on the writer connection; the rows each changed. Shielded: a caller
        cancelled half-way must not leave a transaction open, which would lock every later write out."""
        return await asyncio.shield(self._transaction(statements))

    async def _transaction(self, statements: list[tuple[str, tuple[Any, ...]]], *,
                           returning: bool = False) -> list[Any]:
        """Each statement's row count, or with ``returning`` the rows it returned."""
        assert self._writer is not None
        out: list[Any] = []
        async with self._write_lock:
            try:
                for sql, args in statements:
                    cur = await self._writer.execute(sql, args)
                    out.append([dict(row) for row in await cur.fetchall()] if returning else cur.rowcount)
                await self._writer.commit()
            except BaseException:
                await self._writer.rollback()
                raise
        return out

    async def mark_runs(self, *, from_status: str, to_status: str, at: float) -> int:
        counts = await self.transaction([
            ("UPDATE agent_runs SET status = ?, updated_at = ? WHERE status = ?", (to_status, at, from_status)),
            ("UPDATE trajectories SET status = ?, updated_at = ? WHERE status = ? AND id IN "
             "(SELECT id FROM agent_runs)", (to_status, at, from_status))])
        return counts[0]

    # -- API keys ----------------------------------------------------------------------------------

    async def create_key(self, *, tenant: str, name: str | None, capture: bool, secret_hash: str,
                         default_model: str | None = None, allow_model_override: bool = False) -> str:
        key_id, now = new_id(), time.time()
        # In one commit with the key: from now on this store never serves an open gateway.
        await self.transaction([
            ("INSERT INTO api_keys(id, hash, tenant, name, capture, created_at, default_model, "
             "allow_model_override) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
             (key_id, secret_hash, tenant, name, int(capture), now, default_model, int(allow_model_override))),
            ("INSERT OR IGNORE INTO store_facts(name, value, set_at) VALUES ('keys_created', '1', ?)", (now,))])
        return key_id

    async def list_keys(self) -> list[dict[str, Any]]:
        assert self._reader is not None
        async with self._reader.execute(
                "SELECT id, tenant, name, capture, default_model, allow_model_override, created_at, revoked_at "
                "FROM api_keys ORDER BY id") as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def claim_nonce(self, nonce: str, *, now: float, keep_seconds: float) -> bool:
        """Record a signed request's nonce; False when it was seen within ``keep_seconds`` (a replay). Older nonces
        are forgotten: their timestamps are outside any window a signature is accepted in."""
        counts = await self.transaction([("DELETE FROM bot_nonces WHERE seen_at < ?", (now - keep_seconds,)),
                                         ("INSERT OR IGNORE INTO bot_nonces(nonce, seen_at) VALUES (?, ?)",
                                          (nonce, now))])
        return counts[1] == 1

    async def revoke_key(self, key_id: str) -> bool:
        return await self.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                  (time.time(), key_id)) > 0

    async def find_key(self, secret_hash: str) -> dict[str, Any] | None:
        assert self._reader is not None
        async with self._reader.execute(
                "SELECT id, tenant, name, capture, default_model, allow_model_override FROM api_keys "
                "WHERE hash = ? AND revoked_at IS NULL",
                (secret_hash,)) as cur:
            row = await cur.fetchone()
        return dict(row) if row else None

    async def keys_ever_created(self) -> bool:
        """Whether an API key was ever created in this store (revoked ones count: the fact is never undone)."""
        assert self._reader is not None
        async with self._reader.execute("SELECT 1 FROM store_facts WHERE name = 'keys_created'") as cur:
            return await cur.fetchone() is not None


def _trajectory_row(row: aiosqlite.Row) -> dict[str, Any]:
    out = dict(row)
    out.pop("head_hash", None)
    out["metadata"] = orjson.loads(out["metadata"]) if out.get("metadata") else None
    return out
