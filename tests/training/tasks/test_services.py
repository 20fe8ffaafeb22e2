"""The generated service tools and tasks: typed schemas, seeded records, held-out keys and tools, leak checks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import training.tasks as tasks_pkg
from gateway.agent.validation import check_call
from tools.context import ToolContext
from tools.executor import execute
from tools.settings import ToolsSettings
from training.tasks import SPLITS, leak_filter
from training.tasks.domains import DOMAINS, UNSEEN_DOMAINS
from training.tasks.services import (
    CURRENCIES,
    EXPRESS_FEE,
    FAMILIES,
    PHRASINGS,
    Catalogue,
    ServiceTasks,
    domain_tools,
)
from training.tasks.tools_suite import ToolsSuite

GENERAL_PROMPTS = Path(__file__).resolve().parents[3] / "training" / "general_prompts.jsonl"


def _properties(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """Every property schema, nested ones included."""
    found = []
    for value in (schema.get("properties") or {}).values():
        found.append(value)
        found.extend(_properties(value))
    return found


def test_every_domain_gives_three_typed_tools() -> None:
    specs = [spec for d in DOMAINS for spec in domain_tools(Catalogue.draw(d, 1))]
    assert len(DOMAINS) >= 8 and len(specs) == 3 * len(DOMAINS)
    assert len({s.name for s in specs}) == len(specs)
    for lookup, search, quote in (specs[i:i + 3] for i in range(0, len(specs), 3)):
        assert lookup.parameters["required"] == [next(iter(lookup.parameters["properties"]))]
        nested = search.parameters["properties"]["filter"]
        assert nested["type"] == "object" and "required" not in nested  # every filter field is optional
        values = next(p for p in _properties(nested) if p["type"] == "array")  # any of several enum values
        assert values["items"]["enum"] and values["minItems"] == 1
        bound = next(p for p in _properties(nested) if p["type"] == "number")  # a number with a range
        assert bound["minimum"] == 0 and bound["maximum"] > 0
        assert {p["type"] for p in _properties(search.parameters)} >= {"object", "array", "number", "integer"}
        options = quote.parameters["properties"]["options"]
        assert "options" not in quote.parameters["required"] and options["properties"]["currency"]["enum"]
        assert options["properties"]["express"]["type"] == "boolean"
        for spec in (lookup, search, quote):
            assert spec.parameters["additionalProperties"] is False and spec.description


def test_records_and_tasks_are_seeded_and_reproducible() -> None:
    a, b, other = ServiceTasks(7), ServiceTasks(7), ServiceTasks(8)
    assert {n: c.records for n, c in a.catalogues.items()} == {n: c.records for n, c in b.catalogues.items()}
    assert {n: c.records for n, c in a.catalogues.items()} != {n: c.records for n, c in other.catalogues.items()}
    drawn = [(a.draw(f, "train", i).prompt, b.draw(f, "train", i).prompt) for f in FAMILIES if f != "unseen_service"
             for i in range(6)]
    assert all(x == y for x, y in drawn)
    for catalogue in a.catalogues.values():
        prices = [r[catalogue.domain.price] for r in catalogue.records.values()]
        assert len(set(prices)) == len(prices)  # one cheapest record whatever the filter
        assert not set(catalogue.unknown) & set(catalogue.records)


async def test_the_tools_run_through_the_executor() -> None:
    catalogue = Catalogue.draw(DOMAINS[0], 3)
    d = catalogue.domain
    lookup, search, quote = domain_tools(catalogue)
    context = ToolContext(ToolsSettings())
    key, row = next(iter(catalogue.records.items()))

    found = await execute(lookup, {d.key: key}, context)
    assert found.status == "ok" and json.loads(found.output) == {d.key: key, **row}
    missing = json.loads((await execute(lookup, {d.key: catalogue.unknown[0]}, context)).output)
    assert missing["error"] == "not_found"

    value = row[d.category]
    listed = json.loads((await execute(search, {"filter": {d.category: value}}, context)).output)
    matching = sorted((r[d.price], k) for k, r in catalogue.records.items() if r[d.category] == value)
    assert listed["count"] == len(matching)
    assert [r[d.key] for r in listed["results"]] == [k for _, k in matching][:10]
    bound = matching[0][0]
    counted = json.loads((await execute(search, {"filter": {d.category: value, f"max_{d.price}": bound},
                                                 "limit": 0}, context)).output)
    assert counted == {"count": 1, "results": []}

    total = json.loads((await execute(quote, {d.key: key, "quantity": 3,
                                              "options": {"currency": "USD", "express": True}}, context)).output)
    assert total == {"total": round((row[d.price] * 3 + EXPRESS_FEE) * CURRENCIES["USD"], 2), "currency": "USD"}
    plain = json.loads((await execute(quote, {d.key: key, "quantity": 2}, context)).output)
    assert plain == {"total": float(row[d.price] * 2), "currency": "EUR"}

    # The agent loop checks a call against the schema before the tool runs: a wrong enum or a nested field of the
    # wrong type is refused, an optional field left out is not.
    schemas = {spec.name: dict(spec.parameters) for spec in (lookup, search, quote)}
    for name, arguments, valid in ((search.name, {"filter": {d.category: "sideways"}}, False),
                                   (quote.name, {d.key: key, "quantity": 2, "options": {"express": "yes"}}, False),
                                   (quote.name, {d.key: key, "quantity": 0}, False),
                                   (search.name, {"filter": {}}, True)):
        assert check_call("c1", name, json.dumps(arguments), schemas).valid is valid, arguments


def test_each_split_asks_about_its_own_records(suite: ToolsSuite, demos: dict[str, list[dict[str, Any]]]) -> None:
    service = ServiceTasks(suite.seed)
    keys = {split: {k for c in service.catalogues.values() for k in c.keys(split) + c.unknown_keys(split)}
            for split in SPLITS}
    assert all(keys.values()) and not keys["train"] & (keys["validation"] | keys["test"])
    assert not keys["validation"] & keys["test"]
    for split in SPLITS:
        others = set().union(*(keys[s] for s in SPLITS if s != split))
        for task in suite.tasks(split):
            if task.family not in FAMILIES:
                continue
            text = task.prompt + json.dumps(demos[task.id])  # the prompt, the tool results, the answer
            named = {k for k in others if re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", text)}
            assert not named, (task.id, named)


def test_every_split_has_its_own_phrasings() -> None:
    for kind, banks in PHRASINGS.items():
        assert len(banks["train"]) >= 1 and banks["validation"] and banks["test"], kind
        assert not set(banks["train"]) & (set(banks["validation"]) | set(banks["test"])), kind
        assert not set(banks["validation"]) & set(banks["test"]), kind
    assert sum(len(b["train"]) for b in PHRASINGS.values()) >= 10


def test_unseen_tools_appear_in_no_training_row(suite: ToolsSuite, demos: dict[str, list[dict[str, Any]]]) -> None:
    markers = tasks_pkg.test_only_markers(suite)
    unseen = [t for d in DOMAINS if d.name in UNSEEN_DOMAINS for t in d.tools]
    assert len(unseen) >= 3 and set(unseen) <= set(markers["tools"])
    assert "unseen_service" in markers["families"]
    tested = [t for t in suite.tasks("test") if set(t.tools) & set(unseen)]
    assert len(tested) >= 10 and all(t.family == "unseen_service" for t in tested)
    assert {name for t in tested for m in demos[t.id] for c in m.get("tool_calls") or []
            for name in [c["function"]["name"]]} >= set(unseen) - {"calculator"}
    seen = [t for split in ("train", "validation") for t in suite.tasks(split)]
    seen_text = "\n".join([t.prompt for t in seen] + [json.dumps(demos[t.id]) for t in seen])
    general = GENERAL_PROMPTS.read_text(encoding="utf-8")
    for name in unseen:
        assert name not in seen_text and name not in general
        assert all(name not in t.tools for t in seen)


def test_the_leak_filter_covers_prompts_tools_and_phrasings(suite: ToolsSuite,
                                                           demos: dict[str, list[dict[str, Any]]]) -> None:
    markers = tasks_pkg.test_only_markers(suite)
    leaks = leak_filter(suite)
    test_task = next(t for t in suite.tasks("test") if t.family == "unseen_service")
    validation_task = next(t for t in suite.tasks("validation") if t.family == "service_lookup")
    assert leaks(f"user: {test_task.prompt}") and leaks(f"user: {validation_task.prompt}")
    assert all(leaks(f"a row that offers {name}") for name in markers["tools"])
    # A new question in a test-only phrasing is held out too, not only the test prompts themselves.
    phrasing = PHRASINGS["lookup"]["test"][0].format(field="fare", ref="flight ZZ999")
    assert phrasing not in markers["prompts"] and leaks(phrasing)
    # Nothing a training run is meant to learn from is dropped: every train demonstration and every general row.
    assert not any(leaks(t.prompt + json.dumps(demos[t.id])) for t in suite.tasks("train"))
    assert not any(leaks(line) for line in GENERAL_PROMPTS.read_text(encoding="utf-8").splitlines())
