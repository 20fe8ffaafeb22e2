"""The real Codex CLI (npm ``@openai/codex``, pinned in scripts/install-clients.sh) against a real gateway.

Codex speaks only the Responses API (``wire_api = "responses"``): a custom provider in
``$CODEX_HOME/config.toml`` points it at the gateway's ``/v1``, and ``codex exec`` runs one task
headless. The gateway translates each ``POST /v1/responses`` into chat completions for the scripted
model, which asks for one shell command through Codex's ``exec_command`` tool and then finishes. The
test checks the command really ran, Codex exited 0 with the scripted answer, and the gateway stitched
the task into one trajectory keyed by Codex's session id (``prompt_cache_key``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clients.scripted_upstream import CALL_ID, FINAL_TEXT, ScriptedUpstream
from tests.clients.support import (
    assert_marker,
    client_env,
    codex_exec_argv,
    codex_home,
    documented_catalog,
    json_lines,
    recorded_session,
    require_cli,
    run_cli,
    stack,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "stand-in-model"
MARKER = "codex-was-here"
COMMAND = f"echo {MARKER} > marker.txt"
PROMPT = f"Create marker.txt by running this shell command: {COMMAND}"


@pytest.mark.parametrize("documented", [False, True], ids=["codex-catalog", "documented-catalog"])
def test_codex_runs_a_command_through_the_gateway(tmp_path: Path, documented: bool) -> None:
    codex = require_cli("codex")
    upstream = ScriptedUpstream(COMMAND, model=MODEL)
    work = tmp_path / "work"
    work.mkdir()
    catalog, entry = documented_catalog(tmp_path, MODEL) if documented else (None, None)
    with stack(upstream, tmp_path / "gateway") as s:
        home = codex_home(tmp_path / "codex-home", s.gateway.url + "/v1", MODEL, catalog)
        env = client_env(tmp_path / "home", s.proxy, CODEX_HOME=str(home), HARNESS_API_KEY="sk-test")

        done = run_cli(codex_exec_argv(codex, work, PROMPT), cwd=work, env=env, timeout=180)
        explain = s.explain(done)

        assert_marker(work, MARKER, explain)

        # Codex asked for the command with exec_command and ended with the scripted answer.
        assert upstream.errors == [], explain
        assert len(upstream.calls) == 2, explain
        first_tools = {t["function"]["name"] for t in upstream.calls[0].get("tools") or []
                       if t.get("type") == "function"}
        assert "exec_command" in first_tools, first_tools
        if entry is not None:
            # Codex read the catalog: its instructions open the conversation, its freeform apply_patch is offered.
            assert entry["base_instructions"] in json.dumps(upstream.calls[0]["messages"]), explain
            assert "apply_patch" in first_tools, first_tools
        call = upstream.answers[0]["tool_calls"][0]["function"]
        assert (call["name"], json.loads(call["arguments"])) == ("exec_command", {"cmd": COMMAND})
        assert done.returncode == 0, explain

        events = json_lines(done.stdout)
        thread = next((e.get("thread_id") for e in events if e.get("type") == "thread.started"), None)
        assert thread, f"no thread.started event\n{explain}"
        items = [e["item"] for e in events if e.get("type") == "item.completed"]
        commands = [i for i in items if i.get("type") == "command_execution"]
        assert len(commands) == 1 and commands[0].get("exit_code") == 0, explain
        assert COMMAND in commands[0].get("command", ""), commands
        messages = [i.get("text", "").strip() for i in items if i.get("type") == "agent_message"]
        assert messages[-1:] == [FINAL_TEXT], explain
        assert any(e.get("type") == "turn.completed" for e in events), explain
        assert not any(e.get("type") in ("turn.failed", "error") for e in events), explain

        # One trajectory for the session, stitched by Codex's session id, holding every turn's call.
        traj = recorded_session(s.gateway.db, len(upstream.calls), CALL_ID, PROMPT, FINAL_TEXT)
        assert thread in (traj["session_key"] or ""), (thread, traj["session_key"])
        # The command's output came back as the tool result the model saw.
        result = next(m for m in traj["calls"][-1]["messages"] if m.get("role") == "tool")
        assert "exited with code 0" in json.dumps(result), result

    assert s.proxy.attempts == [], f"Codex tried to leave the machine: {s.proxy.attempts}"
