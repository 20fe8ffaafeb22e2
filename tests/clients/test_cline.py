"""The real Cline CLI (npm ``cline``, pinned in scripts/install-clients.sh) against a real gateway.

Cline speaks chat completions to an "OpenAI Compatible" provider: ``cline auth`` points it at the
gateway, then ``cline --json`` runs one task headless. The scripted model behind the gateway asks for
one shell command through Cline's ``run_commands`` tool and then finishes; the test checks the command
really ran, Cline reported a completed run, and the gateway stitched the whole task into one
trajectory (Cline sends no session id: stitching is by the conversation itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clients.scripted_upstream import CALL_ID, FINAL_TEXT, ScriptedUpstream
from tests.clients.support import (
    assert_marker,
    client_env,
    cline_run_argv,
    configure_cline,
    json_lines,
    recorded_session,
    require_cli,
    run_cli,
    stack,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "stand-in-model"
MARKER = "cline-was-here"
COMMAND = f"echo {MARKER} > marker.txt"
PROMPT = f"Create marker.txt by running this shell command: {COMMAND}"


def test_cline_runs_a_command_through_the_gateway(tmp_path: Path) -> None:
    cline = require_cli("cline")
    upstream = ScriptedUpstream(COMMAND, model=MODEL)
    work = tmp_path / "work"
    work.mkdir()
    data = tmp_path / "cline-data"
    with stack(upstream, tmp_path / "gateway") as s:
        env = client_env(tmp_path / "home", s.proxy)
        configure_cline(cline, data, s.gateway.url + "/v1", MODEL, env, work)

        done = run_cli(cline_run_argv(cline, data, work, PROMPT), cwd=work, env=env, timeout=180)
        explain = s.explain(done)

        assert_marker(work, MARKER, explain)

        # Cline asked for the command with its own tool and finished with the scripted answer.
        assert upstream.errors == [], explain
        assert len(upstream.calls) == 2, explain
        first_tools = {t["function"]["name"] for t in upstream.calls[0].get("tools") or []}
        assert "run_commands" in first_tools, first_tools
        assert upstream.answers[0]["tool_calls"][0]["function"]["name"] == "run_commands"
        assert json.loads(upstream.answers[0]["tool_calls"][0]["function"]["arguments"]) == {"commands": [COMMAND]}

        events = json_lines(done.stdout)
        assert events and events[-1].get("type") == "run_result", f"no run_result at the end\n{explain}"
        result = events[-1]
        assert result.get("finishReason") == "completed", explain
        assert (result.get("text") or "").strip() == FINAL_TEXT, explain
        tool_ends = [e["event"] for e in events if e.get("type") == "agent_event"
                     and e["event"].get("type") == "content_end" and e["event"].get("contentType") == "tool"]
        assert [e.get("toolCallId") for e in tool_ends] == [CALL_ID], explain
        assert done.returncode == 0, explain

        # The gateway recorded the task as one trajectory, each call extending the last.
        traj = recorded_session(s.gateway.db, len(upstream.calls), CALL_ID, PROMPT, FINAL_TEXT)
        # Cline names no session: the conversation itself stitched it.
        assert (traj["session_key"] or "").startswith("prefix:"), traj["session_key"]

    # Nothing left this machine: every off-machine attempt went to the refusing proxy (telemetry only).
    unexpected = [a for a in s.proxy.attempts if "cline.bot" not in a]
    assert unexpected == [], unexpected
