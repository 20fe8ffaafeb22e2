"""The trajectory pages in a real browser, against a real gateway whose model is scripted: finding trajectories by
filter and by full-text search, a run's timeline (an invalid tool call, its validation error, the corrected call),
feedback given from the page as the API stores it, one tenant kept out of another's trajectories, untrusted content
kept inert, and paging by keyset.

One gateway serves every test but the paging one: its trajectories are made once, through the real API (proxy chat
calls with the openai client, agent runs), and the tests only read them or add feedback rows of their own."""

from __future__ import annotations

import datetime as dt
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from tests.gateway.console.conftest import ADMIN_KEY, Console, serve_console, sign_in
from tests.scripted import call

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.integration]

FIX_TASK = "Compute six times seven please"
DIVIDE_TASK = "Divide one by nothing"
STEPS_TASK = "Keep adding forever"
QUOKKA = "Where does the quokka live?"
WEATHER = "What is the weather like in Lisbon?"
PAYLOAD = "<script>window.__pwned=1;alert(1)</script><img src=x onerror=\"window.__pwned=2;alert(2)\">"
XSS_ASK = f"Look this up: {PAYLOAD} zanzibar"
TOOL_PAYLOAD = f"found: {PAYLOAD.replace('1', '3').replace('2', '4')} marrakesh"
LOOKUP = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def brain(body: dict[str, Any]) -> dict[str, Any] | str:
    """The scripted model: what it answers depends on the conversation, so the order of requests does not matter."""
    messages = body["messages"]
    first = next(m["content"] for m in messages if m.get("role") == "user")
    results = [m for m in messages if m.get("role") == "tool"]
    if first == FIX_TASK:  # an invalid call (no 'expression'), then the corrected one, then the answer
        if not results:
            return call("calculator", {"expr": 1})
        return call("calculator", {"expression": "6*7"}) if len(results) == 1 else "The answer is 42."
    if first == DIVIDE_TASK:  # a tool result saying "division by zero"
        return "It cannot be done." if results else call("calculator", {"expression": "1/0"})
    if first == STEPS_TASK:  # stopped by max_steps
        return call("calculator", {"expression": f"{len(results)}+1"})
    if first == XSS_ASK:  # a call returned to the client, whose tool message brings its result
        return "Looked it up." if results else call("lookup", {"q": "x"}, call_id="call_lookup")
    return "Noted."


@dataclass
class World:
    console: Console
    ids: dict[str, str]  # name -> trajectory id

    def tenant_of(self, name: str) -> str:
        return "globex" if name in ("divide", "weather") else "acme"


def _client(console: Console, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=console.url + "/v1", api_key=console.keys[tenant][1], max_retries=0)


def _chat(console: Console, tenant: str, text: str) -> str:
    raw = _client(console, tenant).chat.completions.with_raw_response.create(
        model="scripted-model", messages=[{"role": "user", "content": text}])
    return raw.headers["x-harness-trajectory-id"]


def _run(console: Console, tenant: str, text: str, **limits: int) -> str:
    auth = {"authorization": f"Bearer {console.keys[tenant][1]}"}
    body: dict[str, Any] = {"profile": "calc", "input": text}
    if limits:
        body["limits"] = limits
    created = httpx.post(console.url + "/v1/agent/runs", json=body, headers=auth)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(f"{console.url}/v1/agent/runs/{run_id}", headers=auth).json()["status"] != "running":
            return run_id
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} did not finish")


def _proxy_with_tool_result(console: Console, tenant: str) -> str:
    """A client's own loop through the proxy: the model calls the client's tool, the client sends its result."""
    client = _client(console, tenant)
    ask = [{"role": "user", "content": XSS_ASK}]
    first = client.chat.completions.with_raw_response.create(model="scripted-model", messages=ask, tools=LOOKUP)
    reply = first.parse().choices[0].message.model_dump(exclude_none=True)
    second = client.chat.completions.with_raw_response.create(
        model="scripted-model", tools=LOOKUP,
        messages=[*ask, reply, {"role": "tool", "tool_call_id": "call_lookup", "content": TOOL_PAYLOAD}])
    trajectory_id = first.headers["x-harness-trajectory-id"]
    assert second.headers["x-harness-trajectory-id"] == trajectory_id  # stitched: one conversation
    return trajectory_id


def _sql(console: Console, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
    with sqlite3.connect(console.db) as db:
        db.row_factory = sqlite3.Row
        return db.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    for console in serve_console(tmp_path_factory.mktemp("trajectories"), [brain] * 100):
        ids = {
            "quokka": _chat(console, "acme", QUOKKA),
            "fix": _run(console, "acme", FIX_TASK),
            "divide": _run(console, "globex", DIVIDE_TASK),
            "weather": _chat(console, "globex", WEATHER),
            "xss": _proxy_with_tool_result(console, "acme"),
            "steps": _run(console, "acme", STEPS_TASK, max_steps=1),
        }
        # final_reward is the reward engine's to set; seeded here for the reward filters
        for name, reward in (("quokka", 0.9), ("fix", 0.2), ("divide", 0.6)):
            _sql(console, "UPDATE trajectories SET final_reward = ? WHERE id = ?", (reward, ids[name]))
        # a group of globex's (a rollout's siblings), for the group page
        for name in ("divide", "weather"):
            _sql(console, "UPDATE trajectories SET group_id = 'g-globex' WHERE id = ?", (ids[name],))
        yield World(console, ids)


def _rows(page: Page) -> list[str]:
    return page.locator("#trajectory-list tbody td:first-child a").all_inner_texts()


def _apply(page: Page, **fields: str) -> list[str]:
    """Fill the list's filter form (selects chosen, inputs typed), press Apply; the ids listed."""
    form = page.locator("#filters")
    for name, value in fields.items():
        field = form.locator(f"[name={name}]")
        if field.evaluate("e => e.tagName") == "SELECT":
            field.select_option(value)
        else:
            field.fill(value)
    with page.expect_navigation():
        form.locator("button[type=submit]").click()
    return _rows(page)


def test_the_admin_finds_trajectories_by_filter(world: World, page: Page) -> None:
    console, ids = world.console, world.ids
    sign_in(page, console, ADMIN_KEY)
    assert set(_rows(page)) == set(ids.values())  # both tenants'

    def found(**fields: str) -> set[str]:
        page.goto(console.ui("/trajectories"))
        return set(_apply(page, **fields))

    agent, proxy = {ids["fix"], ids["divide"], ids["steps"]}, {ids["quokka"], ids["weather"], ids["xss"]}
    assert found(source="agent") == agent
    assert "source=agent" in page.url and page.locator("#filters [name=source]").input_value() == "agent"
    assert found(source="proxy") == proxy
    assert found(status="terminated") == {ids["steps"]}
    assert page.locator("#trajectory-list tbody tr").inner_text().count("max_steps") == 1
    assert found(reason="max_steps") == {ids["steps"]}
    assert found(min_reward="0.5") == {ids["quokka"], ids["divide"]}
    assert found(min_reward="0.5", max_reward="0.8") == {ids["divide"]}
    assert found(source="agent", max_reward="0.5") == {ids["fix"]}
    assert found(model="scripted-model") == agent | proxy
    assert found(model="agent:calc") == agent  # an agent run's requested model; its base is scripted-model
    day = dt.timedelta(days=1)
    today = dt.datetime.now(dt.UTC).date()
    assert found(since=str(today - day), until=str(today + day)) == agent | proxy
    assert found(since=str(today + day)) == set()
    assert found(model="another-model") == set()
    assert page.locator("#trajectory-list tbody").inner_text().strip() == "No trajectory matches."
    # the filters stay as chosen, and a bad number is refused by name
    assert page.locator("#filters [name=model]").input_value() == "another-model"
    page.goto(console.ui("/trajectories?min_reward=lots"))
    assert page.locator("[role=alert]").inner_text() == "'min_reward' must be a number."


def test_full_text_search_finds_a_user_message_and_a_tool_result(world: World, page: Page) -> None:
    console, ids = world.console, world.ids
    sign_in(page, console, ADMIN_KEY)
    assert _apply(page, q="quokka") == [ids["quokka"]]
    assert page.locator("#filters [name=q]").input_value() == "quokka"
    # "division" is in no message anyone wrote: only in the calculator's answer to 1/0
    assert _apply(page, q="division") == [ids["divide"]]
    assert _apply(page, q="Division ZERO") == [ids["divide"]]  # every word, case folded
    assert _apply(page, q="quokka division") == []
    # the search and a filter together
    assert _apply(page, q="lisbon", source="proxy") == [ids["weather"]]
    assert _apply(page, q="lisbon", source="agent") == []


def test_a_timeline_shows_the_invalid_call_its_error_and_the_corrected_call(world: World, page: Page) -> None:
    console, run_id = world.console, world.ids["fix"]
    sign_in(page, console, ADMIN_KEY)
    page.goto(console.ui("/trajectories?source=agent"))
    with page.expect_navigation():
        page.click(f"text={run_id}")
    assert page.url.endswith(f"/ui/trajectories/{run_id}")
    assert page.locator("#status").inner_text() == "completed"
    assert "profile calc" in page.locator("#facts").inner_text()
    steps = page.locator("ol.timeline > li.step")
    assert steps.count() == 3

    first = page.locator("#step-0")
    assert "has-invalid" in (first.get_attribute("class") or "")
    assert FIX_TASK in first.locator(".sent").inner_text()
    invalid = first.locator(".tool-call")
    assert invalid.count() == 1 and "invalid" in (invalid.get_attribute("class") or "").split()
    assert invalid.locator(".args").inner_text() == '{"expr": 1}'
    error = invalid.locator(".validation-error").inner_text()
    assert error.startswith("invalid: ") and "'expression' is a required property" in error
    # what the loop sent back to the model about it
    told = page.locator("#step-1 .sent > .msg.role-tool").inner_text()
    assert "Invalid call to calculator" in told and "'expression' is a required property" in told

    corrected = page.locator("#step-1 .tool-call")
    assert corrected.count() == 1 and "valid" in (corrected.get_attribute("class") or "").split()
    assert "has-invalid" not in (page.locator("#step-1").get_attribute("class") or "")
    assert corrected.locator(".args").inner_text() == '{"expression": "6*7"}'
    assert corrected.locator(".validation-error").count() == 0
    assert corrected.locator(".result").inner_text() == "42"
    assert page.locator("#step-2 .replies").inner_text().endswith("The answer is 42.")
    assert page.locator("#step-2 .tool-call").count() == 0
    # each step's transitions: the call made, its reply parsed, its tool calls validated, run and observed
    transitions = [[e.split(" ")[1] for e in page.locator(f"#step-{n} .events li").all_inner_texts()]
                   for n in range(3)]
    assert transitions == [["CALL_MODEL", "PARSE", "VALIDATE", "EXECUTE", "OBSERVE"]] * 2 + \
        [["CALL_MODEL", "PARSE", "FINAL"]]
    assert '"status": "invalid"' in page.locator("#step-0 .events").inner_text()
    assert '"status": "ok"' in page.locator("#step-1 .events").inner_text()
    assert page.locator("ol.timeline > li.event").count() == 0

    # each step's tokens, latency and backend, as stored
    calls = _sql(console, "SELECT seq, prompt_tokens, completion_tokens, latency_ms, backend FROM model_calls "
                          "WHERE trajectory_id = ? ORDER BY seq", (run_id,))
    assert [c["seq"] for c in calls] == [0, 1, 2]
    for c in calls:
        meta = page.locator(f"#step-{c['seq']} .step-head .meta").inner_text()
        assert c["backend"] == "scripted" and (c["prompt_tokens"], c["completion_tokens"]) == (10, 5)
        assert meta.startswith(f"10→5 tokens · {c['latency_ms']:.0f} ms") and " · scripted" in meta, meta
    assert page.locator("#facts").inner_text().count("30 in, 15 out") == 1


def _feedback_rows(console: Console, trajectory_id: str) -> list[dict[str, Any]]:
    return [dict(r) for r in _sql(console, "SELECT source, name, value, label, comment, model_call_seq FROM feedback "
                                           "WHERE trajectory_id = ? ORDER BY created_at, id", (trajectory_id,))]


def test_a_fork_links_to_its_parent_and_the_parent_to_its_forks(world: World, page: Page) -> None:
    console, parent, fork = world.console, world.ids["fix"], world.ids["steps"]
    _sql(console, "UPDATE trajectories SET parent_id = ? WHERE id = ?", (parent, fork))
    try:
        sign_in(page, console, ADMIN_KEY)
        page.goto(console.ui(f"/trajectories/{fork}"))
        assert "forked from" in page.locator("#facts").inner_text()
        with page.expect_navigation():
            page.click(f"#facts a:text('{parent}')")
        assert page.url.endswith(f"/ui/trajectories/{parent}")
        assert page.locator("#facts").get_by_role("link", name=fork).count() == 1
    finally:
        _sql(console, "UPDATE trajectories SET parent_id = NULL WHERE id = ?", (fork,))


def test_feedback_from_the_page_is_stored_as_the_api_stores_it(world: World, page: Page) -> None:
    console, run_id = world.console, world.ids["fix"]
    key = console.keys["acme"][1]
    sign_in(page, console, key)
    page.goto(console.ui(f"/trajectories/{run_id}"))
    assert page.locator("#feedback").inner_text().count("No feedback on the whole trajectory yet.") == 1
    before = _feedback_rows(console, run_id)

    form = page.locator("#feedback-form")
    form.locator("input[name=rating][value=up]").check()
    form.locator("input[name=label]").fill("helpful")
    form.locator("textarea[name=comment]").fill("Fixed its own call.")
    with page.expect_navigation():
        form.locator("button[type=submit]").click()
    assert page.url.endswith(f"/ui/trajectories/{run_id}#feedback")
    thumbs = page.locator("#feedback table tbody tr")
    assert thumbs.count() == 1
    assert thumbs.locator("td").all_inner_texts()[:5] == ["user", "thumbs", "1.000", "helpful", "Fixed its own call."]

    form.locator("input[name=score]").fill("0.25")
    form.locator("select[name=model_call_seq]").select_option("1")
    with page.expect_navigation():
        form.locator("button[type=submit]").click()
    assert page.locator("#step-1 .rewards").inner_text() == "user · score = 0.250"
    assert page.locator("#feedback table tbody tr").count() == 1  # a step's score is not the whole trajectory's

    by_page = _feedback_rows(console, run_id)[len(before):]
    assert by_page == [
        {"source": "user", "name": "thumbs", "value": 1.0, "label": "helpful", "comment": "Fixed its own call.",
         "model_call_seq": None},
        {"source": "user", "name": "score", "value": 0.25, "label": None, "comment": None, "model_call_seq": 1}]
    # the same feedback through the API makes the same rows
    for body in ({"rating": "up", "label": "helpful", "comment": "Fixed its own call."},
                 {"score": 0.25, "model_call_seq": 1}):
        r = httpx.post(f"{console.url}/v1/trajectories/{run_id}/feedback", json=body,
                       headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 201, r.text
    assert _feedback_rows(console, run_id)[len(before) + 2:] == by_page

    # a score out of range is refused, and nothing is stored
    stored = len(_feedback_rows(console, run_id))
    page.goto(console.ui(f"/trajectories/{run_id}"))
    form.locator("input[name=score]").fill("7")
    with page.expect_navigation():
        form.locator("button[type=submit]").click()
    assert page.locator("[role=alert]").inner_text() == "'score' must be a number from 0 to 1."
    assert page.locator("h1").inner_text() == "400"
    assert "(acme)" in page.locator("header .who").inner_text()  # still signed in, and shown so
    assert page.locator("main a", has_text="Sign in").count() == 0
    assert len(_feedback_rows(console, run_id)) == stored


def test_a_tenant_cannot_open_another_tenants_trajectory(world: World, page: Page) -> None:
    console, ids = world.console, world.ids
    sign_in(page, console, console.keys["acme"][1])
    own = {ids[n] for n in ids if world.tenant_of(n) == "acme"}
    assert set(_rows(page)) == own
    assert _apply(page, q="division") == [] and _apply(page, q="lisbon") == []
    assert page.goto(console.ui(f"/trajectories/{ids['fix']}")).status == 200

    theirs = ids["divide"]
    for path in (f"/trajectories/{theirs}", f"/trajectories/{theirs}/live", "/groups/g-globex",
                 f"/trajectories/{theirs}?fragment=timeline"):
        response = page.goto(console.ui(path))
        assert response is not None and response.status == 404, path
        assert page.locator("[role=alert]").inner_text() in (f"No trajectory '{theirs}'.", "No group 'g-globex'.")
        assert "calculator" not in page.content()
        assert "(acme)" in page.locator("header .who").inner_text()

    # the feedback form's POST, with a good session and token, as the browser would send it
    page.goto(console.ui(f"/trajectories/{ids['fix']}"))
    csrf = page.locator("#feedback-form input[name=csrf]").input_value()
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    stored = len(_feedback_rows(console, theirs))
    posted = httpx.post(console.ui(f"/trajectories/{theirs}/feedback"), cookies=cookies,
                        data={"csrf": csrf, "rating": "down", "comment": "not mine"}, headers={"origin": console.url})
    assert posted.status_code == 404 and f"No trajectory &#39;{theirs}&#39;." in posted.text
    assert len(_feedback_rows(console, theirs)) == stored
    # the same token works on acme's own
    mine = httpx.post(console.ui(f"/trajectories/{ids['quokka']}/feedback"), cookies=cookies,
                      data={"csrf": csrf, "rating": "down"}, headers={"origin": console.url})
    assert mine.status_code == 303

    # globex sees its own, and the admin sees both tenants'
    page.context.clear_cookies()
    sign_in(page, console, console.keys["globex"][1])
    assert set(_rows(page)) == {ids["divide"], ids["weather"]}
    assert page.goto(console.ui(f"/trajectories/{ids['fix']}")).status == 404
    assert page.goto(console.ui("/groups/g-globex")).status == 200
    page.context.clear_cookies()
    sign_in(page, console, ADMIN_KEY)
    for name in ("fix", "divide"):
        assert page.goto(console.ui(f"/trajectories/{ids[name]}")).status == 200
        assert page.locator("#facts").inner_text().count(world.tenant_of(name)) >= 1
    assert page.goto(console.ui("/groups/g-globex")).status == 200
    assert page.locator(".columns .column").count() == 2


def test_script_in_a_message_and_a_tool_result_stays_inert(world: World, page: Page) -> None:
    console, trajectory_id = world.console, world.ids["xss"]
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    sign_in(page, console, console.keys["acme"][1])

    response = page.goto(console.ui(f"/trajectories/{trajectory_id}"))
    assert response is not None and response.status == 200
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert page.evaluate("typeof window.__pwned") == "undefined"
    # the payloads are there as text: in the user's message and in the tool's result the client sent
    assert XSS_ASK in page.locator("#step-0 .sent > .msg.role-user").inner_text()
    lookup = page.locator("#step-0 .tool-call")
    assert lookup.locator(".tool").inner_text() == "lookup" and "returned" in lookup.inner_text()
    assert lookup.locator(".result").inner_text() == TOOL_PAYLOAD
    assert TOOL_PAYLOAD in page.locator("#step-1 .sent > .msg.role-tool").inner_text()
    # and nothing of them became markup: the console's own script is the page's only one
    assert page.locator("script").count() == 1 and page.locator("img").count() == 0
    assert page.locator("main script, main img, [onerror]").count() == 0

    # the list, searched for it
    page.goto(console.ui("/trajectories"))
    assert _apply(page, q="marrakesh") == [trajectory_id]
    assert _apply(page, q="<script>window.__pwned zanzibar") == [trajectory_id]
    assert page.locator("#filters [name=q]").input_value() == "<script>window.__pwned zanzibar"
    response = page.reload()
    assert response is not None and "content-security-policy" in response.headers
    page.goto(console.ui(f"/trajectories/{trajectory_id}?fragment=timeline"))
    assert page.locator("script, img").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert dialogs == []


@pytest.fixture
def paged(tmp_path) -> Iterator[Console]:
    yield from serve_console(tmp_path, [], console_settings="page_size = 3")


def test_older_walks_every_trajectory_by_keyset(paged: Console, page: Page) -> None:
    console = paged
    made = [_chat(console, "acme" if i % 2 else "globex", f"conversation number {i}") for i in range(8)]
    made += [_run(console, "acme", f"run number {i}") for i in range(2)]
    newest_first = [r["id"] for r in _sql(console, "SELECT id FROM trajectories ORDER BY id DESC")]
    assert sorted(newest_first) == sorted(made)

    def walk(start: str) -> list[list[str]]:
        page.goto(console.ui(start))
        pages = [_rows(page)]
        while page.locator("a[rel=next]").count():
            assert page.locator("a[rel=next]").inner_text() == "Older →"
            with page.expect_navigation():
                page.click("a[rel=next]")
            pages.append(_rows(page))
            assert len(pages) < 10
        return pages

    sign_in(page, console, ADMIN_KEY)
    pages = walk("/trajectories")
    assert [len(p) for p in pages] == [3, 3, 3, 1]
    assert [i for p in pages for i in p] == newest_first  # every one, once, in order
    # "Newest" goes back to the first page
    with page.expect_navigation():
        page.click("text=Newest")
    assert _rows(page) == pages[0] and "before=" not in page.url

    # a filter holds on every page
    proxy = [i for i in newest_first if i not in made[8:]]
    pages = walk("/trajectories?source=proxy")
    assert [len(p) for p in pages] == [3, 3, 2]
    assert [i for p in pages for i in p] == proxy
    assert re.search(r"source=proxy", page.url)
    # and so does a search
    pages = walk("/trajectories?q=conversation")
    assert [len(p) for p in pages] == [3, 3, 2] and [i for p in pages for i in p] == proxy
    assert page.locator("#filters [name=q]").input_value() == "conversation"

    # and a tenant walks its own alone
    page.context.clear_cookies()
    sign_in(page, console, console.keys["acme"][1])
    acme = [r["id"] for r in _sql(console, "SELECT id FROM trajectories WHERE tenant = 'acme' ORDER BY id DESC")]
    assert len(acme) == 6
    assert [i for p in walk("/trajectories") for i in p] == acme
