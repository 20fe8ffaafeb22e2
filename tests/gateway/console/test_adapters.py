"""The adapter registry in the console, in a real browser: versions registered over the admin API with the gate's
numbers, promoted, promoted over and rolled back from the page (each form confirmed first), the registry agreeing
at every turn and the backend (a vLLM stand-in) loading what is promoted; the page is the admin key's alone."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.adapters.test_lifecycle import adapter_folder
from tests.gateway.console.conftest import ADMIN_KEY, Console, serve_console, sign_in
from tests.standin import ServerThread
from tests.standins.vllm import VLLMStandIn

pytestmark = [pytest.mark.integration]

BASE = "qwen-test"
BACKEND = """
[[backends]]
name = "vllm"
kind = "vllm"
base_url = "{url}/v1"
models = ["{base}"]
max_retries = 0

[routing]
adapters_dir = "{adapters}"
"""


def _check(name: str, reference: float | None, candidate: float | None, bound: float | None, threshold: float,
           passed: bool, *, side: str = "lower", relation: str = ">", note: str = "") -> dict[str, Any]:
    """A gate check as ``training.gate.Decision.as_dict()`` stores it."""
    return {"name": name, "reference": reference, "candidate": candidate, "estimate": candidate,
            "bound": bound, "side": side, "threshold": threshold, "relation": relation, "n": 40, "passed": passed,
            "note": note}


def _metrics(passed: bool, success: float) -> dict[str, Any]:
    """What replay-train registers a version with: its mode, checkpoint, test and reference figures and the gate."""
    gain = _check("success gain", 0.5, success, 0.12 if passed else -0.04, 0.0, passed)
    steps = _check("excess steps", 0.25, 0.5, 0.4, 1.0, True, side="upper", relation="≤")
    recovery = _check("recovery drop", None, None, None, -0.1, True, relation="≥", note="no faulted task")
    return {"mode": "sft", "checkpoint": "checkpoints/final", "test": {"success_rate": success},
            "reference": {"model": BASE, "success_rate": 0.5},
            "gate": {"passed": passed, "tasks": 40, "samples": 1, "confidence": 0.95, "seed": 7,
                     "checks": [gain, steps, recovery]}}


@pytest.fixture
def standin() -> Iterator[tuple[VLLMStandIn, str]]:
    found = VLLMStandIn(served_model_name=BASE)
    with ServerThread(found.app) as server:
        yield found, server.url


@pytest.fixture
def console(tmp_path: Path, standin: tuple[VLLMStandIn, str]) -> Iterator[Console]:
    extra = BACKEND.format(url=standin[1], base=BASE, adapters=tmp_path / "adapters")
    yield from serve_console(tmp_path, ["Hello."], extra=extra, keep_backends=("vllm",))


def _register(console: Console, tmp_path: Path, metrics: dict[str, Any], parent: int | None = None) -> int:
    folder = adapter_folder(tmp_path / f"sql-{len(list(tmp_path.glob('sql-*')))}")
    body = {"name": "sql", "base": BASE, "path": str(folder), "metrics": metrics, "parent_version": parent}
    response = httpx.post(f"{console.url}/admin/adapters", json=body,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["version"]


def _registry(console: Console) -> dict[int, str]:
    with sqlite3.connect(console.db) as db:
        return dict(db.execute("SELECT version, status FROM adapters WHERE name = 'sql'").fetchall())


def _statuses(page: Any) -> dict[int, str]:
    rows = page.locator("#adapter-sql tr[data-version]")
    return {int(rows.nth(i).get_attribute("data-version")): rows.nth(i).get_attribute("data-status")
            for i in range(rows.count())}


def _confirm(page: Any, form: str, *, accept: bool = True) -> list[str]:
    """Submits ``form``, answering its confirmation; returns what the confirmation asked."""
    asked: list[str] = []

    def answer(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", answer)
    if accept:
        with page.expect_navigation():
            page.locator(f"{form} button").click()
    else:
        page.locator(f"{form} button").click()
    return asked


def test_promote_promote_again_and_roll_back_from_the_page(console: Console, standin, tmp_path: Path,
                                                           page) -> None:
    v1 = _register(console, tmp_path, _metrics(False, 0.45))
    v2 = _register(console, tmp_path, _metrics(True, 0.75), parent=v1)
    sign_in(page, console, ADMIN_KEY)
    page.click("nav >> text=Adapters")
    page.wait_for_url("**/ui/adapters")
    assert _statuses(page) == {v1: "candidate", v2: "candidate"}
    head = page.locator("#adapter-sql .adapter-head").inner_text()
    assert "base qwen-test" in head and "no active version" in head
    assert page.locator("#adapter-sql .rollback-form").count() == 0  # nothing active: nothing to roll back

    # what each version was judged on
    first, second = page.locator(f"#version-sql-{v1}"), page.locator(f"#version-sql-{v2}")
    assert first.locator(".gate .status").inner_text() == "refused"
    assert "gate refused: success gain lower bound -4.0% (must be > 0.0%)" in first.locator(".gate").inner_text()
    assert second.locator(".gate .status").inner_text() == "passed"
    assert "75.0%" in second.inner_text() and "against qwen-test: 50.0%" in second.inner_text()
    assert f"from v{v1}" in second.inner_text() and "checkpoints/final" in second.inner_text()
    second.locator(".gate summary").click()
    checks = second.locator("table.checks tbody tr")
    assert checks.count() == 3
    assert [checks.nth(i).locator("td").last.inner_text() for i in range(3)] == ["pass", "pass", "skip"]
    assert checks.nth(1).locator("td").nth(3).inner_text() == "upper bound 0.40"  # steps: no percentage

    # a confirmation declined changes nothing
    assert _confirm(page, f"#version-sql-{v1} .promote-form", accept=False) == [
        f"Promote sql@{v1}: sql will resolve to v{v1}?"]
    page.wait_for_timeout(300)
    assert _registry(console) == {v1: "candidate", v2: "candidate"}

    _confirm(page, f"#version-sql-{v1} .promote-form")
    assert page.url.startswith(console.ui("/adapters"))
    assert _statuses(page) == {v1: "active", v2: "candidate"} == _registry(console)
    assert f"serving v{v1}" in page.locator("#adapter-sql .adapter-head").inner_text()
    assert f"sql@{v1}" in standin[0].loaded

    _confirm(page, f"#version-sql-{v2} .promote-form")
    assert _statuses(page) == {v1: "candidate", v2: "active"} == _registry(console)
    assert f"sql@{v2}" in standin[0].loaded

    asked = _confirm(page, "#adapter-sql .rollback-form")
    assert asked == [f"Roll sql back from v{v2} to the version active before it?"]
    assert _statuses(page) == {v1: "active", v2: "candidate"} == _registry(console)
    assert f"serving v{v1}" in page.locator("#adapter-sql .adapter-head").inner_text()
    assert page.locator(f"#version-sql-{v1}").locator("td").nth(2).inner_text() == "yes"  # published


def test_retiring_a_version_and_what_the_registry_refuses(console: Console, tmp_path: Path, page) -> None:
    v1 = _register(console, tmp_path, {})
    sign_in(page, console, ADMIN_KEY)
    page.goto(console.ui("/adapters"))
    assert "no gate" in page.locator(f"#version-sql-{v1}").inner_text()
    _confirm(page, f"#version-sql-{v1} .retire-form")
    assert _statuses(page) == {v1: "retired"} == _registry(console)
    row = page.locator(f"#version-sql-{v1}")
    assert row.locator("form").count() == 0  # a retired version is never served again: no forms left
    # the registry's refusals come back as the admin API's errors, on an error page
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    csrf = page.locator("header form input[name=csrf]").get_attribute("value")
    promoted = httpx.post(console.ui("/adapters/sql/promote"), data={"csrf": csrf, "version": str(v1)},
                          cookies=cookies)
    assert promoted.status_code == 409 and "retired" in promoted.text
    rolled = httpx.post(console.ui("/adapters/sql/rollback"), data={"csrf": csrf}, cookies=cookies)
    assert rolled.status_code == 409 and "no active version" in rolled.text
    unknown = httpx.post(console.ui("/adapters/nope/promote"), data={"csrf": csrf, "version": "1"}, cookies=cookies)
    assert unknown.status_code == 404
    missing = httpx.post(console.ui("/adapters/sql/retire"), data={"csrf": csrf}, cookies=cookies)
    assert missing.status_code == 400 and "version" in missing.text
    assert _registry(console) == {v1: "retired"}


def test_a_tenant_key_may_not_open_the_registry(console: Console, tmp_path: Path, page) -> None:
    v1 = _register(console, tmp_path, {})
    sign_in(page, console, console.keys["acme"][1])
    assert page.locator("nav >> text=Adapters").count() == 0
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    csrf = page.locator("header form input[name=csrf]").get_attribute("value")
    response = page.goto(console.ui("/adapters"))
    assert response is not None and response.status == 403
    assert "admin key" in page.locator("[role=alert]").inner_text()
    refused = httpx.post(console.ui("/adapters/sql/promote"), data={"csrf": csrf, "version": str(v1)},
                         cookies=cookies)
    assert refused.status_code == 403
    assert _registry(console) == {v1: "candidate"}
