"""Import: chat JSONL in as trajectories through the store's write path, all or nothing, and out again
unchanged."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.export import ExportOptions, iter_rows, jsonl_line
from replay.filters import Filters
from replay.importer import ImportFileError, import_conversations, parse_line, read_file
from replay.readonly import open_readonly
from replay.redact import Redactor
from tests.replay import builders as b

CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [b.SYSTEM, {"role": "user", "content": "What is 2+2?"},
                  b.assistant_calls(b.tool_call("call_a", "2+2")), b.tool_result("call_a", "4"),
                  {"role": "assistant", "content": "It is 4."}],
     "tools": b.TOOLS, "task_id": "math-1", "group_id": "demo-g", "metadata": {"author": "ann"}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
                  {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "hi again", "refusal": None}]},
    {"messages": [{"role": "user", "content": "two tools at once"},
                  b.assistant_calls(b.tool_call("c1", "1+1"), b.tool_call("c2", "2+2")),
                  b.tool_result("c1", "2"), b.tool_result("c2", "4"), {"role": "assistant", "content": "2 and 4"}],
     "tools": b.TOOLS, "model": "teacher-1"},
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def exported(db: Path, filters: Filters | None = None, **options: Any) -> list[dict[str, Any]]:
    with open_readonly(db) as conn:
        return [orjson.loads(jsonl_line(r)) for r in iter_rows(conn, filters or Filters(), ExportOptions(**options),
                                                                 Redactor())]


async def test_import_then_export_is_lossless(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "demo.jsonl", CONVERSATIONS)
    db = tmp_path / "h.db"
    store = await b.open_store(db)
    result = await import_conversations(store, read_file(src), source="demo", task="default-task", tenant="acme")
    await store.close()
    assert (result.trajectories, result.model_calls) == (3, 6)
    whole = exported(db, Filters(source="demo"), window=0)
    assert [r["messages"] for r in whole] == [c["messages"] for c in CONVERSATIONS]
    assert [r["tools"] for r in whole] == [c.get("tools") for c in CONVERSATIONS]
    assert [r["task_id"] for r in whole] == ["math-1", "default-task", "default-task"]  # the line's own wins
    assert [r["group_id"] for r in whole] == ["demo-g", None, None]
    assert [r["model"] for r in whole] == [None, None, "teacher-1"]
    assert whole[0]["metadata"] == {"author": "ann"} and all(r["tenant"] == "acme" for r in whole)
    # One model call per assistant turn: the request is everything before it.
    per_call = exported(db, Filters(source="demo"))
    assert [(r["seq"], len(r["messages"])) for r in per_call] == [(0, 3), (1, 5), (0, 2), (1, 4), (0, 2), (1, 5)]
    # Exported rows import again as they are, and come out the same.
    again = write_jsonl(tmp_path / "again.jsonl", whole)
    store = await b.open_store(db)
    await import_conversations(store, read_file(again), source="rollout")
    await store.close()
    assert [r["messages"] for r in exported(db, Filters(source="rollout"), window=0)] == [
        c["messages"] for c in CONVERSATIONS]


async def test_imported_conversations_are_never_stitched_onto(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    store = await b.open_store(db)
    await import_conversations(store, read_file(write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS[:1])), source="demo")
    await store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT head_hash, status, n_calls FROM trajectories").fetchall() == [
            (None, "completed", 2)]


async def test_a_bad_line_imports_nothing(tmp_path: Path) -> None:
    lines = [orjson.dumps(c).decode() for c in CONVERSATIONS] + ['{"messages": [{"role": "user"']
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(ImportFileError, match="line 4: not valid JSON"):
        read_file(src)


@pytest.mark.parametrize(("row", "problem"), [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}]},
     "must end with the assistant's reply"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages\\[0\\].role is 'robot'"),
    ({"messages": [{"role": "tool", "content": "4"}, {"role": "assistant", "content": "x"}]}, "without a tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "tool_calls\\[0\\] needs an id"),
    ({"messages": [{"role": "assistant", "content": "x"}], "tools": {"a": 1}}, "'tools' must be a list"),
    ({"messages": [{"role": "assistant", "content": "x"}], "metadata": [1]}, "'metadata' must be an object"),
    ({"messages": [{"role": "assistant", "content": 5}]}, "content must be a string"),
    ([1, 2], "expected a JSON object"),
])
def test_line_problems_are_named(row: Any, problem: str) -> None:
    with pytest.raises(ImportFileError, match=f"^line 7: .*{problem}"):
        parse_line(7, orjson.dumps(row).decode())


def test_blank_lines_are_skipped_and_empty_files_refused(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("\n" + orjson.dumps(CONVERSATIONS[1]).decode() + "\n\n")
    assert [c.line for c in read_file(src)] == [2]
    src.write_text("\n\n")
    with pytest.raises(ImportFileError, match="holds no conversations"):
        read_file(src)
    with pytest.raises(ImportFileError, match="no file"):
        read_file(tmp_path / "missing.jsonl")
