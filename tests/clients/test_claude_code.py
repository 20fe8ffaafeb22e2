"""The real Claude Code CLI (npm ``@anthropic-ai/claude-code``, pinned in scripts/install-clients.sh) against a real
gateway, headless (``-p``, ``--output-format stream-json``).

Claude Code speaks the Anthropic Messages API: ``ANTHROPIC_BASE_URL`` points it at the gateway's root, and the
``claude-*`` names it asks for reach a served model through pattern aliases. Its telemetry, error reporting,
auto-updater and other non-essential traffic are off, as its documentation describes; whatever it still tries
beyond loopback is refused by the deny proxy and listed.

* To the scripted model (tests/clients/scripted_upstream.py, through the gateway's translation to chat
  completions): Claude Code runs the ``Bash`` tool the model asks for, which writes a file, and finishes with
  the scripted answer. The session is one trajectory keyed by Claude Code's session id; then ``/compact`` on the
  resumed session sends Claude Code's own summary request, which is labelled a side request and kept out of it.
* To the embedded model, zero configuration: one plain answer, captured as one trajectory.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.clients.scripted_upstream import CALL_ID, FINAL_TEXT, ScriptedUpstream
from tests.clients.support import (
    Completed,
    DenyProxy,
    assert_marker,
    client_env,
    json_lines,
    recorded_session,
    require_cli,
    run_cli,
    stack,
)
from tests.processes import GatewayProcess, harness_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "stand-in-model"
MARKER = "claude-code-was-here"
COMMAND = f"echo {MARKER} > marker.txt"
PROMPT = f"Create marker.txt by running this shell command: {COMMAND}"
OUTPUT_CEILING = 48
ALIASES = f"""
[routing.aliases]
"claude-*" = "{MODEL}"
"""


def claude_env(home: Path, proxy: DenyProxy, base_url: str) -> dict[str, str]:
    return client_env(
        home, proxy, ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY="sk-test",
        # Off, as Claude Code's documentation describes: everything that is not the model's traffic.
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1", DISABLE_BUG_COMMAND="1", CLAUDE_CODE_DISABLE_TERMINAL_TITLE="1",
        CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY="1")


def claude_argv(claude: Path, prompt: str, *extra: str) -> list[str]:
    return [str(claude), "-p", prompt, "--output-format", "stream-json", "--verbose", *extra]


def result_of(done: Completed) -> dict[str, Any]:
    results = [e for e in json_lines(done.stdout) if e.get("type") == "result"]
    assert results, f"no result event\n{done.describe()}"
    return results[-1]


def trajectories(db: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        out = []
        for t in conn.execute("SELECT id, session_key, n_calls FROM trajectories ORDER BY created_at, id"):
            params = [json.loads(p) for (p,) in conn.execute(
                "SELECT params FROM model_calls WHERE trajectory_id = ? ORDER BY seq", (t["id"],))]
            out.append({**dict(t), "params": params})
        return out
    finally:
        conn.close()


def test_claude_code_runs_a_tool_through_the_gateway_as_one_session(tmp_path: Path) -> None:
    claude = require_cli("claude")
    upstream = ScriptedUpstream(COMMAND, model=MODEL)
    work = tmp_path / "work"
    work.mkdir()
    with stack(upstream, tmp_path / "gateway", extra_config=ALIASES) as s:
        env = claude_env(tmp_path / "home", s.proxy, s.gateway.url)
        done = run_cli(claude_argv(claude, PROMPT, "--allowedTools", "Bash"), cwd=work, env=env, timeout=180)
        explain = s.explain(done)

        assert_marker(work, MARKER, explain)
        assert upstream.errors == [], explain
        assert done.returncode == 0, explain
        # Claude Code offered its Bash tool (translated to a chat function tool) and the model used it.
        assert len(upstream.calls) == 2, explain
        call = upstream.answers[0]["tool_calls"][0]["function"]
        assert call["name"] == "Bash" and json.loads(call["arguments"]) == {"command": COMMAND}, call
        result = result_of(done)
        assert result.get("subtype") == "success" and result.get("is_error") is False, explain
        assert result.get("result", "").strip() == FINAL_TEXT, explain
        session = result.get("session_id")
        assert session, explain

        # One trajectory for the session, keyed by Claude Code's session id, holding both turns.
        traj = recorded_session(s.gateway.db, len(upstream.calls), CALL_ID, PROMPT, FINAL_TEXT)
        assert traj["session_key"] == f"claude:{session}", (traj["session_key"], session)
        tool_result = next(m for m in traj["calls"][-1]["messages"] if m.get("role") == "tool")
        assert tool_result["tool_call_id"] == CALL_ID

        # The captured session becomes training rows like any other source's.
        out = tmp_path / "rows.jsonl"
        exported = harness_cli(s.gateway.config, "replay", "export", "--format", "chat-jsonl", "--output", str(out),
                               "--window", "0")
        assert exported.returncode == 0, exported.stderr
        [row] = [json.loads(line) for line in out.read_text().splitlines()]
        roles = [m["role"] for m in row["messages"]]
        assert roles[-3:] == ["assistant", "tool", "assistant"], roles
        assert row["messages"][-1]["content"] == FINAL_TEXT
        assert {t["function"]["name"] for t in row["tools"]} >= {"Bash"}

        # /compact on the resumed session: Claude Code's own summary request, a side request kept apart.
        compact = run_cli(claude_argv(claude, "/compact", "--resume", session), cwd=work, env=env, timeout=180)
        explain = s.explain(compact)
        assert compact.returncode == 0, explain
        assert result_of(compact).get("subtype") == "success", explain
        found = trajectories(s.gateway.db)
        main = [t for t in found if t["session_key"] == f"claude:{session}"]
        side = [t for t in found if t["session_key"] == f"claude:{session}:side"]
        assert [t["n_calls"] for t in main] == [2], found
        purposes = [p.get("purpose") for t in side for p in t["params"]]
        assert purposes and set(purposes) == {"summary"}, found
        assert len(main) + len(side) == len(found) and len(upstream.calls) == 2 + len(purposes), found
        assert all(p.get("api") == "anthropic" for t in found for p in t["params"]), found

    assert s.proxy.attempts == [], f"Claude Code tried to leave the machine: {s.proxy.attempts}"


@pytest.mark.slow
def test_claude_code_gets_a_plain_answer_from_the_embedded_model(tmp_path: Path) -> None:
    claude = require_cli("claude")
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "gateway").mkdir()
    gateway = GatewayProcess('[store]\npath = "harness.db"\n', tmp_path / "gateway")
    with DenyProxy() as proxy:
        gateway.start(timeout=300)
        try:
            env = claude_env(tmp_path / "home", proxy, gateway.url)
            # A 135M model sampled at Claude Code's temperature may not stop soon: a small ceiling keeps each call
            # to seconds.
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(OUTPUT_CEILING)
            done = run_cli(claude_argv(claude, "What is the capital of France? Answer in one word.",
                                       "--tools", ""), cwd=work, env=env, timeout=240)
            explain = f"{done.describe()}\n--- gateway log ---\n{gateway.log.read_text()[-4000:]}"
            result = result_of(done)
            answers = [e["message"] for e in json_lines(done.stdout)
                       if e.get("type") == "assistant" and e["message"].get("model") != "<synthetic>"]
            assert answers and all(block_texts(a) for a in answers), explain
            if done.returncode != 0:
                # The model never stopped within the ceiling, and Claude Code was told so (stop_reason max_tokens)
                # each time: its own verdict, after its retries. Anything else is a failure.
                assert f"exceeded the {OUTPUT_CEILING} output token maximum" in result.get("result", ""), explain
            else:
                assert result.get("subtype") == "success" and result.get("result", "").strip(), explain
            # Every answer Claude Code got is in the session's one trajectory.
            found = trajectories(gateway.db)
            assert [t["session_key"] for t in found] == [f"claude:{result['session_id']}"], found
            assert found[0]["n_calls"] == len(answers), (found, len(answers))
            assert all(p.get("api") == "anthropic" for p in found[0]["params"]), found
        finally:
            gateway.stop()
    assert proxy.attempts == [], f"Claude Code tried to leave the machine: {proxy.attempts}"


def block_texts(message: dict[str, Any]) -> str:
    return "".join(b.get("text", "") for b in message.get("content") or [] if b.get("type") == "text").strip()
