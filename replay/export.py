"""Exporting trajectories as training rows: chat JSONL, a Hugging Face ``datasets`` dataset, or the files TRL's and
verl's trainers read (``export_trainers.py``).

A row is a context AS ACTUALLY SENT: one model call's request messages plus the reply it got (its first
choice), with the tool specs of that call. The agent loop's summaries are therefore already in the rows
that followed them, no model is called during an export, and because the gateway and the agent loop
never split an assistant message with ``tool_calls`` from its ``tool`` results, no row does either (the
only unanswered tool calls a row may hold are in its last message, the reply itself).

- Default: one row per model call.
- ``window=N``: one row per run of up to N consecutive calls of a trajectory, the row being the last
  call's request and reply. A run only continues while each call's request extends the previous call's
  context (its request plus reply); where it does not (a summary rewrote the history, a client edited
  it), the run ends there, so every reply the window covers is in its row. ``window=0``: unbounded.
- Calls whose status is not ``ok`` (upstream errors, client disconnects) are skipped unless
  ``include_failed``.

Streaming: one read transaction (a consistent snapshot) holds a cursor over the selected trajectories in
id order (or group order), fetched in chunks; each chunk's calls are read with one query and their
message bodies with one more, and rows are written as they are made. Memory depends on the chunk, never
on the store. (A long export keeps its snapshot, so a live gateway's WAL cannot be reset until it ends.)

Rows carry exact token ids (``prompt_token_ids``, and ``completion_token_ids`` of the first choice) when
they were captured and redaction changed nothing in the row; a row redaction changed carries none
(``redacted: true``): its text no longer matches them, and the consumer re-tokenizes it with the shared
prompt renderer. JSONL rows hold ``messages``, ``tools`` and ``metadata`` as JSON values; the ``hf``
dataset holds those three as JSON strings (their shapes vary from row to row, which Arrow cannot type).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import orjson
import structlog

from extras import require_extra
from replay import hashing
from replay.filters import Filters
from replay.model import StoredCall
from replay.queries import CALL_COLUMNS, CALL_COLUMNS_WITHOUT_LOGPROBS, stored_call
from replay.records import new_id
from replay.redact import Redactor
from replay.vocabulary import CALL_OK

log = structlog.get_logger()

FORMATS = ("chat-jsonl", "hf", "trl", "verl")
_EMPTY_REPLY = b"{}"  # what the store keeps for a choice that had no message


class ExportError(Exception):
    """An export that cannot go on; the message says why, for a person."""


@dataclass(frozen=True)
class ExportOptions:
    window: int = 1  # calls per row; 0 = as many as extend each other
    include_failed: bool = False
    by_group: bool = False  # rows of one group together (group id order), else trajectory id order
    chunk_size: int = 500  # trajectories read per chunk
    jobs: int = 1  # chat-jsonl: worker processes building rows (see _parallel_jsonl); 0 = auto_jobs()
    logprobs: bool = False  # read the sampled log-probabilities too (the trainer formats' RL rows)
    by_task: bool = False  # with by_group: trajectories without a group id grouped by task, as RL groups them


@dataclass(slots=True)
class Row:
    """One training row; ``messages``/``tools``/``metadata`` are JSON bytes, ready to splice or decode."""

    trajectory: dict[str, Any]  # the trajectory's fields, shared by its rows
    trajectory_json: bytes  # the same, serialized once per trajectory
    call: dict[str, Any]  # the row's own fields: which call(s), their status, whether redacted
    messages: bytes
    tools: bytes | None
    metadata: bytes | None
    prompt_token_ids: bytes | None  # JSON array of ints
    completion_token_ids: bytes | None
    completion_logprobs: bytes | None = None  # as sampled (ExportOptions.logprobs), JSON array of floats


@dataclass
class ExportResult:
    trajectories: int = 0
    rows: int = 0
    redacted_rows: int = 0
    seconds: float = 0.0
    output: str = ""


@dataclass
class _Bodies:
    """A chunk's message bodies: as stored, and as they may leave (redacted), with what changed."""

    raw: dict[str, bytes]
    out: dict[str, bytes] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)


_TRAJECTORY_COLUMNS = ("id, source, tenant, requested_model, base_model, adapter, adapter_version, task_id, "
                       "group_id, parent_id, status, termination_reason, final_reward, metadata")


# Below this many trajectories, starting worker processes costs more than they save.
PARALLEL_MIN_TRAJECTORIES = 20_000


def auto_jobs(trajectories: int) -> int:
    """Worker processes for an export of this size: one per CPU (at most 8) for a big one, else none."""
    if trajectories < PARALLEL_MIN_TRAJECTORIES:
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def count(conn: sqlite3.Connection, filters: Filters) -> int:
    where, args = filters.where("t")
    return conn.execute(f"SELECT COUNT(*) FROM trajectories t WHERE {where}", args).fetchone()[0]


def has_exportable_call(conn: sqlite3.Connection, filters: Filters, include_failed: bool) -> bool:
    where, args = filters.where("t")
    status = "" if include_failed else f"AND mc.status = '{CALL_OK}' AND mc.response_messages NOT IN ('[]', '')"
    return conn.execute(f"""SELECT 1 FROM trajectories t JOIN model_calls mc ON mc.trajectory_id = t.id
                            WHERE {where} {status} LIMIT 1""", args).fetchone() is not None


def _chunks(conn: sqlite3.Connection, filters: Filters, options: ExportOptions) -> Iterator[list[tuple[Any, ...]]]:
    """The selected trajectories' rows, a chunk at a time, in one read transaction (one snapshot)."""
    where, args = filters.where("t")
    key = "t.group_id, t.task_id, t.id" if options.by_task else "t.group_id, t.id"
    order = f"COALESCE({key}), t.id" if options.by_group else "t.id"
    conn.execute("BEGIN")
    try:
        cursor = conn.execute(f"SELECT {_TRAJECTORY_COLUMNS} FROM trajectories t WHERE {where} ORDER BY {order}",
                              args)
        while chunk := cursor.fetchmany(options.chunk_size):
            yield chunk
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")


def iter_rows(conn: sqlite3.Connection, filters: Filters, options: ExportOptions, redactor: Redactor,
              on_chunk: Callable[[int], None] | None = None) -> Iterator[Row]:
    """Every row of the selection, in order; ``on_chunk(n)`` after each chunk of n trajectories.

    Trajectories, calls and bodies are all read in one snapshot, so they agree even while the gateway writes.
    """
    for chunk in _chunks(conn, filters, options):
        yield from _chunk_rows(conn, chunk, options, redactor)
        if on_chunk is not None:
            on_chunk(len(chunk))


def _chunk_rows(conn: sqlite3.Connection, chunk: list[tuple[Any, ...]], options: ExportOptions,
                redactor: Redactor) -> Iterator[Row]:
    calls = _calls(conn, [t[0] for t in chunk], options.include_failed, options.logprobs)
    keys = {k for cs in calls.values() for c in cs for k in (*c.request_keys, c.tools_key, c.reply_key) if k}
    bodies = _bodies(conn, keys, redactor)
    for traj in chunk:
        base = _base_meta(traj)
        base_json = orjson.dumps(base)
        metadata = _metadata(traj[13], redactor)
        for first, last in _windows(calls.get(traj[0], []), options.window, bodies):
            row = _row(base, base_json, metadata, first, last, bodies, redactor, options.include_failed)
            if row is not None:
                yield row


def _metadata(text: str | None, redactor: Redactor) -> bytes | None:
    if text is None:
        return None
    body = text.encode()
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:  # not JSON after all: carry it as a string rather than break the row
        body = orjson.dumps(text)
    return _redacted_bytes(body, redactor)[0]


def _calls(conn: sqlite3.Connection, ids: list[str], include_failed: bool,
           logprobs: bool = False) -> dict[str, list[StoredCall]]:
    status = "" if include_failed else f"AND status = '{CALL_OK}'"
    out: dict[str, list[StoredCall]] = {}
    for row in conn.execute(
            f"""SELECT {CALL_COLUMNS if logprobs else CALL_COLUMNS_WITHOUT_LOGPROBS} FROM model_calls
                WHERE trajectory_id IN (SELECT value FROM json_each(?)) {status}
                ORDER BY trajectory_id, seq, created_at""", (orjson.dumps(ids),)):
        call = stored_call(row)
        out.setdefault(call.trajectory_id, []).append(call)
    return out


def _bodies(conn: sqlite3.Connection, keys: set[str], redactor: Redactor) -> _Bodies:
    raw: dict[str, bytes] = dict(conn.execute(
        "SELECT hash, body FROM blobs WHERE hash IN (SELECT value FROM json_each(?))", (orjson.dumps(list(keys)),)))
    missing = keys - raw.keys()
    if missing:
        raise ExportError(f"the store refers to {len(missing)} message bodies it does not hold "
                          f"(e.g. {next(iter(missing))}); it may be damaged")
    out = _Bodies(raw, dict(raw))
    if redactor.active:
        may_match = redactor.may_match
        for key, body in raw.items():
            if may_match(body):
                new, changed = _redacted_bytes(body, redactor)
                if changed:
                    out.out[key] = new
                    out.changed.add(key)
    return out


def _redacted_bytes(body: bytes, redactor: Redactor) -> tuple[bytes, bool]:
    if not redactor.may_match(body):
        return body, False
    value, changed = redactor.value(orjson.loads(body))
    return (orjson.dumps(value, option=orjson.OPT_SORT_KEYS), True) if changed else (body, False)


def _windows(calls: list[StoredCall], size: int, bodies: _Bodies) -> Iterator[tuple[StoredCall, StoredCall]]:
    """(first, last) call of each row: runs of up to ``size`` calls, each extending the one before."""
    if size == 1:
        for c in calls:
            yield c, c
        return
    run: list[StoredCall] = []
    for c in calls:
        if run and ((size and len(run) >= size) or not _extends(run[-1], c, bodies)):
            yield run[0], run[-1]
            run = []
        run.append(c)
    if run:
        yield run[0], run[-1]


def _extends(prev: StoredCall, cur: StoredCall, bodies: _Bodies) -> bool:
    """Whether ``cur``'s request starts with ``prev``'s whole context (its request, then its reply)."""
    reply = prev.reply_key
    context = prev.request_keys + ([reply] if reply and bodies.raw[reply] != _EMPTY_REPLY else [])
    if len(cur.request_keys) < len(context):
        return False
    for mine, theirs in zip(context, cur.request_keys, strict=False):
        # Clients echo replies back with cosmetic differences; compare those as stitching does.
        if mine != theirs and (hashing.stitch_hash(orjson.loads(bodies.raw[mine]))
                               != hashing.stitch_hash(orjson.loads(bodies.raw[theirs]))):
            return False
    return True


def _base_meta(t: tuple[Any, ...]) -> dict[str, Any]:
    return {"trajectory_id": t[0], "source": t[1], "tenant": t[2], "model": t[3], "base_model": t[4],
            "adapter": t[5], "adapter_version": t[6], "task_id": t[7], "group_id": t[8], "parent_id": t[9],
            "status": t[10], "termination_reason": t[11], "final_reward": t[12]}


def _row(base: dict[str, Any], base_json: bytes, metadata: bytes | None, first: StoredCall, last: StoredCall,
         bodies: _Bodies, redactor: Redactor, include_failed: bool) -> Row | None:
    keys = list(last.request_keys)
    reply = last.reply_key
    if reply is not None and bodies.raw[reply] != _EMPTY_REPLY:
        keys.append(reply)
    elif not include_failed:
        return None  # nothing to learn from a call without a reply
    if not keys:
        return None
    changed = bool(bodies.changed) and (not bodies.changed.isdisjoint(keys) or last.tools_key in bodies.changed)
    error = last.error if last.error is None or not redactor.active else redactor.text(last.error)
    call = {"call_id": last.id, "seq": last.seq, "first_seq": first.seq, "call_status": last.status,
            "finish_reason": last.finish_reason, "purpose": last.declared_purpose, "error": error, "redacted": changed}
    out = bodies.out
    return Row(trajectory=base, trajectory_json=base_json, call=call,
               messages=b"[" + b",".join(out[k] for k in keys) + b"]",
               tools=out[last.tools_key] if last.tools_key else None, metadata=metadata,
               prompt_token_ids=None if changed or last.packed_prompt_ids is None
               else zlib.decompress(last.packed_prompt_ids),
               completion_token_ids=None if changed else last.first_completion_ids(),
               completion_logprobs=None if changed else last.first_sampled_logprobs())


# -- writers -------------------------------------------------------------------------------------------


def jsonl_line(row: Row) -> bytes:
    return b"".join((
        b'{"messages":', row.messages,
        b',"tools":', row.tools or b"null",
        b',"metadata":', row.metadata or b"null",
        b',"prompt_token_ids":', row.prompt_token_ids or b"null",
        b',"completion_token_ids":', row.completion_token_ids or b"null",
        b",", row.trajectory_json[1:-1], b",", orjson.dumps(row.call)[1:], b"\n"))


def write_jsonl(rows: Iterator[Row], out: IO[bytes], result: ExportResult) -> None:
    for row in rows:
        out.write(jsonl_line(row))
        result.rows += 1
        result.redacted_rows += row.call["redacted"]


# Worker processes for chat-jsonl. Building rows is CPU-bound Python, so one process tops out at roughly
# 10-15k trajectories/s; with --jobs N the parent reads the trajectory cursor and hands chunks to N
# workers, which read their calls and bodies on their own read-only connections and return finished JSONL
# bytes; the parent writes them in order. At most 2N chunks are in flight, so memory stays bounded. The
# price: each chunk's calls are read in the worker's own snapshot, not the parent's (a call committed
# meanwhile can appear with a trajectory row read before it).
_worker: dict[str, Any] = {}


def _worker_init(path: str, options: ExportOptions, redactor: Redactor) -> None:
    from urllib.parse import quote

    conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, isolation_level=None)
    conn.execute("PRAGMA query_only = ON")
    conn.execute("PRAGMA busy_timeout = 10000")
    _worker.update(conn=conn, options=options, redactor=redactor)


def _worker_chunk(chunk: list[tuple[Any, ...]]) -> tuple[bytes, int, int]:
    conn: sqlite3.Connection = _worker["conn"]
    conn.execute("BEGIN")
    try:
        rows = list(_chunk_rows(conn, chunk, _worker["options"], _worker["redactor"]))
    finally:
        conn.execute("COMMIT")
    return b"".join(jsonl_line(r) for r in rows), len(rows), sum(r.call["redacted"] for r in rows)


def _parallel_jsonl(conn: sqlite3.Connection, filters: Filters, options: ExportOptions, redactor: Redactor,
                    out: IO[bytes], result: ExportResult, on_chunk: Callable[[int], None] | None) -> None:
    import multiprocessing
    from collections import deque
    from concurrent.futures import Future, ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    path = conn.execute("PRAGMA database_list").fetchone()[2]
    # spawn, not fork: a forked child would inherit this process's SQLite lock state for the same file.
    # ProcessPoolExecutor, not Pool: a worker that dies fails the export instead of hanging it.
    pool = ProcessPoolExecutor(options.jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(path, options, redactor))
    pending: deque[tuple[int, Future[tuple[bytes, int, int]]]] = deque()
    try:
        for chunk in _chunks(conn, filters, options):
            pending.append((len(chunk), pool.submit(_worker_chunk, chunk)))
            while len(pending) >= 2 * options.jobs:
                _drain(pending.popleft(), out, result, on_chunk)
        while pending:
            _drain(pending.popleft(), out, result, on_chunk)
    except BrokenProcessPool:
        raise ExportError("the export's worker processes stopped unexpectedly; try --jobs 1") from None
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _drain(item: tuple[int, Any], out: IO[bytes], result: ExportResult,
           on_chunk: Callable[[int], None] | None) -> None:
    n, future = item
    data, rows, redacted = future.result()
    out.write(data)
    result.rows += rows
    result.redacted_rows += redacted
    if on_chunk is not None:
        on_chunk(n)


# -- the whole export ---------------------------------------------------------------------------------


def export(conn: sqlite3.Connection, filters: Filters, output: str | os.PathLike[str], *, fmt: str,
           options: ExportOptions, redactor: Redactor, overwrite: bool = False,
           on_chunk: Callable[[int], None] | None = None) -> ExportResult:
    """Write the selection to ``output`` (a file for chat-jsonl, a directory for the others), all or nothing.

    Rows go to a temporary path beside ``output`` that replaces it only once complete, so a failed or
    interrupted export never leaves a half-written file where a finished one is expected.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt in ("hf", "verl"):  # datasets, and the pyarrow behind it
        require_extra("train", f"replay export --format {fmt}")
    out = Path(output)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists (pass --force to replace it)")
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: the directory {out.parent} does not exist")
    started = time.perf_counter()
    result = ExportResult(output=str(out))
    result.trajectories = count(conn, filters)
    if result.trajectories == 0:
        raise ExportError("no trajectories match the filters; nothing written")
    if not has_exportable_call(conn, filters, options.include_failed):
        raise ExportError(f"{result.trajectories} trajectories match, but none has a model call with a reply"
                          + ("" if options.include_failed else " (failed calls are skipped; see --include-failed)")
                          + "; nothing written")

    jobs = options.jobs or auto_jobs(result.trajectories)

    def rows() -> Iterator[Row]:
        return iter_rows(conn, filters, options, redactor, on_chunk)

    tmp = out.parent / f".{out.name}.{new_id()}.tmp"
    try:
        if fmt == "chat-jsonl":
            try:
                fh = tmp.open("wb", buffering=1 << 20)
            except OSError as exc:
                raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
            with fh:
                if jobs > 1:
                    _parallel_jsonl(conn, filters, replace(options, jobs=jobs), redactor, fh, result, on_chunk)
                else:
                    write_jsonl(rows(), fh, result)
        elif fmt == "hf":
            from replay.export_hf import write_hf  # only here: the [train] extra's datasets behind it

            write_hf(rows, tmp, result)
        else:
            from replay import export_trainers

            rl_options = replace(options, window=1, by_group=True, by_task=True, logprobs=True)
            export_trainers.write(fmt, lambda: iter_rows(conn, filters, replace(options, logprobs=True), redactor,
                                                         on_chunk),
                                  lambda: iter_rows(conn, filters, rl_options, redactor), tmp, result)
        if result.rows == 0:
            raise ExportError("no model call in the selection had a reply to export; nothing written")
        if out.exists():
            _remove(out)
        os.replace(tmp, out)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        if tmp.exists():
            _remove(tmp)
    result.seconds = time.perf_counter() - started
    log.info("replay.export.done", format=fmt, output=str(out), trajectories=result.trajectories, rows=result.rows,
             redacted_rows=result.redacted_rows, seconds=round(result.seconds, 3),
             jobs=jobs if fmt == "chat-jsonl" else 1)
    return result


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
