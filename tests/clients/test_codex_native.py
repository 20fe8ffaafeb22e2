"""The real Codex CLI (pinned in scripts/install-clients.sh) through a real gateway to a Responses-native upstream
(``kind = "openai-responses"``, a stand-in that answers with encrypted reasoning), and Codex compacting a session
that outgrew its context, on that upstream and on a chat backend.

Each run is one ``codex exec`` task: the model reasons, asks for one shell command, and finishes. The gateway
passes Codex's requests through as they came; the reasoning item Codex was answered comes back to the upstream in
the next request exactly as it was made. A session long enough to compact (the first answer reports more tokens
than the model catalog's compaction limit) compacts once and is still one trajectory.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.clients.scripted_upstream import SUMMARY_TEXT, ScriptedUpstream
from tests.clients.support import (
    assert_marker,
    client_env,
    codex_exec_argv,
    codex_home,
    documented_catalog,
    json_lines,
    require_cli,
    run_cli,
    stack,
    wait_for_calls,
)
from tests.processes import harness_cli
from tests.standins.responses import FINAL_TEXT, SUMMARY, ResponsesUpstream, encrypted

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "stand-in-model"
MARKER = "codex-native-was-here"
COMMAND = f"echo {MARKER} > marker.txt"
PROMPT = f"Create marker.txt by running this shell command: {COMMAND}"
def _run(tmp_path: Path, upstream, *, kind: str, provider_name: str = "agent-harness gateway"):
    codex = require_cli("codex")
    work = tmp_path / "work"
    work.mkdir()
    with stack(upstream, tmp_path / "gateway", kind=kind) as s:
        catalog, _ = documented_catalog(tmp_path, MODEL)
        home = codex_home(tmp_path / "codex-home", s.gateway.url + "/v1", MODEL, catalog, provider_name)
        env = client_env(tmp_path / "home", s.proxy, CODEX_HOME=str(home), HARNESS_API_KEY="sk-test")
        done = run_cli(codex_exec_argv(codex, work, PROMPT), cwd=work, env=env, timeout=200)
        explain = s.explain(done)
        assert_marker(work, MARKER, explain)
        assert done.returncode == 0, explain
        events = json_lines(done.stdout)
        assert not any(e.get("type") in ("turn.failed", "error") for e in events), explain
        store = wait_for_calls(s.gateway.db, len(upstream.calls))
        assert s.proxy.attempts == [], f"Codex tried to leave the machine: {s.proxy.attempts}"
        return events, store, s.gateway, explain


def _natives(db: Path) -> list[tuple[str, str | None]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT trajectory_id, native_api FROM model_calls ORDER BY created_at").fetchall()
    finally:
        conn.close()


def test_codex_through_the_gateway_to_a_native_upstream_keeps_reasoning_whole(tmp_path: Path) -> None:
    upstream = ResponsesUpstream(COMMAND)
    events, store, gateway, explain = _run(tmp_path, upstream, kind="openai-responses")
    assert len(upstream.requests) == 2, explain
    first, second = upstream.requests
    assert first["body"]["include"] == ["reasoning.encrypted_content"] and first["body"]["store"] is False
    # The reasoning item Codex was answered comes back to the upstream as it was made: its encrypted content in
    # the bytes the upstream received, the item equal to the one answered (Codex leaves out what is the server's).
    answered = upstream.answers[0]["output"][0]
    assert encrypted(1).encode() in second["raw"], explain
    carried = [i for i in second["body"]["input"] if i.get("type") == "reasoning"]
    assert carried and all(carried[0].get(k) == v for k, v in answered.items() if k != "id"), (carried, answered)
    assert any(i.get("type") == "function_call_output" for i in second["body"]["input"])
    messages = [i.get("text", "").strip() for e in events if e.get("type") == "item.completed"
                for i in [e["item"]] if i.get("type") == "agent_message"]
    assert messages[-1:] == [FINAL_TEXT], explain
    # One trajectory, its calls kept as they came.
    assert [(t["n_calls"], t["session_key"].startswith("cache:")) for t in store] == [(2, True)], store
    assert [api for _, api in _natives(gateway.db)] == ["responses", "responses"]

    # The hosted model's session becomes training rows like any other source's.
    out = tmp_path / "rows.jsonl"
    exported = harness_cli(gateway.config, "replay", "export", "--format", "chat-jsonl", "--output", str(out),
                           "--window", "0")
    assert exported.returncode == 0, exported.stderr
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in row["messages"]][-3:] == ["assistant", "tool", "assistant"], row["messages"]
    assert row["messages"][-1]["content"] == FINAL_TEXT
    assert row["messages"][-3]["tool_calls"][0]["function"]["name"] == "exec_command"
    assert "exec_command" in {t["function"]["name"] for t in row["tools"]}


@pytest.mark.parametrize("provider_name", ["agent-harness gateway", "OpenAI"], ids=["codex-summary", "trigger"])
def test_codex_compacts_a_long_session_on_a_native_upstream(tmp_path: Path, provider_name: str) -> None:
    upstream = ResponsesUpstream(COMMAND, usage_tokens=200_000)
    events, store, _, explain = _run(tmp_path, upstream, kind="openai-responses", provider_name=provider_name)
    bodies = upstream.calls
    if provider_name == "OpenAI":
        compactions = [b for b in bodies if (b.get("input") or [{}])[-1].get("type") == "compaction_trigger"]
        later = [b for b in bodies if any(i.get("type") == "compaction" for i in b.get("input") or ())]
    else:
        compactions = [b for b in bodies if "CONTEXT CHECKPOINT COMPACTION" in json.dumps(b["input"][-1:])]
        later = [b for b in bodies if SUMMARY in json.dumps(b.get("input"))]
    assert len(compactions) == 1 and later, explain
    # The whole session, its compaction and what followed it, is one trajectory.
    assert len(store) == 1 and store[0]["n_calls"] == len(bodies), [(t["id"], t["n_calls"]) for t in store]


def test_codex_compacts_a_long_session_on_a_chat_backend(tmp_path: Path) -> None:
    """A provider Codex takes for OpenAI's compacts with a ``compaction_trigger``: on a chat backend the gateway's
    summarizer answers it with one compaction item, which Codex then carries, and the model is given its summary."""
    upstream = ScriptedUpstream(COMMAND, model=MODEL, first_prompt_tokens=200_000)
    events, store, _, explain = _run(tmp_path, upstream, kind="openai", provider_name="OpenAI")
    summaries = [i for i, c in enumerate(upstream.calls) if not c.get("tools")]
    assert len(summaries) == 1, explain
    later = upstream.calls[summaries[0] + 1:]
    assert later and all(SUMMARY_TEXT in json.dumps(c["messages"]) for c in later), explain
    assert len(store) == 1 and store[0]["n_calls"] == len(upstream.calls), [(t["id"], t["n_calls"]) for t in store]
