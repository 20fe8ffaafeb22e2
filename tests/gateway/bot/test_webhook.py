"""The signed JSON webhook on a real gateway (loopback port, SQLite file), with a scripted stand-in model."""

from __future__ import annotations

import sqlite3
import time

import httpx
import orjson
import pytest

from gateway.bot.signing import signed_headers, verify
from tests.gateway.bot.support import SECRET, Receiver, bot_gateway
from tests.standin import ServerThread

pytestmark = pytest.mark.integration


def _message(text: str, conversation: str = "c-1", **extra: str) -> dict[str, str]:
    return {"conversation_id": conversation, "user_id": "u-1", "text": text, **extra}


def test_a_conversation_is_one_trajectory_answered_in_the_response(tmp_path) -> None:
    with bot_gateway(tmp_path, ["Hello! How can I help?", "You said your name is Ada."]) as gw:
        first = gw.post("/bot/v1/messages", _message("Hi, I am Ada."))
        assert first.status_code == 200, first.text
        body = first.json()
        assert (body["conversation_id"], body["reply"], body["status"]) == ("c-1", "Hello! How can I help?",
                                                                            "delivered")
        trajectory = body["harness"]["trajectory_id"]
        assert body["harness"]["status"] == "completed"
        second = gw.post("/bot/v1/messages", _message("What is my name?")).json()
        assert second["reply"] == "You said your name is Ada."
        assert second["harness"]["trajectory_id"] == trajectory  # the same run, grown
        # the model saw the whole conversation
        assert [(m["role"], m["content"]) for m in gw.backend.requests[1]["messages"]] == [
            ("system", "You help."), ("user", "Hi, I am Ada."), ("assistant", "Hello! How can I help?"),
            ("user", "What is my name?")]
        other = gw.post("/bot/v1/messages", _message("Hi", conversation="c-2")).json()
        assert other["harness"]["trajectory_id"] != trajectory
        polled = gw.get(f"/bot/v1/messages/{second['id']}").json()
        assert (polled["status"], polled["reply"]) == ("delivered", "You said your name is Ada.")
    db = sqlite3.connect(tmp_path / "h.db")
    source, tenant, status, meta = db.execute("SELECT source, tenant, status, metadata FROM trajectories WHERE id = ?",
                                              (trajectory,)).fetchone()
    assert (source, tenant, status) == ("bot", "bot", "completed")
    assert orjson.loads(meta)["bot"] == {"platform": "webhook", "conversation_id": "c-1", "user_id": "u-1"}
    assert db.execute("SELECT COUNT(*) FROM model_calls WHERE trajectory_id = ?", (trajectory,)).fetchone() == (2,)
    events = [s for (s,) in db.execute("SELECT state FROM events WHERE trajectory_id = ? ORDER BY id", (trajectory,))]
    assert events.count("USER_TURN") == 2


def test_bad_signatures_stale_timestamps_and_replayed_nonces_are_refused_also_after_a_restart(tmp_path) -> None:
    raw = orjson.dumps(_message("hello"))
    with bot_gateway(tmp_path, ["hi"] * 5) as gw:
        url = gw.url + "/bot/v1/messages"
        good = signed_headers(SECRET.encode(), raw, time.time(), nonce="nonce-1")
        forged = signed_headers(b"not the secret", raw, time.time())
        stale = signed_headers(SECRET.encode(), raw, time.time() - 301)
        for headers, why in ((forged, "does not match"), (stale, "more than 300 s"), ({}, "need the headers")):
            refused = httpx.post(url, content=raw, headers=headers)
            assert refused.status_code == 401 and why in refused.json()["error"]["message"], refused.text
        tampered = httpx.post(url, content=raw.replace(b"hello", b"HELLO"), headers=good)
        assert tampered.status_code == 401
        assert httpx.post(url, content=raw, headers=good, timeout=30).status_code == 200
        replay = httpx.post(url, content=raw, headers=good)
        assert replay.status_code == 401 and replay.json()["error"]["code"] == "replayed_nonce"
        assert len(gw.backend.requests) == 1  # nothing refused reached the model
    with bot_gateway(tmp_path, ["hi"]) as gw:
        replay = httpx.post(gw.url + "/bot/v1/messages", content=raw, headers=good)
        assert replay.status_code == 401 and replay.json()["error"]["code"] == "replayed_nonce"
        assert gw.backend.requests == []


def test_a_slow_reply_is_202_then_a_signed_callback_retried_until_the_receiver_recovers(tmp_path) -> None:
    receiver = Receiver(failures=2)
    with ServerThread(receiver.app) as hook, \
            bot_gateway(tmp_path, ["Here is the slow answer."], sync=0.2, delay=0.6) as gw:
        accepted = gw.post("/bot/v1/messages", _message("Take your time.", callback_url=hook.url + "/hook"))
        assert accepted.status_code == 202, accepted.text
        body = accepted.json()
        assert body["status"] == "running" and body["poll"] == f"/bot/v1/messages/{body['id']}"
        assert body["run_id"] and body["reply"] is None  # the run is under way: the trajectory it grows
        receiver.wait(3)
        headers, payload = receiver.requests[-1]
        # the receiver can check the callback is ours
        verify(SECRET.encode(), headers, payload, time.time(), 300)
        delivered = orjson.loads(payload)
        assert (delivered["id"], delivered["reply"], delivered["conversation_id"], delivered["run_id"]) == (
            body["id"], "Here is the slow answer.", "c-1", body["run_id"])
        assert delivered["harness"]["status"] == "completed"
        assert len({h["x-harness-nonce"] for h, _ in receiver.requests}) == 3  # each try signed afresh
        deadline = time.monotonic() + 5
        while (polled := gw.get(body["poll"]).json())["status"] != "delivered":
            assert time.monotonic() < deadline, polled
            time.sleep(0.05)
        assert polled["reply"] == "Here is the slow answer."
    db = sqlite3.connect(tmp_path / "h.db")
    assert db.execute("SELECT attempts, error FROM bot_messages").fetchone() == (3, None)


def test_without_a_callback_the_reply_is_polled(tmp_path) -> None:
    with bot_gateway(tmp_path, ["Polled answer."], sync=0.1, delay=0.5) as gw:
        accepted = gw.post("/bot/v1/messages", _message("hello"))
        assert accepted.status_code == 202
        first = gw.get(accepted.json()["poll"]).json()
        assert (first["status"], first["reply"]) == ("running", None)
        deadline = time.monotonic() + 10
        while (polled := gw.get(accepted.json()["poll"]).json())["reply"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (polled["status"], polled["reply"]) == ("delivered", "Polled answer.")
    assert sqlite3.connect(tmp_path / "h.db").execute("SELECT status FROM bot_messages").fetchone() == ("delivered",)


def test_callbacks_must_pass_the_ssrf_guard_unless_allow_listed(tmp_path) -> None:
    with bot_gateway(tmp_path, ["hi"], extra='callback_allow_hosts = ["hooks.example"]') as gw:
        gw.app.state.gateway.bot.platforms["webhook"].guard._networks = []  # no loopback allowance
        for url, why in (("http://127.0.0.1:9/hook", "loopback"), ("http://169.254.169.254/latest", "metadata"),
                         ("file:///etc/passwd", "only http and https")):
            refused = gw.post("/bot/v1/messages", _message("hi", callback_url=url))
            assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text
        assert gw.backend.requests == []


def test_bad_messages_get_clear_errors(tmp_path) -> None:
    with bot_gateway(tmp_path, []) as gw:
        cases = [({"conversation_id": "c", "user_id": "u"}, "text"), ({"user_id": "u", "text": "x"}, "conversation_id"),
                 ({**_message("x"), "extra": 1}, "extra"), ([1, 2], None)]
        for body, param in cases:
            refused = gw.post("/bot/v1/messages", body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert gw.get("/bot/v1/messages/nope").status_code == 404


def test_too_many_messages_from_one_user_get_a_clear_429(tmp_path) -> None:
    with bot_gateway(tmp_path, ["one", "two", "three"], rate=2) as gw:
        assert [gw.post("/bot/v1/messages", _message(f"m{i}")).status_code for i in range(2)] == [200, 200]
        limited = gw.post("/bot/v1/messages", _message("m3"))
        assert limited.status_code == 429
        assert "at most 2 every 60 s" in limited.json()["error"]["message"]
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        other_user = gw.post("/bot/v1/messages", {**_message("hi"), "user_id": "u-2"})
        assert other_user.status_code == 200


def test_a_reaction_becomes_feedback_on_the_reply_model_call(tmp_path) -> None:
    with bot_gateway(tmp_path, ["first", "second"]) as gw:
        gw.post("/bot/v1/messages", _message("a"))
        second = gw.post("/bot/v1/messages", _message("b")).json()
        reacted = gw.post("/bot/v1/reactions", {"message_id": second["id"], "rating": "down",
                                                "comment": "wrong answer"})
        assert reacted.status_code == 201, reacted.text
        assert gw.post("/bot/v1/reactions", {"message_id": "nope", "rating": "up"}).status_code == 404
        assert gw.post("/bot/v1/reactions", {"message_id": second["id"], "rating": "meh"}).status_code == 400
    db = sqlite3.connect(tmp_path / "h.db")
    rows = db.execute("SELECT trajectory_id, source, name, value, label, comment, model_call_seq FROM feedback "
                      "WHERE source = 'user'").fetchall()
    assert rows == [(second["harness"]["trajectory_id"], "user", "thumbs", 0.0, "down", "wrong answer", 1)]


def test_the_webhook_says_when_it_is_not_configured(tmp_path) -> None:
    with bot_gateway(tmp_path, [], env={"HARNESS_BOT_SECRET": ""}) as gw:
        refused = gw.post("/bot/v1/messages", _message("hi"))
        assert refused.status_code == 404 and "HARNESS_BOT_SECRET" in refused.json()["error"]["message"]


def test_messages_cut_off_by_a_restart_are_answered_after_it(tmp_path) -> None:
    receiver = Receiver()
    with ServerThread(receiver.app) as hook:
        with bot_gateway(tmp_path, ["never sent"], sync=0.1, delay=30) as gw:
            hook_url = hook.url + "/hook"
            first = gw.post("/bot/v1/messages", _message("first", callback_url=hook_url)).json()
            second = gw.post("/bot/v1/messages", _message("second", callback_url=hook_url)).json()
            deadline = time.monotonic() + 5
            while not gw.backend.requests:  # the first turn is with the model; the second waits its turn
                assert time.monotonic() < deadline
                time.sleep(0.02)
        db = sqlite3.connect(tmp_path / "h.db")
        assert db.execute("SELECT status FROM bot_messages ORDER BY created_at").fetchall() == [
            ("running",), ("queued",)]
        assert second["status"] == "queued" and second["run_id"] == first["run_id"]  # the run it will join
        with bot_gateway(tmp_path, ["answer to first", "answer to second"]) as gw:
            receiver.wait(2)
            replies = {orjson.loads(body)["id"]: orjson.loads(body)["reply"] for _, body in receiver.requests}
            assert replies == {first["id"]: "answer to first", second["id"]: "answer to second"}
            # one conversation, one trajectory, in order
            assert [m["content"] for m in gw.backend.requests[1]["messages"] if m["role"] != "system"] == [
                "first", "answer to first", "second"]
    assert db.execute("SELECT status FROM bot_messages").fetchall() == [("delivered",), ("delivered",)]


def test_a_long_conversation_is_kept_inside_its_budget_by_summaries(tmp_path) -> None:
    from gateway.agent.context import SUMMARY_INSTRUCTIONS, SUMMARY_PREFIX, approximate_tokens

    def respond(body: dict) -> str:
        if body["messages"][0]["content"] == SUMMARY_INSTRUCTIONS:
            return "The user described their week, day by day."
        return "Noted: " + body["messages"][-1]["content"][:40]

    budget = 300
    with bot_gateway(tmp_path, [respond] * 30, env={"HARNESS_PROFILES__0__CONTEXT_BUDGET_TOKENS": str(budget),
                                                    "HARNESS_PROFILES__0__KEEP_LAST_TURNS": "1"}) as gw:
        runs = {gw.post("/bot/v1/messages", _message(f"Day {day}: " + "busy with meetings and reviews. " * 12)
                        ).json()["harness"]["trajectory_id"] for day in range(1, 7)}
        answers = [r for r in gw.backend.requests if r["messages"][0]["content"] != SUMMARY_INSTRUCTIONS]
    assert len(runs) == 1  # one conversation, one trajectory, however long
    assert len(answers) == 6 and len(gw.backend.requests) > 6  # summaries were made along the way
    last = answers[-1]["messages"]
    assert any(m["content"].startswith(SUMMARY_PREFIX + "The user described") for m in last if m["role"] == "user")
    assert last[-1]["content"].startswith("Day 6:")
    # the whole talk is well past the budget, each answer's context stayed near it (the last turn is kept whole)
    assert approximate_tokens([r["messages"][-1] for r in answers]) > 1.5 * budget
    assert max(approximate_tokens(r["messages"]) for r in answers) < 1.5 * budget
    db = sqlite3.connect(tmp_path / "h.db")
    purposes = [orjson.loads(p)["purpose"] for (p,) in db.execute("SELECT params FROM model_calls ORDER BY seq")]
    assert purposes.count("summary") >= 1 and purposes.count("step") == 6


def test_a_conversation_whose_profile_was_removed_starts_afresh(tmp_path) -> None:
    with bot_gateway(tmp_path, ["first answer"]) as gw:
        before = gw.post("/bot/v1/messages", _message("hello")).json()["harness"]["trajectory_id"]
    renamed = {"HARNESS_PROFILES__0__NAME": "helper2", "HARNESS_BOT__PROFILE": "helper2"}
    with bot_gateway(tmp_path, ["fresh answer"], env=renamed) as gw:
        again = gw.post("/bot/v1/messages", _message("hello again")).json()
        assert again["reply"] == "fresh answer" and again["harness"]["trajectory_id"] != before
        assert [m["role"] for m in gw.backend.requests[0]["messages"]] == ["system", "user"]
