"""Importing chat JSONL (demonstrations, other tools' logs) as trajectories of a source, all or nothing.

Each line is ``{"messages": [...], "tools": [...]?, "task_id"?, "group_id"?, "metadata"?, "model"?}``
(the rows ``harness replay export --format chat-jsonl`` writes qualify; their other keys are ignored).
A line becomes one trajectory with one model call per assistant message: the call's request is every
message before it and its response is that message, so exporting the trajectory again (one row per call,
or ``--window 0`` for the whole conversation) gives back exactly the messages and tools imported.

Every line is checked before anything is written, and the whole file is then one ``WriteOp`` through the
store's normal write path: one transaction, so a bad line (reported with its number) or a failed commit
leaves the store as it was. That holds the file's records in memory at once, which is the price of
all-or-nothing; split very large files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog

from replay import hashing
from replay.records import CallRecord, TrajectoryRef, WriteOp, new_id
from replay.store import TrajectoryStore

log = structlog.get_logger()

ROLES = {"system", "developer", "user", "assistant", "tool"}


class ImportFileError(Exception):
    """A file that cannot be imported; the message names the line and the problem."""


@dataclass
class Conversation:
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    task_id: str | None = None
    group_id: str | None = None
    model: str | None = None
    metadata: dict[str, Any] | None = None


@dataclass
class ImportResult:
    trajectories: int = 0
    model_calls: int = 0
    ids: list[str] = field(default_factory=list)


def _problem(line: int, text: str) -> ImportFileError:
    return ImportFileError(f"line {line}: {text}")


def _check_message(line: int, i: int, m: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _problem(line, f"{where} is not an object")
    role = m.get("role")
    if role not in ROLES:
        raise _problem(line, f"{where}.role is {role!r}; expected one of {', '.join(sorted(ROLES))}")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise _problem(line, f"{where}.content must be a string, a list of parts, or null")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise _problem(line, f"{where} is a tool message without a tool_call_id")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise _problem(line, f"{where}.tool_calls must be a list, on an assistant message")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
                raise _problem(line, f"{where}.tool_calls[{j}] needs an id and a function with a name and "
                                     "arguments (a JSON string)")


def parse_line(line: int, text: str) -> Conversation:
    try:
        row = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _problem(line, f"not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise _problem(line, "expected a JSON object with a 'messages' list")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _problem(line, "'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        _check_message(line, i, m)
    if not any(m["role"] == "assistant" for m in messages):
        raise _problem(line, "no assistant message: nothing the model said to import")
    if messages[-1]["role"] != "assistant":
        # Messages after the last reply belong to no model call, so they would be lost: refuse, not drop.
        raise _problem(line, f"the last message is {messages[-1]['role']!r}; a conversation must end with the "
                             "assistant's reply")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _problem(line, "'tools' must be a list of tool objects")
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _problem(line, "'metadata' must be an object")
    for key in ("task_id", "group_id", "model"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise _problem(line, f"'{key}' must be a string")
    return Conversation(line=line, messages=messages, tools=tools or None, task_id=row.get("task_id"),
                        group_id=row.get("group_id"), model=row.get("model"), metadata=metadata)


def read_file(path: str | Path, on_line: Callable[[int], None] | None = None) -> list[Conversation]:
    """Every conversation of a chat-JSONL file, or the first problem found (blank lines are skipped)."""
    p = Path(path)
    out: list[Conversation] = []
    try:
        with p.open("rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if raw.strip():
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        raise _problem(number, "not UTF-8 text") from None
                    out.append(parse_line(number, text))
                if on_line is not None:
                    on_line(len(raw))
    except FileNotFoundError:
        raise ImportFileError(f"no file {p}") from None
    except IsADirectoryError:
        raise ImportFileError(f"{p} is a directory, not a JSONL file") from None
    except OSError as exc:
        raise ImportFileError(f"cannot read {p}: {exc.strerror or exc}") from None
    if not out:
        raise ImportFileError(f"{p} holds no conversations")
    return out


def build_op(conversations: Iterable[Conversation], *, source: str, task: str | None = None,
             group: str | None = None, tenant: str | None = None, model: str | None = None,
             result: ImportResult | None = None) -> WriteOp:
    """One WriteOp for every conversation: a call record per assistant turn, then the trajectory fields
    the record path does not set (task, metadata), and no stitching head.

    A line's own ``task_id``/``group_id``/``model`` win over the command's defaults.
    """
    result = result if result is not None else ImportResult()
    conversations = list(conversations)
    op = WriteOp()
    now = time.time()
    # Ids made in the same millisecond are not ordered among themselves; sorted, they follow the file.
    ids = sorted(new_id() for _ in conversations)
    for tid, conv in zip(ids, conversations, strict=True):
        group_id = conv.group_id or group
        requested = conv.model or model
        prefix = hashing.prefix_hashes(conv.messages)
        seq = 0
        for i, message in enumerate(conv.messages):
            if message["role"] != "assistant":
                continue
            op.records.append(CallRecord(
                trajectory=TrajectoryRef(id=tid, seq=seq, is_new=seq == 0, group_id=group_id),
                request_messages=conv.messages[:i], request_prefix=prefix[:i], status="ok", source=source,
                tenant=tenant, requested_model=requested, base_model=requested, tools=conv.tools,
                params={"imported_from_line": conv.line},
                response={"object": "chat.completion", "model": requested,
                          "choices": [{"index": 0, "message": message,
                                       "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]},
                created_at=now))
            seq += 1
        # An imported conversation must never be what a live client's request gets stitched onto.
        op.statements.append((
            "UPDATE trajectories SET task_id = ?, metadata = ?, head_hash = NULL WHERE id = ?",
            (conv.task_id or task, orjson.dumps(conv.metadata).decode() if conv.metadata else None, tid)))
        result.trajectories += 1
        result.model_calls += seq
        result.ids.append(tid)
    return op


async def import_conversations(store: TrajectoryStore, conversations: list[Conversation], *, source: str,
                               task: str | None = None, group: str | None = None, tenant: str | None = None,
                               model: str | None = None) -> ImportResult:
    result = ImportResult()
    op = build_op(conversations, source=source, task=task, group=group, tenant=tenant, model=model, result=result)
    await store.write(op)
    log.info("replay.import.done", source=source, trajectories=result.trajectories, model_calls=result.model_calls)
    return result
