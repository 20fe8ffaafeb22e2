"""Human approval through a real gateway: a bot conversation (and a background run) pauses on write_file, is
approved or denied through the admin routes or the command line, and goes on, also after a restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.gateway.bot.support import Receiver, bot_gateway
from tests.processes import ROOT
from tests.scripted import call
from tests.standin import ServerThread

pytestmark = pytest.mark.integration

WRITE = call("write_file", {"path": "notes.txt", "content": "remember the milk"}, "call_w")


def _ask(gw, hook_url: str, text: str = "Please note: remember the milk.") -> dict:
    accepted = gw.post("/bot/v1/messages", {"conversation_id": "c-1", "user_id": "u-1", "text": text,
                                            "callback_url": hook_url + "/hook"})
    assert accepted.status_code == 202, accepted.text
    return accepted.json()


def _pending(gw, count: int = 1) -> list[dict]:
    deadline = time.monotonic() + 10
    while len(rows := gw.admin("GET", "/admin/approvals").json()["data"]) < count:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return rows


def _harness(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "harness.main", "approvals", *args, "--config",
                           str(tmp_path / "h.toml")], capture_output=True, text=True, env=env, timeout=120)


def test_a_write_waits_for_approval_then_runs_and_the_reply_is_delivered(tmp_path) -> None:
    receiver = Receiver()
    with ServerThread(receiver.app) as hook, bot_gateway(tmp_path, [WRITE, "Noted in notes.txt."]) as gw:
        message = _ask(gw, hook.url)
        assert message["status"] == "pending_approval" and message["harness"]["status"] == "pending_approval"
        [held] = _pending(gw)
        assert (held["tool"], held["arguments"], held["status"], held["profile"]) == (
            "write_file", {"path": "notes.txt", "content": "remember the milk"}, "pending", "helper")
        assert not (tmp_path / "ws" / "notes.txt").exists()
        assert len(gw.backend.requests) == 1
        # a new message meanwhile is told why nothing happens, and is not added to the run
        waiting = gw.post("/bot/v1/messages", {"conversation_id": "c-1", "user_id": "u-1", "text": "done yet?"})
        assert waiting.status_code == 200 and "waiting for a person to approve write_file" in waiting.json()["reply"]
        run = gw.get(f"/bot/v1/messages/{message['id']}").json()
        assert run["status"] == "pending_approval"

        approved = gw.admin("POST", f"/admin/approvals/{held['id']}/approve", json={"by": "ops"})
        assert approved.status_code == 200 and approved.json()["status"] == "approved"
        again = gw.admin("POST", f"/admin/approvals/{held['id']}/deny")
        assert again.status_code == 409 and "already approved" in again.json()["error"]["message"]
        receiver.wait(1)
        delivered = orjson.loads(receiver.requests[0][1])
        assert (delivered["id"], delivered["reply"]) == (message["id"], "Noted in notes.txt.")
        assert (tmp_path / "ws" / "notes.txt").read_text() == "remember the milk"
        # the model saw the tool's real result
        assert gw.backend.requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_w",
                                                          "content": "wrote 17 bytes to notes.txt"}
        assert gw.admin("GET", "/admin/approvals").json()["data"] == []
        assert gw.admin("GET", "/admin/approvals?status=approved").json()["data"][0]["decided_by"] == "ops"
        assert gw.admin("GET", "/admin/approvals?status=bogus").status_code == 400
        assert gw.admin("POST", "/admin/approvals/nope/approve").status_code == 404
        assert gw.admin("POST", f"/admin/approvals/{held['id']}/maybe").status_code == 404
        for body, why in ((b"[1]", "only 'reason' and 'by'"), (b"{\"why\": 1}", "only 'reason' and 'by'"),
                          (b"{\"reason\": 5}", "'reason' must be a string"), (b"{oops", "not valid JSON")):
            refused = gw.admin("POST", f"/admin/approvals/{held['id']}/deny", content=body)
            assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text
        assert httpx.get(gw.url + "/admin/approvals").status_code == 401


def test_a_denial_reaches_the_model_as_a_tool_result(tmp_path) -> None:
    receiver = Receiver()
    with ServerThread(receiver.app) as hook, \
            bot_gateway(tmp_path, [WRITE, "Understood, I did not write it."]) as gw:
        _ask(gw, hook.url)
        [held] = _pending(gw)
        denied = gw.admin("POST", f"/admin/approvals/{held['id']}/deny", json={"reason": "use the wiki instead"})
        assert denied.status_code == 200 and denied.json()["reason"] == "use the wiki instead"
        receiver.wait(1)
        assert orjson.loads(receiver.requests[0][1])["reply"] == "Understood, I did not write it."
        note = gw.backend.requests[1]["messages"][-1]
        assert note["role"] == "tool" and "did not allow this call to write_file (use the wiki instead)" in note[
            "content"]
        assert not (tmp_path / "ws" / "notes.txt").exists()


def test_a_pending_approval_survives_a_restart_and_is_decided_from_the_command_line(tmp_path) -> None:
    receiver = Receiver()
    with ServerThread(receiver.app) as hook:
        with bot_gateway(tmp_path, [WRITE]) as gw:
            message = _ask(gw, hook.url)
            [held] = _pending(gw)
        listed = _harness(tmp_path, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [r["id"] for r in orjson.loads(listed.stdout)] == [held["id"]]
        with bot_gateway(tmp_path, ["Noted after the restart."]) as gw:
            assert _pending(gw)[0]["id"] == held["id"]
            decided = _harness(tmp_path, "approve", held["id"])
            assert decided.returncode == 0 and "approved write_file" in decided.stdout, decided.stderr
            receiver.wait(1)  # the new gateway's sweep carried the run on
            delivered = orjson.loads(receiver.requests[0][1])
            assert (delivered["id"], delivered["reply"]) == (message["id"], "Noted after the restart.")
            assert (tmp_path / "ws" / "notes.txt").exists()
        again = _harness(tmp_path, "deny", held["id"])
        assert again.returncode == 1 and "already approved" in again.stderr


def test_an_approval_nobody_gives_expires_and_the_run_goes_on(tmp_path) -> None:
    receiver = Receiver()
    with ServerThread(receiver.app) as hook, \
            bot_gateway(tmp_path, [WRITE, "Nobody approved, so I did not write it."],
                        env={"HARNESS_TOOLS__APPROVAL_EXPIRY_SECONDS": "0.5"}) as gw:
        _ask(gw, hook.url)
        receiver.wait(1)
        assert orjson.loads(receiver.requests[0][1])["reply"] == "Nobody approved, so I did not write it."
        assert "in time" in gw.backend.requests[1]["messages"][-1]["content"]
        [expired] = gw.admin("GET", "/admin/approvals?status=expired").json()["data"]
        assert gw.admin("POST", f"/admin/approvals/{expired['id']}/approve").status_code == 409


def test_background_runs_pause_for_approval_too(tmp_path) -> None:
    with bot_gateway(tmp_path, [WRITE, "Written."]) as gw:
        created = httpx.post(gw.url + "/v1/agent/runs", json={"profile": "helper", "input": "note the milk"})
        run_id = created.json()["id"]
        deadline = time.monotonic() + 10
        while (run := httpx.get(f"{gw.url}/v1/agent/runs/{run_id}").json())["status"] != "pending_approval":
            assert time.monotonic() < deadline, run
            time.sleep(0.02)
        assert [a["tool"] for a in run["approvals"]] == ["write_file"]
        gw.admin("POST", f"/admin/approvals/{run['approvals'][0]['id']}/approve")
        while (run := httpx.get(f"{gw.url}/v1/agent/runs/{run_id}").json())["status"] != "completed":
            assert time.monotonic() < deadline, run
            time.sleep(0.02)
        assert run["output"] == "Written." and run["approvals"] == []
