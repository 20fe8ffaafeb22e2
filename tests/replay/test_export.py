"""Export over real SQLite stores filled through the store's write path: rows are the contexts as sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.export import ExportError, ExportOptions, export, iter_rows
from replay.filters import Filters
from replay.readonly import open_readonly
from replay.redact import Redactor
from tests.replay import builders as b

KEY = "sk-proj-a1B2c3D4e5F6g7H8i9J0k1L2"
BEARER = "Bearer abc123.DEF456-ghi789"
EMAIL = "alice.secret@example.com"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def rows_of(path: Path, filters: Filters | None = None, redactor: Redactor | None = None,
            **options: Any) -> list[dict[str, Any]]:
    from replay.export import jsonl_line

    with open_readonly(path) as conn:
        return [orjson.loads(jsonl_line(r)) for r in iter_rows(conn, filters or Filters(), ExportOptions(**options),
                                                                 redactor or Redactor())]


def assert_never_split(messages: list[dict[str, Any]]) -> None:
    """Every tool result follows the call that asked for it; every call but the row's last reply has all its
    results right after it."""
    pending: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            assert m["tool_call_id"] in pending, f"tool result without its call at {i}"
            pending.discard(m["tool_call_id"])
            continue
        assert not pending, f"message {i} cuts into the results of {pending}"
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = {c["id"] for c in m["tool_calls"]}
            if i == len(messages) - 1:
                pending = set()  # the reply itself: its results come in a later call


@pytest.fixture
async def agent_store(tmp_path: Path) -> Path:
    path = tmp_path / "h.db"
    store = await b.open_store(path)
    await b.agent_trajectory(store, "What is 2+2?", task="math-1", group="g1", reward=1.0)
    await b.agent_trajectory(store, "And 3+3?", final="6", result="6", task="math-2", group="g1", reward=0.0)
    await store.close()
    return path


async def test_one_row_per_call_matches_what_was_stored(agent_store: Path, tmp_path: Path) -> None:
    store = await b.open_store(agent_store)
    stored = [(await store.get_trajectory(t.id, all_tenants=True)).to_dict()
              for t in reversed(await store.list_trajectories(all_tenants=True))]
    await store.close()
    out = tmp_path / "rows.jsonl"
    with open_readonly(agent_store) as conn:
        result = export(conn, Filters(), out, fmt="chat-jsonl", options=ExportOptions(), redactor=Redactor())
    assert (result.trajectories, result.rows, result.redacted_rows) == (2, 4, 0)
    rows = read_jsonl(out)
    expected = [(t, c) for t in stored for c in t["calls"]]
    assert len(rows) == len(expected)
    for row, (t, call) in zip(rows, expected, strict=True):
        assert row["messages"] == call["request"]["messages"] + [call["response"]["choices"][0]["message"]]
        assert row["tools"] == call["request"]["tools"] == b.TOOLS
        assert row["prompt_token_ids"] == call["prompt_token_ids"]
        assert row["completion_token_ids"] == call["completion_token_ids"][0]
        assert (row["trajectory_id"], row["call_id"], row["seq"], row["first_seq"]) == (t["id"], call["id"],
                                                                                       call["seq"], call["seq"])
        assert (row["task_id"], row["group_id"], row["final_reward"], row["status"]) == (
            t["task_id"], "g1", t["final_reward"], "completed")
        assert row["source"] == "agent" and row["model"] == "base-m" and row["redacted"] is False
        assert row["purpose"] == "step" and row["call_status"] == "ok"
        assert_never_split(row["messages"])
    assert rows[0]["messages"][-1]["tool_calls"][0]["id"] == "call_1"
    assert rows[1]["messages"][3] == {"role": "tool", "tool_call_id": "call_1", "content": "4"}


@pytest.mark.extra("train")
async def test_hf_dataset_round_trips(agent_store: Path, tmp_path: Path) -> None:
    import datasets

    jsonl, hf = tmp_path / "rows.jsonl", tmp_path / "ds"
    with open_readonly(agent_store) as conn:
        export(conn, Filters(), jsonl, fmt="chat-jsonl", options=ExportOptions(), redactor=Redactor())
        result = export(conn, Filters(), hf, fmt="hf", options=ExportOptions(), redactor=Redactor())
    assert result.rows == 4
    ds = datasets.load_from_disk(str(hf))
    assert len(ds) == 4
    assert not list(tmp_path.glob(".export-cache-*")) and not list(tmp_path.glob(".*.tmp"))
    for row, want in zip(ds, read_jsonl(jsonl), strict=True):
        # messages, tools and metadata are JSON strings in the dataset; everything else is a column.
        assert orjson.loads(row.pop("messages")) == want.pop("messages")
        assert orjson.loads(row.pop("tools")) == want.pop("tools")
        assert row.pop("metadata") is None and want.pop("metadata") is None
        assert row == want


async def test_windows_follow_extending_history_and_break_where_it_was_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    store = await b.open_store(path)
    user = {"role": "user", "content": "add up to five"}
    history: list[dict[str, Any]] = [b.SYSTEM, user]
    calls = []
    for i in range(1, 6):
        call = b.assistant_calls(b.tool_call(f"call_{i}", f"{i}+0"))
        calls.append((list(history), call))
        history += [call, b.tool_result(f"call_{i}", str(i))]
    # The agent summarised before the sixth call: the older turns became one message.
    summary = {"role": "user", "content": "Summary: added 1 to 5 so far."}
    calls.append(([b.SYSTEM, user, summary, *history[-2:]], b.answer("done")))
    calls.append(([b.SYSTEM, user, summary, *history[-2:], b.answer("done"), {"role": "user", "content": "ok?"}],
                  b.answer("yes")))
    await b.write(store, calls, tools=b.TOOLS)
    await store.close()

    def spans(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
        return [(r["first_seq"], r["seq"]) for r in rows]

    assert spans(rows_of(path)) == [(i, i) for i in range(7)]
    assert spans(rows_of(path, window=2)) == [(0, 1), (2, 3), (4, 4), (5, 6)]
    assert spans(rows_of(path, window=3)) == [(0, 2), (3, 4), (5, 6)]
    whole = rows_of(path, window=0)
    assert spans(whole) == [(0, 4), (5, 6)]
    # The first row holds every reply of calls 0-4: the history extended all along.
    assert [m["tool_calls"][0]["id"] for m in whole[0]["messages"] if m.get("tool_calls")] == [
        f"call_{i}" for i in range(1, 6)]
    assert whole[1]["messages"][-1] == b.answer("yes") and whole[1]["messages"][2] == summary
    for rows in (rows_of(path, window=n) for n in (0, 1, 2, 3)):
        for row in rows:
            assert_never_split(row["messages"])
            assert row["prompt_token_ids"] == list(range(row["seq"], row["seq"] + 10))  # the last call's ids


async def test_an_echoed_reply_with_cosmetic_differences_still_extends(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    store = await b.open_store(path)
    first = [b.SYSTEM, {"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "hello", "refusal": None}
    echoed = {"role": "assistant", "content": "hello"}  # the client dropped the null field
    await b.write(store, [(first, reply), ([*first, echoed, {"role": "user", "content": "more"}], b.answer("sure"))])
    await store.close()
    assert [(r["first_seq"], r["seq"]) for r in rows_of(path, window=0)] == [(0, 1)]


async def test_failed_calls_are_skipped_unless_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    store = await b.open_store(path)
    msgs = [b.SYSTEM, {"role": "user", "content": "hi"}]
    await b.write(store, [(msgs, None), (msgs, b.answer("hello"))], call_status=["error", "ok"])
    await b.write(store, [(msgs, None)], call_status=["client_disconnected"], status="client_disconnected")
    await store.close()
    rows = rows_of(path)
    assert [(r["seq"], r["call_status"]) for r in rows] == [(1, "ok")]
    everything = rows_of(path, include_failed=True)
    assert [(r["seq"], r["call_status"]) for r in everything] == [(0, "error"), (1, "ok"), (0, "client_disconnected")]
    assert everything[0]["messages"] == msgs and everything[0]["error"] == "upstream said no"
    with open_readonly(path) as conn, pytest.raises(ExportError, match="none has a model call with a reply"):
        export(conn, Filters(status="client_disconnected"), tmp_path / "x.jsonl", fmt="chat-jsonl",
               options=ExportOptions(), redactor=Redactor())
    assert not (tmp_path / "x.jsonl").exists()


async def test_redaction_removes_planted_secrets_and_drops_only_those_rows_token_ids(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    store = await b.open_store(path)
    leaky = await b.agent_trajectory(store, f"My key is {KEY}, mail me at {EMAIL}",
                                     result=f"fetched with Authorization: {BEARER}")
    clean = await b.agent_trajectory(store, "What is 2+2?", metadata=orjson.dumps({"owner": EMAIL}).decode())
    await store.close()
    rows = rows_of(path)
    by_traj = {tid: [r for r in rows if r["trajectory_id"] == tid] for tid in (leaky, clean)}
    text = orjson.dumps(by_traj[leaky]).decode()
    for secret in (KEY, EMAIL, "abc123.DEF456-ghi789"):
        assert secret not in text
    first, second = by_traj[leaky]
    assert first["messages"][1]["content"] == "My key is [REDACTED:api_key], mail me at [REDACTED:email]"
    assert second["messages"][3]["content"] == "fetched with Authorization: Bearer [REDACTED:bearer]"
    for row in by_traj[leaky]:
        assert row["redacted"] is True and row["prompt_token_ids"] is None and row["completion_token_ids"] is None
    for row in by_traj[clean]:
        assert row["redacted"] is False
        assert row["prompt_token_ids"] == list(range(row["seq"], row["seq"] + 10))
        assert row["completion_token_ids"] == [100 + row["seq"], 101 + row["seq"]]
        assert row["metadata"] == {"owner": "[REDACTED:email]"}  # metadata leaves the store too
    raw = rows_of(path, redactor=Redactor(defaults=False))
    assert KEY in orjson.dumps(raw).decode() and all(r["prompt_token_ids"] is not None for r in raw)
    custom = rows_of(path, redactor=Redactor(defaults=False, patterns=[r"2\+2"]))
    assert all("2+2" not in r["messages"][1]["content"] for r in custom if r["trajectory_id"] == clean)


async def test_filters_combine(tmp_path: Path) -> None:
    path = tmp_path / "flt.db"
    store = await b.open_store(path)
    day = 86_400
    base = time.time() - 10 * day
    made = {}
    specs = {
        "a": dict(source="agent", tenant="acme", model="m1", status="completed", reward=1.0, task="t1", group="g1",
                  created_at=base),
        "b": dict(source="agent", tenant="acme", model="m2", adapter="lora1", status="terminated",
                  reason="max_steps", reward=0.2, task="t1", group="g1", created_at=base + day),
        "c": dict(source="proxy", tenant="beta", model="m1", status="completed", reward=None, task="t2",
                  created_at=base + 2 * day),
        "d": dict(source="eval", tenant=None, model="m1", adapter="lora1", status="error", reward=0.5, task="t2",
                  group="g2", created_at=base + 3 * day),
    }
    for name, spec in specs.items():
        made[name] = await b.agent_trajectory(store, f"question {name}", **spec)
    await store.close()
    ids = {v: k for k, v in made.items()}

    def selected(**kw: Any) -> set[str]:
        return {ids[r["trajectory_id"]] for r in rows_of(path, Filters(**kw))}

    assert selected() == {"a", "b", "c", "d"}
    assert selected(source="agent", tenant="acme") == {"a", "b"}
    assert selected(source="agent", model="m1") == {"a"}
    assert selected(adapter="lora1") == {"b", "d"}
    assert selected(adapter="lora1", status="error") == {"d"}
    assert selected(reason="max_steps") == {"b"}
    assert selected(min_reward=0.5) == {"a", "d"}
    assert selected(min_reward=0.1, max_reward=0.6) == {"b", "d"}
    assert selected(task="t2", group="g2") == {"d"}
    assert selected(group="g1", status="completed") == {"a"}
    assert selected(since=base + day, until=base + 3 * day) == {"b", "c"}
    from datetime import UTC, datetime
    iso = datetime.fromtimestamp(base + 2 * day - 1, tz=UTC).isoformat()  # microseconds: a second early
    assert selected(since=iso) == {"c", "d"}
    assert selected(tenant="nobody") == set()


async def test_chunks_and_group_order(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    store = await b.open_store(path)
    groups = ["g2", "g1", None, "g2", "g1"]
    made = [await b.agent_trajectory(store, f"q{i}", group=g) for i, g in enumerate(groups)]
    await store.close()
    whole = rows_of(path)
    assert rows_of(path, chunk_size=2) == whole == rows_of(path, chunk_size=1)
    assert [r["trajectory_id"] for r in whole[::2]] == made  # id order by default
    grouped = [r["group_id"] for r in rows_of(path, by_group=True, chunk_size=2)[::2]]
    # One group's rows together (a trajectory without a group is its own), ordered by group id.
    assert grouped == sorted(grouped, key=lambda g: g or made[2])
    assert [g for i, g in enumerate(grouped) if i == 0 or grouped[i - 1] != g] == [None, "g1", "g2"]


async def test_outputs_are_replaced_only_when_asked_and_only_once_complete(agent_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    out.write_text("old\n")
    with open_readonly(agent_store) as conn:
        with pytest.raises(ExportError, match="already exists"):
            export(conn, Filters(), out, fmt="chat-jsonl", options=ExportOptions(), redactor=Redactor())
        assert out.read_text() == "old\n"
        export(conn, Filters(), out, fmt="chat-jsonl", options=ExportOptions(), redactor=Redactor(), overwrite=True)
        assert len(read_jsonl(out)) == 4
        with pytest.raises(ExportError, match="does not exist"):
            export(conn, Filters(), tmp_path / "missing" / "x.jsonl", fmt="chat-jsonl", options=ExportOptions(),
                   redactor=Redactor())
        with pytest.raises(ExportError, match="no trajectories match"):
            export(conn, Filters(task="nope"), tmp_path / "y.jsonl", fmt="chat-jsonl", options=ExportOptions(),
                   redactor=Redactor())
    assert not (tmp_path / "y.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.db", "rows.jsonl"]


async def test_worker_processes_write_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    store = await b.open_store(path)
    for i in range(7):
        await b.agent_trajectory(store, f"q{i} from bob{i}@example.com" if i % 3 == 0 else f"q{i}")
    await store.close()
    outputs = {}
    for jobs in (1, 2):
        out = tmp_path / f"rows-{jobs}.jsonl"
        with open_readonly(path) as conn:
            result = export(conn, Filters(), out, fmt="chat-jsonl", options=ExportOptions(jobs=jobs, chunk_size=2),
                            redactor=Redactor())
        outputs[jobs] = (out.read_bytes(), result.rows, result.redacted_rows)
    assert outputs[1] == outputs[2] and outputs[1][1:] == (14, 6)
    assert b.side_files(path) == []


async def test_the_ids_filter_selects_exactly_those_trajectories(tmp_path: Path) -> None:
    path = tmp_path / "ids.db"
    store = await b.open_store(path)
    first = await b.agent_trajectory(store, "What is 2+2?")
    second = await b.agent_trajectory(store, "What is 3+3?")
    await b.agent_trajectory(store, "What is 4+4?")
    await store.close()
    assert {r["trajectory_id"] for r in rows_of(path, Filters(ids=(first, second)))} == {first, second}
    assert rows_of(path, Filters(ids=())) == []  # none asked for: none, not all
    assert "ids" not in Filters.names()  # the Python API's alone: no replay command has such a flag
