"""Generated service tools and their tasks: ninety functions over thirty domains, from templates.

Each ``Domain`` (``domains.py``: flights, books, hotels, ...) is a template: an entity with a key and typed
attributes. From it come, seeded and reproducible,

- its records (``Domain.records``): enum attributes drawn from their choices, numbers from their ranges, the
  priced attribute distinct within the domain so "the cheapest" has one answer;
- three tools (``domain_tools``), each with its own name and description: a look-up by key, a search (a nested
  ``filter`` object with an optional array of enum values and an optional number bound with a range, and an
  optional ``limit``; matches come cheapest first) and a quote (an integer ``quantity`` with a range and a nested
  optional ``options`` object with a ``currency`` enum and an ``express`` boolean);
- tasks in nine families (``FAMILIES``), each with several phrasings per split: ``service_lookup``,
  ``service_search`` (a count of one value or either of two, with or without a price bound), ``service_quote``,
  ``service_chain`` (two look-ups and a calculation, or a search then a look-up), ``service_recovery`` (a look-up
  or a quote whose first call fails), ``service_decline`` (a key the service does not know: the right answer is
  that it cannot say), ``service_parallel`` (one field of two records: two independent look-ups, made together in
  one turn), ``service_choice`` (a look-up, quote or count with two other domains' tools offered too: only one
  domain's fit) and ``no_tool`` (a question no offered tool fits, answered without a call).

Held out: each seen domain's keys are split between train, validation and test, and the prompts of each split
have phrasings of their own; two domains (``UNSEEN_DOMAINS``: six tools) appear only in test, as the family
``unseen_service``, so a model must use tools it has only seen described in the request.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tools.context import ToolContext
from tools.spec import ToolSpec
from training.tasks.base import FAULT_KINDS, Demonstration, Direct, Fault, Plan, format_number
from training.tasks.domains import BY_NAME, DOMAINS, SEEN_DOMAINS, UNSEEN_DOMAINS, Domain
from training.tasks.questions import DIRECT, NUMERALS

CURRENCIES = {"EUR": 1.0, "USD": 1.1, "GBP": 0.85}  # a quote's total in each, from its price in EUR
EXPRESS_FEE = 15  # EUR added to a quote with express service
SPLIT_OF_KEY = ("train",) * 4 + ("validation", "test")  # a seen domain's keys by position, in runs of six

# -- records and tools ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Catalogue:
    """One domain's records (key → attributes), drawn from a seed."""

    domain: Domain
    records: dict[str, dict[str, Any]] = field(repr=False)
    unknown: tuple[str, ...]  # keys in the domain's style that no record has, for decline tasks

    @classmethod
    def draw(cls, domain: Domain, seed: int) -> Catalogue:
        rng = random.Random(f"{seed}:{domain.name}")
        pairs = [(p, s) for p in domain.prefixes for s in domain.suffixes]
        rng.shuffle(pairs)
        keys = [domain.joiner.join(p) for p in pairs]
        price = domain.attribute(domain.price)
        prices = rng.sample(range(price.low, price.high + 1), domain.size)  # distinct: one cheapest
        records: dict[str, dict[str, Any]] = {}
        for key, cost in zip(keys[:domain.size], prices, strict=True):
            row: dict[str, Any] = {}
            for a in domain.attributes:
                row[a.name] = cost if a.name == domain.price else (
                    rng.choice(a.choices) if a.kind == "enum" else rng.randint(a.low, a.high))
            records[key] = row
        return cls(domain, records, tuple(keys[domain.size:domain.size + 9]))

    def keys(self, split: str) -> list[str]:
        if self.domain.name in UNSEEN_DOMAINS:
            return list(self.records) if split == "test" else []
        return [k for i, k in enumerate(self.records) if SPLIT_OF_KEY[i % len(SPLIT_OF_KEY)] == split]

    def unknown_keys(self, split: str) -> list[str]:
        return list(self.unknown[{"train": slice(0, 5), "validation": slice(5, 7), "test": slice(7, 9)}[split]])

    def search(self, values: str | list[str] | None, bound: float | None = None) -> list[str]:
        """The keys of the records matching (any of ``values``), cheapest first."""
        d = self.domain
        wanted = [values] if isinstance(values, str) else values
        keys = [k for k, r in self.records.items() if (not wanted or r[d.category] in wanted)
                and (bound is None or r[d.price] <= bound)]
        return sorted(keys, key=lambda k: self.records[k][d.price])

    def quote(self, key: str, quantity: int, currency: str = "EUR", express: bool = False) -> float:
        total = (self.records[key][self.domain.price] * quantity + (EXPRESS_FEE if express else 0))
        return round(total * CURRENCIES[currency], 2)


def _not_found(domain: Domain, key: str) -> dict[str, Any]:
    return {"error": "not_found", "message": f"no {domain.entity} with {domain.key_phrase} {key!r}"}


def domain_tools(catalogue: Catalogue) -> tuple[ToolSpec, ToolSpec, ToolSpec]:
    """The domain's look-up, search and quote tools over its records."""
    d = catalogue.domain
    fields = [a.name for a in d.attributes]
    price = d.attribute(d.price)
    key_schema = {"type": "string", "description": f"the {d.key_phrase}"}
    currency = {"type": "string", "enum": list(CURRENCIES), "description": "currency of the total (default EUR)"}

    async def lookup(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
        row = catalogue.records.get(arguments[d.key])
        if row is None:
            return _not_found(d, arguments[d.key])
        return {d.key: arguments[d.key], **row}

    async def search(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
        where = arguments["filter"]
        keys = catalogue.search(where.get(d.category), where.get(f"max_{d.price}"))
        shown = keys[:arguments.get("limit", 10)]
        return {"count": len(keys), "results": [{d.key: k, d.price: catalogue.records[k][d.price]} for k in shown]}

    async def quote(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
        key = arguments[d.key]
        if key not in catalogue.records:
            return _not_found(d, key)
        options = arguments.get("options") or {}
        cur = options.get("currency", "EUR")
        return {"total": catalogue.quote(key, arguments["quantity"], cur, bool(options.get("express"))),
                "currency": cur}

    lookup_name, search_name, quote_name = d.tools
    return (
        ToolSpec(lookup_name, f"Look up a {d.entity}'s {', '.join(fields)}. From {d.what}.", {
            "type": "object", "properties": {d.key: key_schema}, "required": [d.key],
            "additionalProperties": False}, lookup, timeout=5.0),
        ToolSpec(search_name, f"Count and list {d.plural}, cheapest first. From {d.what}.", {
            "type": "object",
            "properties": {
                "filter": {"type": "object", "properties": {
                    d.category: {"type": "array", "items": {"type": "string", "enum": list(
                        d.attribute(d.category).choices)}, "minItems": 1, "description": "any of these"},
                    f"max_{d.price}": {"type": "number", "minimum": 0, "maximum": 10 * price.high}},
                    "additionalProperties": False},
                "limit": {"type": "integer", "minimum": 0, "maximum": 20,
                          "description": "how many matches to list (default 10; 0: only count)"}},
            "required": ["filter"], "additionalProperties": False}, search, timeout=5.0),
        ToolSpec(quote_name, f"Price {d.unit} of a {d.entity}. Express service adds {EXPRESS_FEE} EUR.", {
                     "type": "object",
                     "properties": {d.key: key_schema,
                                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                                    "options": {"type": "object", "properties": {
                                        "currency": currency, "express": {"type": "boolean"}},
                                        "additionalProperties": False}},
                     "required": [d.key, "quantity"], "additionalProperties": False}, quote, timeout=5.0),
    )


# -- phrasings --------------------------------------------------------------------------------------

# Placeholders: {ref} a record ("flight KL452"), {field} an attribute's phrase, {entity}/{plural}, {category} and
# {value} an enum filter, {price} the priced attribute, {bound}, {n} {unit}, {currency}, {a} {b} two records.
PHRASINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "lookup": {
        "train": ("What is the {field} of {ref}?", "Look up the {field} for {ref}.", "Tell me the {field} of {ref}.",
                  "Check the {field} of {ref}, please.", "Show me the {field} of {ref}.",
                  "I need the {field} for {ref}."),
        "validation": ("Find out the {field} recorded for {ref}.", "I'd like to know the {field} of {ref}."),
        "test": ("Could you report which {field} is listed for {ref}?",
                 "According to the service, what {field} does {ref} have?"),
    },
    "count": {
        "train": ("How many {plural} have {category} {value}?", "Count the {plural} whose {category} is {value}.",
                  "How many {plural} are there with {category} {value}?",
                  "Search for {plural} with {category} {value} and tell me how many there are."),
        "validation": ("Give me the number of {plural} with {category} {value}.",),
        "test": ("Across the whole service, how many {plural} list {value} as {category}?",),
    },
    "count_any": {
        "train": ("How many {plural} have {category} {value} or {other}?",
                  "Count the {plural} whose {category} is either {value} or {other}."),
        "validation": ("Tally the {plural} listed with {category} {value} or {other}.",),
        "test": ("Taken together, how many {plural} show {category} {value} or else {other}?",),
    },
    "count_bound": {
        "train": ("How many {plural} with {category} {value} have a {price} of at most {bound}?",
                  "Of the {plural} with {category} {value}, how many have a {price} no higher than {bound}?"),
        "validation": ("Among {plural} with {category} {value}, tally those whose {price} is {bound} or less.",),
        "test": ("Without going over a {price} of {bound}, how many {plural} with {category} {value} qualify?",),
    },
    "quote": {
        "train": ("How much would {n} {unit} of {ref} cost in {currency}?",
                  "Get a quote for {n} {unit} of {ref}, paid in {currency}.",
                  "What is the price of {n} {unit} of {ref} in {currency}?",
                  "Quote {n} {unit} of {ref} in {currency}."),
        "validation": ("Price {n} {unit} of {ref} in {currency} for me.",),
        "test": ("If I ordered {n} {unit} of {ref} and paid in {currency}, what would the total come to?",),
    },
    "quote_express": {
        "train": ("What is the total for {n} {unit} of {ref} with express service, in {currency}?",
                  "Get an express quote for {n} {unit} of {ref} in {currency}."),
        "validation": ("Work out {n} {unit} of {ref} with express service, priced in {currency}.",),
        "test": ("With the express option, what do {n} {unit} of {ref} add up to in {currency}?",),
    },
    "diff": {
        "train": ("By how much does the {price} of {a} exceed that of {b}?",
                  "What is the difference between the {price} of {a} and the {price} of {b}?",
                  "How much higher is the {price} of {a} than the {price} of {b}?"),
        "validation": ("Work out how far apart the {price} of {a} and the {price} of {b} are.",),
        "test": ("Compared with {b}, how much extra is the {price} of {a}?",),
    },
    "pair": {
        "train": ("What is the {field} of {a}, and what is it for {b}?", "Tell me the {field} of {a} and of {b}.",
                  "Look up the {field} of both {a} and {b}.", "Give me the {field} of {a} and the {field} of {b}."),
        "validation": ("I'd like the {field} for {a} as well as for {b}.",),
        "test": ("Report the {field} listed for {a} and, separately, for {b}.",),
    },
    "cheapest": {
        "train": ("What is the {field} of the cheapest {entity} with {category} {value}?",
                  "Among {plural} with {category} {value}, find the one with the lowest {price} and tell me "
                  "its {field}.", "Find the cheapest {entity} with {category} {value} and give its {field}."),
        "validation": ("For the lowest-priced {entity} whose {category} is {value}, what {field} is given?",),
        "test": ("Which {field} goes with the lowest-costing {entity} among those with {category} {value}?",),
    },
}
# A task family → the phrasing kinds it draws from, in turn.
KINDS: dict[str, tuple[str, ...]] = {
    "service_lookup": ("lookup",),
    "service_search": ("count", "count_any", "count_bound"),
    "service_quote": ("quote", "quote", "quote_express"),
    "service_chain": ("diff", "cheapest"),
    "service_recovery": ("lookup", "quote"),
    "service_decline": ("lookup",),
    "unseen_service": ("lookup", "quote", "count", "diff", "cheapest"),
    "service_parallel": ("pair",),
    "service_choice": ("lookup", "quote", "count"),
    "no_tool": ("direct",),
}
DISTRACTORS = 2  # other domains whose look-up and quote tools a service_choice task offers too
FAMILIES = tuple(KINDS)
ID_PREFIX = {family: family.replace("_", "-") for family in FAMILIES}


def phrasings(split: str) -> list[str]:
    return [p for kinds in PHRASINGS.values() for p in kinds[split]] + [q for q, *_ in DIRECT[split]]


# -- plans ------------------------------------------------------------------------------------------

REFUSE_UNKNOWN = "I cannot answer that: the service has no {entity} {key}."


def _value(value: Any) -> str:
    return format_number(value) if isinstance(value, int | float) else str(value)


async def _lookup(demo: Demonstration, d: Domain, key: str, attribute: str, answer: str) -> None:
    data = json.loads(await demo.call(d.tools[0], {d.key: key}))
    if "error" in data:
        demo.answer(REFUSE_UNKNOWN.format(entity=d.entity, key=key))
        return
    demo.answer(answer.format(v=_value(data[attribute])))


async def _count(demo: Demonstration, d: Domain, where: dict[str, Any]) -> None:
    data = json.loads(await demo.call(d.tools[1], {"filter": where, "limit": 0}))
    demo.answer(f"There are {data['count']} such {d.plural}.")


async def _pair(demo: Demonstration, d: Domain, a: str, b: str, attribute: str) -> None:
    found = await demo.calls([(d.tools[0], {d.key: a}), (d.tools[0], {d.key: b})])
    first, second = (_value(json.loads(out)[attribute]) for out in found)
    demo.answer(f"The {d.attribute(attribute).phrase} of {d.ref_of(a)} is {first}, and of {d.ref_of(b)} {second}.")


async def _quote(demo: Demonstration, d: Domain, key: str, quantity: int, options: dict[str, Any]) -> None:
    data = json.loads(await demo.call(d.tools[2], {d.key: key, "quantity": quantity, "options": options}))
    demo.answer(f"The total is {format_number(data['total'])} {data['currency']}.")


async def _diff(demo: Demonstration, d: Domain, a: str, b: str) -> None:
    prices = [json.loads(await demo.call(d.tools[0], {d.key: k}))[d.price] for k in (a, b)]
    out = await demo.call("calculator", {"expression": f"{prices[0]} - {prices[1]}"})
    demo.answer(f"The difference is {format_number(float(out))}.")


async def _cheapest(demo: Demonstration, d: Domain, value: str, attribute: str) -> None:
    found = json.loads(await demo.call(d.tools[1], {"filter": {d.category: [value]}, "limit": 1}))
    key = found["results"][0][d.key]
    data = json.loads(await demo.call(d.tools[0], {d.key: key}))
    demo.answer(f"The {d.attribute(attribute).phrase} of {d.ref_of(key)} is {_value(data[attribute])}.")


async def _say(demo: Demonstration, text: str) -> None:
    demo.answer(text)


# -- generation -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drawn:
    prompt: str
    expected: Any
    plan: Plan
    tools: tuple[str, ...]
    fault: Fault | None = None
    alternatives: tuple[str, ...] = ()


class ServiceTasks:
    """Draws the service families' tasks from a random stream of their own (so the other families' tasks do not
    move when these change)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(f"{seed}:services")
        self.catalogues = {d.name: Catalogue.draw(d, seed) for d in DOMAINS}

    def tools(self) -> list[ToolSpec]:
        return [spec for c in self.catalogues.values() for spec in domain_tools(c)]

    def draw(self, family: str, split: str, i: int) -> Drawn:
        kinds = KINDS[family]
        kind = kinds[i % len(kinds)]
        names = UNSEEN_DOMAINS if family == "unseen_service" else SEEN_DOMAINS
        if family == "no_tool":
            question, answer, word = self.rng.choice(DIRECT[split])
            domain = BY_NAME[names[i % len(names)]]
            expected = Direct(word, (NUMERALS[word],) if word in NUMERALS else ())
            return Drawn(question, expected, partial(_say, text=answer), (*domain.tools, "calculator"))
        # In turn over the domains; a split may hold no record a "cheapest" question can end on: the next domain.
        for step in range(len(names)):
            catalogue = self.catalogues[names[(i // len(kinds) + step) % len(names)]]
            drawn = self._draw(kind, catalogue, split, decline=family == "service_decline")
            if drawn is not None:
                break
        else:  # pragma: no cover - every split holds some domain's cheapest record
            raise RuntimeError(f"no domain can give a {kind} task for {split}")
        if family == "service_choice":
            others = self.rng.sample([n for n in names if n != catalogue.domain.name], DISTRACTORS)
            extra = tuple(tool for n in others for tool in (BY_NAME[n].tools[0], BY_NAME[n].tools[2]))
            tools = (*drawn.tools[:3], *extra, "calculator")
            drawn = Drawn(drawn.prompt, drawn.expected, drawn.plan, tools, drawn.fault, drawn.alternatives)
        if family == "service_recovery":
            tool = catalogue.domain.tools[0 if kind == "lookup" else 2]
            kind_of_fault = FAULT_KINDS[(i // len(kinds)) % len(FAULT_KINDS)]
            drawn = Drawn(drawn.prompt, drawn.expected, drawn.plan, drawn.tools,
                          Fault(tool=tool, kind=kind_of_fault), drawn.alternatives)  # type: ignore[arg-type]
        return drawn

    def _draw(self, kind: str, catalogue: Catalogue, split: str, decline: bool) -> Drawn | None:
        d, r = catalogue.domain, self.rng
        phrasing = r.choice(PHRASINGS[kind][split])
        tools = (*d.tools, "calculator")
        keys = catalogue.keys(split)
        if kind == "lookup":
            key = r.choice(catalogue.unknown_keys(split) if decline else keys)
            attribute = r.choice(d.attributes)
            prompt = phrasing.format(field=attribute.phrase, ref=d.ref_of(key))
            answer = f"The {attribute.phrase} of {d.ref_of(key)} is {{v}}."
            plan = partial(_lookup, d=d, key=key, attribute=attribute.name, answer=answer)
            if decline:
                return Drawn(prompt, None, plan, tools)
            return Drawn(prompt, catalogue.records[key][attribute.name], plan, tools, alternatives=attribute.choices)
        if kind in ("count", "count_any", "count_bound"):
            values = r.sample(d.attribute(d.category).choices, 2 if kind == "count_any" else 1)
            where: dict[str, Any] = {d.category: values}
            price = d.attribute(d.price)
            bound = r.randrange(price.low + (price.high - price.low) // 3, price.high, 5)
            if kind == "count_bound":
                where[f"max_{d.price}"] = bound
            expected = len(catalogue.search(values, where.get(f"max_{d.price}")))
            prompt = phrasing.format(plural=d.plural, category=d.attribute(d.category).phrase, value=values[0],
                                     other=values[-1], price=price.phrase, bound=bound)
            return Drawn(prompt, expected, partial(_count, d=d, where=where), tools)
        if kind in ("quote", "quote_express"):
            key, n, currency = r.choice(keys), r.randint(2, 9), r.choice(tuple(CURRENCIES))
            express = kind == "quote_express"
            options: dict[str, Any] = {"currency": currency, **({"express": True} if express else {})}
            prompt = phrasing.format(n=n, unit=d.unit, ref=d.ref_of(key), currency=currency)
            return Drawn(prompt, catalogue.quote(key, n, currency, express),
                         partial(_quote, d=d, key=key, quantity=n, options=options), tools)
        if kind == "pair":
            a, b = r.sample(keys, 2)
            attribute = r.choice(d.attributes)
            prompt = phrasing.format(field=attribute.phrase, a=d.ref_of(a), b=d.ref_of(b))
            expected = (catalogue.records[a][attribute.name], catalogue.records[b][attribute.name])
            return Drawn(prompt, expected, partial(_pair, d=d, a=a, b=b, attribute=attribute.name), tools,
                         alternatives=attribute.choices)
        if kind == "diff":
            a, b = sorted(r.sample(keys, 2), key=lambda k: -catalogue.records[k][d.price])
            prompt = phrasing.format(price=d.attribute(d.price).phrase, a=d.ref_of(a), b=d.ref_of(b))
            expected = catalogue.records[a][d.price] - catalogue.records[b][d.price]
            return Drawn(prompt, expected, partial(_diff, d=d, a=a, b=b), tools)
        # cheapest: the search sees every record, so only values whose cheapest record is this split's count
        values = [v for v in d.attribute(d.category).choices
                  if (found := catalogue.search(v)) and found[0] in keys]
        if not values:
            return None
        value = r.choice(values)
        attribute = r.choice([a for a in d.attributes if a.name not in (d.price, d.category)])
        best = catalogue.search(value)[0]
        prompt = phrasing.format(field=attribute.phrase, entity=d.entity, plural=d.plural, value=value,
                                 category=d.attribute(d.category).phrase, price=d.attribute(d.price).phrase)
        return Drawn(prompt, catalogue.records[best][attribute.name],
                     partial(_cheapest, d=d, value=value, attribute=attribute.name), tools,
                     alternatives=attribute.choices)

