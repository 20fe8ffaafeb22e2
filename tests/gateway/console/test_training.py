"""Training runs in the console, in a real browser: runs recorded in the gateway's store (as replay-train records
them, from whatever host it trains on) listed newest first, and a run's stages, curves, before/after table and gate
decision; a running run shows its stages so far; the pages are the admin key's alone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from replay import training_runs
from replay.store import TrajectoryStore
from tests.gateway.console.conftest import ADMIN_KEY, Console, serve_console, sign_in
from training.run_record import downsample

pytestmark = [pytest.mark.integration]
T = TypeVar("T")

STAGES = [{"stage": "select", "seconds": 2.0, "trajectories": 344}, {"stage": "reward", "seconds": 3.0,
                                                                      "trajectories": 344},
          {"stage": "build", "seconds": 5.0, "rows": 412}, {"stage": "sft", "seconds": 60.0, "tokens": 91234},
          {"stage": "validate", "seconds": 20.0, "episodes": 88}, {"stage": "gate", "seconds": 10.0}]
LOSSES = [2.5 * 0.999 ** step for step in range(1, 1201)]  # longer than a stored curve keeps
REWARDS = [[1, 0.25], [2, 0.375], [3, 0.5], [4, 0.625]]
VALIDATION = [{"label": "checkpoint-60", "stage": "sft", "metrics": {"success_rate": 0.25}, "action": None},
              {"label": "checkpoint-120", "stage": "sft", "metrics": {"success_rate": 0.5}, "action": None},
              {"label": "RL step 0", "stage": "rl", "metrics": {"success_rate": 0.5}, "action": "best"},
              {"label": "RL step 4", "stage": "rl", "metrics": {"success_rate": 0.625}, "action": "best"}]
REFERENCE = {"success_rate": 0.1, "mean_steps": 2.5, "valid_call_rate": 0.42, "invalid_call_rate": 0.3,
             "recovery_rate": 0.0, "unseen_tool_success_rate": None, "general_perplexity": 12.34}
CANDIDATE = {"success_rate": 0.55, "mean_steps": 2.25, "valid_call_rate": 0.93, "invalid_call_rate": 0.02,
             "recovery_rate": 0.5, "unseen_tool_success_rate": 0.4, "general_perplexity": 12.5}
GATE = {"passed": True, "tasks": 100, "samples": 1, "confidence": 0.95, "seed": 7, "checks": [
    {"name": "success gain", "reference": 0.1, "candidate": 0.55, "estimate": 0.45, "bound": 0.362, "side": "lower",
     "threshold": 0.0, "relation": ">", "n": 100, "passed": True, "note": ""},
    {"name": "excess steps", "reference": 0.5, "candidate": 0.25, "estimate": -0.25, "bound": 0.1, "side": "upper",
     "threshold": 1.0, "relation": "≤", "n": 9, "passed": True, "note": ""},
    {"name": "recovery drop", "reference": None, "candidate": None, "estimate": None, "bound": None, "side": "lower",
     "threshold": -0.1, "relation": "≥", "n": 0, "passed": True, "note": "no faulted task"}]}
METRICS = {"curves": {"loss": downsample(list(enumerate(LOSSES, 1))), "reward": REWARDS, "validation": VALIDATION},
           "reports": [{"role": "reference", "model": "base", "metrics": REFERENCE, "episodes": 100, "seconds": 40.0},
                       {"role": "candidate", "model": "tools (candidate)", "metrics": CANDIDATE, "episodes": 100,
                        "seconds": 42.0}],
           "gate": GATE, "registered": {"name": "tools", "version": 3, "status": "active", "published": False}}


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    yield from serve_console(tmp_path, ["Hello."])


def _run(work: Callable[[], Awaitable[T]]) -> T:
    """``work`` on a loop of its own: the browser's driver holds this thread's."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work()).result()


def _record(db: Path, *runs: dict[str, Any]) -> list[str]:
    """Runs written into the gateway's store as replay-train writes them: started, then finished or not."""
    async def write() -> list[str]:
        store = TrajectoryStore(str(db))
        await store.start()
        ids = []
        try:
            for run in runs:
                run_id = await training_runs.start(store, name=run["name"], mode=run["mode"], host=run["host"],
                                                   run_dir=f"/srv/runs/{run['name']}")
                await training_runs.record_stages(store, run_id, run["stages"])
                if run.get("metrics"):
                    await training_runs.finish(store, run_id, stages=run["stages"], metrics=run["metrics"],
                                               adapter_version=run["metrics"]["registered"]["version"])
                ids.append(run_id)
        finally:
            await store.close()
        return ids

    return _run(write)


def test_the_list_and_a_finished_runs_stages_curves_table_and_gate(console: Console, page) -> None:
    done, running = _record(console.db,
                            {"name": "tools", "mode": "sft+rl", "host": "trainer-7", "stages": STAGES,
                             "metrics": METRICS},
                            {"name": "nightly", "mode": "rl", "host": "trainer-8", "stages": STAGES[:2]})
    sign_in(page, console, ADMIN_KEY)
    page.click("header nav >> text=Training runs")
    page.wait_for_url("**/ui/training")
    rows = page.locator("#training-runs tbody tr")
    assert rows.count() == 2
    newest, older = rows.nth(0).locator("td"), rows.nth(1).locator("td")
    assert [newest.nth(i).inner_text() for i in (0, 1, 2, 3)] == ["nightly", "rl", "running", "trainer-8"]
    assert [older.nth(i).inner_text() for i in (0, 1, 2, 3, 6, 7)] == ["tools", "sft+rl", "completed", "trainer-7",
                                                                       "passed", "tools@3"]
    assert older.nth(7).locator("a").get_attribute("href") == "/ui/adapters"
    assert newest.nth(6).inner_text() == "–" and newest.nth(7).inner_text() == "–"

    older.nth(0).locator("a").click()
    page.wait_for_url(f"**/ui/training/{done}")
    assert "trainer-7" in page.locator("#facts").inner_text()
    stages = page.locator("#stages tbody tr")
    assert stages.count() == len(STAGES)
    sft = stages.nth(3).locator("td")
    # 60 of the stages' 100 seconds
    assert [sft.nth(i).inner_text() for i in range(4)] == ["sft", "60.0", "60%", "91,234 tokens"]
    assert page.locator("#stages tfoot").inner_text().split() == ["in", "all", "100.0"]

    def points(curve: str) -> int:
        return len(page.locator(f"#{curve} svg polyline").get_attribute("points").split())

    assert points("loss-curve") == 500  # 1,200 steps, averaged down when stored
    assert points("reward-curve") == 4 and page.locator("#reward-curve circle").count() == 4
    assert points("validation-curve") == 4
    assert page.locator("#validation-curve text.x-tick").all_text_contents() == [v["label"] for v in VALIDATION]
    assert page.locator("#validation-curve text.y-tick").all_text_contents()[-1] == "100%"
    assert page.locator("#loss-curve text.x-tick").all_text_contents() == ["500", "1,000"]

    table = page.locator("#before-after")
    assert table.locator("thead th").all_inner_texts()[1:] == ["base\nreference", "tools (candidate)\ncandidate"]
    values = {row.locator("td").first.inner_text(): row.locator("td.num").all_inner_texts()
              for row in table.locator("tbody tr").all()}
    assert values["success rate"] == ["10%", "55%"] and values["valid call rate"] == ["42%", "93%"]
    assert values["mean steps"] == ["2.50", "2.25"] and values["general perplexity"] == ["12.34", "12.50"]
    assert values["unseen tool success rate"] == ["-", "40%"] and values["episodes"] == ["100", "100"]

    assert page.locator("#gate-verdict").inner_text().startswith("passed on 100 tasks × 1 sample(s)")
    checks = {row.locator("td").first.inner_text(): row.locator("td").all_inner_texts()
              for row in page.locator("#gate tbody tr").all()}
    assert checks["success gain"][1:7] == ["10.0%", "55.0%", "lower bound 36.2%", "> 0.0%", "100", "passed"]
    assert checks["excess steps"][3:5] == ["upper bound 0.10", "≤ 1.00"]
    assert checks["recovery drop"][6:] == ["skipped", "no faulted task"]

    # A run still going shows the stages it has ended, and nothing it has not drawn yet.
    page.goto(console.ui(f"/training/{running}"))
    assert page.locator("#stages tbody tr td:first-child").all_inner_texts() == ["select", "reward"]
    assert "Still running" in page.locator("main").inner_text()
    assert page.locator("svg.chart").count() == 0 and "No evaluation yet." in page.locator("main").inner_text()


def test_a_failed_run_shows_why(console: Console, page) -> None:
    async def fail() -> str:
        store = TrajectoryStore(str(console.db))
        await store.start()
        try:
            run_id = await training_runs.start(store, name="tools", mode="sft", host="h", run_dir=None)
            await training_runs.fail(store, run_id, error="no trajectories match the filters <b>now</b>",
                                     stages=[])
            return run_id
        finally:
            await store.close()

    run_id = _run(fail)
    sign_in(page, console, ADMIN_KEY)
    page.goto(console.ui(f"/training/{run_id}"))
    assert page.locator("#run-error").inner_text() == "no trajectories match the filters <b>now</b>"  # escaped
    assert page.locator("h1 .status").inner_text() == "failed"
    assert page.goto(console.ui("/training/01HZZZZZZZZZZZZZZZZZZZZZZZ")).status == 404


def test_a_tenant_key_may_not_see_training_runs(console: Console, page) -> None:
    (run_id,) = _record(console.db, {"name": "tools", "mode": "sft", "host": "h", "stages": STAGES,
                                     "metrics": METRICS})
    sign_in(page, console, console.keys["acme"][1])
    assert page.locator("header nav").inner_text().split() == ["Trajectories"]
    for path in ("/training", f"/training/{run_id}"):
        response = page.goto(console.ui(path))
        assert response.status == 403 and "admin key" in page.locator("[role=alert]").inner_text()
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    assert httpx.get(console.ui("/training"), cookies=cookies).status_code == 403
