"""Held tool calls in the console, in a real browser: an agent run started over the API pauses on a call that
needs approval; the approver sees it with its arguments and the turn that made it, decides, and watches the run go
on live. A tenant's approver sees and decides its tenant's calls alone; other keys may not decide at all. And a run
carried on by one replica is followed live from another sharing its store."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import build_app
from gateway.config import load_settings
from tests.gateway.console.conftest import ADMIN_KEY, Console, serve_console, sign_in
from tests.scripted import ScriptedBackend, call, serve_scripted
from tests.standin import ServerThread

pytestmark = [pytest.mark.integration]

HELD = """
[tools]
require_approval = ["calculator"]
approval_poll_seconds = 0.2
"""
QUESTION = "What is 6*7?"
ANSWER = "The answer is 42."
LIVE_TIMEOUT = 20_000  # ms: the page's wait for the run to end, steps slowed by the script included


def calculate(body: dict[str, Any]) -> dict[str, Any] | str:
    """The scripted model: asked a question, it calls the calculator; given the tool's result, it answers."""
    if body["messages"][-1]["role"] == "user":
        return call("calculator", {"expression": "6*7"})
    return ANSWER


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    yield from serve_console(tmp_path, [calculate] * 20, approvers=("acme",), extra=HELD)


def _headers(console: Console, tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {console.keys[tenant][1]}"}


def _start(console: Console, tenant: str, text: str = QUESTION, profile: str = "calc") -> str:
    created = httpx.post(f"{console.url}/v1/agent/runs", json={"profile": profile, "input": text},
                         headers=_headers(console, tenant), timeout=10)
    assert created.status_code == 201, created.text
    return created.json()["id"]


def _paused(console: Console, tenant: str, text: str = QUESTION) -> tuple[str, str]:
    """A run of ``tenant`` started and paused on its held calculator call: (its id, the approval's id)."""
    run_id = _start(console, tenant, text)
    deadline = time.monotonic() + 10
    while (run := httpx.get(f"{console.url}/v1/agent/runs/{run_id}", headers=_headers(console, tenant),
                            timeout=10).json())["status"] != "pending_approval":
        assert run["status"] == "running" and time.monotonic() < deadline, run
        time.sleep(0.05)
    [held] = run["approvals"]
    return run_id, held["id"]


def _approval(console: Console, approval_id: str) -> tuple[Any, ...]:
    with sqlite3.connect(console.db) as db:
        return db.execute("SELECT status, reason, decided_by FROM approvals WHERE id = ?", (approval_id,)).fetchone()


def _watch_to_the_end(page: Any) -> None:
    """The trajectory page the decision led to follows the run live until it ends (``data-ended`` is set by the
    page's script on the stream's end, never by a reload) and shows it completed."""
    page.wait_for_selector("#timeline[data-ended=true]", timeout=LIVE_TIMEOUT)
    assert page.locator(".timeline-status").get_attribute("data-status") == "completed"


def test_the_admin_approves_a_held_call_and_watches_the_run_finish(console: Console, page) -> None:
    run_id, approval_id = _paused(console, "acme")
    console.backend.delay = 1.5  # the answer after the decision comes slowly: the page is open while it runs
    sign_in(page, console, ADMIN_KEY)
    page.click("nav >> text=Approvals")
    page.wait_for_url("**/ui/approvals")
    item = page.locator(f"#approval-{approval_id}")
    assert item.get_attribute("data-status") == "pending"
    assert item.locator(".tool").first.inner_text() == "calculator"
    assert '"expression": "6*7"' in item.locator("pre.args").inner_text()
    assert "profile calc" in item.inner_text() and "tenant acme" in item.inner_text()
    assert item.locator(f"a[href='/ui/trajectories/{run_id}']").count() == 1
    context = item.locator(".context").inner_text()
    assert QUESTION in context and "calculator" in context  # the user's question, and the turn that made the call
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))

    item.locator(".approve-form input[name=reason]").fill("a harmless sum")
    item.locator(".approve-form button").click()
    page.wait_for_url(f"**/ui/trajectories/{run_id}")
    _watch_to_the_end(page)
    assert navigations == [console.ui(f"/trajectories/{run_id}")]  # the page was not reloaded to see the end
    timeline = page.locator("#timeline").inner_text()
    assert ANSWER in timeline and "42" in page.locator(".tool-call .result").first.inner_text()
    assert _approval(console, approval_id) == ("approved", "a harmless sum", "admin")

    page.goto(console.ui("/approvals?status=approved"))
    decided = page.locator(f"#approval-{approval_id}")
    assert decided.get_attribute("data-status") == "approved"
    assert decided.locator(".decided-by").inner_text() == "admin"
    assert "a harmless sum" in decided.locator(".reason").inner_text()
    assert decided.locator("form").count() == 0  # decided once: no forms left
    page.goto(console.ui("/approvals"))
    assert page.locator("[data-approval]").count() == 0


def test_a_call_denied_from_its_trajectory_is_not_run_and_the_model_is_told_why(console: Console, page) -> None:
    run_id, approval_id = _paused(console, "acme")
    sign_in(page, console, ADMIN_KEY)
    page.goto(console.ui("/approvals"))
    page.click(f"#approval-{approval_id} a[href='/ui/trajectories/{run_id}']")
    page.wait_for_url(f"**/ui/trajectories/{run_id}")
    # the trajectory page shows what it waits on, with the same forms
    item = page.locator(f"#held #approval-{approval_id}")
    assert '"expression": "6*7"' in item.locator("pre.args").inner_text()
    item.locator(".deny-form input[name=reason]").fill("no arithmetic today")
    item.locator(".deny-form button").click()
    page.wait_for_url(f"**/ui/trajectories/{run_id}")
    page.wait_for_selector(".timeline-status[data-status=completed]", timeout=LIVE_TIMEOUT)
    assert page.locator("#held").count() == 0
    tool_call = page.locator(".tool-call").first
    assert tool_call.locator(".status").inner_text() == "denied"
    assert "no arithmetic today" in tool_call.locator(".result").inner_text()
    assert _approval(console, approval_id) == ("denied", "no arithmetic today", "admin")
    told = console.backend.requests[-1]["messages"][-1]
    assert told["role"] == "tool" and "no arithmetic today" in told["content"]
    # deciding again is refused: the page says so, and nothing changes
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    csrf = _csrf(page)
    again = httpx.post(console.ui(f"/approvals/{approval_id}/approve"), data={"csrf": csrf}, cookies=cookies)
    assert again.status_code == 409 and "already denied" in again.text
    assert _approval(console, approval_id) == ("denied", "no arithmetic today", "admin")


def _csrf(page: Any) -> str:
    """The session's form token, as the page's sign-out form carries it."""
    return page.locator("header form input[name=csrf]").get_attribute("value")


def test_a_tenant_approver_sees_and_decides_its_own_tenants_calls_alone(console: Console, page) -> None:
    own_run, own = _paused(console, "acme", "What is 6*7? (acme)")
    other_run, other = _paused(console, "globex", "What is 6*7? (globex)")
    key_id, secret = console.keys["acme"]
    sign_in(page, console, secret)
    assert page.locator("nav >> text=Approvals").count() == 1
    page.goto(console.ui("/approvals"))
    listed = page.locator("[data-approval]")
    assert [listed.nth(i).get_attribute("data-approval") for i in range(listed.count())] == [own]
    assert "(globex)" not in page.locator("#approvals").inner_text()
    page.goto(console.ui("/approvals?status=all"))
    assert page.locator("[data-approval]").count() == 1

    # another tenant's call is as absent as one that never was, to a decision posted by hand too
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    for action in ("approve", "deny"):
        refused = httpx.post(console.ui(f"/approvals/{other}/{action}"), data={"csrf": _csrf(page)},
                             cookies=cookies)
        assert refused.status_code == 404 and "No approval" in refused.text and other in refused.text
    assert _approval(console, other) == ("pending", None, None)

    page.goto(console.ui("/approvals"))
    page.locator(f"#approval-{own} .approve-form button").click()
    page.wait_for_url(f"**/ui/trajectories/{own_run}")
    page.wait_for_selector(".timeline-status[data-status=completed]", timeout=LIVE_TIMEOUT)
    assert _approval(console, own) == ("approved", None, f"{key_id} (acme)")
    assert _approval(console, other) == ("pending", None, None)
    run = httpx.get(f"{console.url}/v1/agent/runs/{other_run}", headers=_headers(console, "globex")).json()
    assert run["status"] == "pending_approval"


def test_a_key_that_is_no_approver_may_not_see_held_calls(console: Console, page) -> None:
    run_id, held = _paused(console, "globex")
    sign_in(page, console, console.keys["globex"][1])
    assert page.locator("nav >> text=Approvals").count() == 0
    cookies, csrf = {c["name"]: c["value"] for c in page.context.cookies()}, _csrf(page)
    response = page.goto(console.ui("/approvals"))
    assert response is not None and response.status == 403
    assert "approvers" in page.locator("[role=alert]").inner_text()
    refused = httpx.post(console.ui(f"/approvals/{held}/approve"), data={"csrf": csrf}, cookies=cookies)
    assert refused.status_code == 403
    assert _approval(console, held) == ("pending", None, None)
    # its own run's page shows the run waiting, but no forms to decide it
    page.goto(console.ui(f"/trajectories/{run_id}"))
    assert page.locator(".timeline-status").get_attribute("data-status") == "pending_approval"
    assert page.locator("#held").count() == 0 and page.locator(".approve-form").count() == 0


# -- a run on another replica ------------------------------------------------------------------------------------


STEPS = 3  # calculator calls before the answer


def counting(body: dict[str, Any]) -> dict[str, Any] | str:
    """Adds one per step: a calculator call for each of the first ``STEPS`` model calls, then the answer."""
    done = sum(m["role"] == "tool" for m in body["messages"])
    if done < STEPS:
        return call("calculator", {"expression": f"{done} + 1"})
    return f"counted to {STEPS}"


@contextmanager
def replica(console: Console, script: list) -> Iterator[Console]:
    """A second gateway on ``console``'s config and store file, as a replica is: its own runs, sweeps and scripted
    model; the store shared."""
    app = build_app(load_settings(console.config, environ={"HARNESS_ADMIN_KEY": ADMIN_KEY}))
    backend = ScriptedBackend(script)
    serve_scripted(app, backend)
    with ServerThread(app, lifespan="on") as server:
        yield Console(server.url, backend, app, console.config, console.db, console.keys)


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[Console]:
    yield from serve_console(tmp_path, [counting] * 10)


def test_a_run_carried_on_by_another_replica_is_followed_live(counted: Console, page) -> None:
    a = counted
    a.backend.delay = 0.8  # each step lands on its own, well apart
    with replica(a, [counting] * 10) as b:
        sign_in(page, b, ADMIN_KEY)
        run_id = _start(a, "acme", "count")
        page.goto(b.ui(f"/trajectories/{run_id}"))
        assert page.locator("#timeline").get_attribute("data-live") is not None
        seen: list[int] = []
        deadline = time.monotonic() + LIVE_TIMEOUT / 1000
        while page.locator("#timeline[data-ended=true]").count() == 0:
            assert time.monotonic() < deadline, seen
            count = page.locator("li.step").count()
            if not seen or seen[-1] != count:
                seen.append(count)
            page.wait_for_timeout(100)
        assert page.locator(".timeline-status").get_attribute("data-status") == "completed"
        assert page.locator("li.step").count() == STEPS + 1
        assert f"counted to {STEPS}" in page.locator("#timeline").inner_text()
        # the steps came in one by one, as A stored them, and A alone ran the model
        assert seen == sorted(seen) and len(seen) >= 3, seen
        assert len(a.backend.requests) == STEPS + 1 and b.backend.requests == []
