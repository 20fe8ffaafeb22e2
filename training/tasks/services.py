"""Generated service tools and their tasks: many functions over several domains, from templates.

Each ``Domain`` (flights, books, hotels, ...) is a template: an entity with a key and typed attributes. From it
come, seeded and reproducible,

- its records (``Domain.records``): enum attributes drawn from their choices, numbers from their ranges, the
  priced attribute distinct within the domain so "the cheapest" has one answer;
- three tools (``domain_tools``), each with its own name and description: a look-up by key, a search (a nested
  ``filter`` object with an optional enum and an optional integer bound, and an optional ``limit``; matches come
  cheapest first) and a quote (an integer ``quantity`` and a nested optional ``options`` object with
  a ``currency`` enum and an ``express`` boolean);
- tasks in six families (``FAMILIES``), each with several phrasings per split: ``service_lookup``,
  ``service_search`` (a count, with or without a price bound), ``service_quote``, ``service_chain`` (two look-ups
  and a calculation, or a search then a look-up), ``service_recovery`` (a look-up or a quote whose first call
  fails) and ``service_decline`` (a key the service does not know: the right answer is that it cannot say).

Held out: each seen domain's keys are split between train, validation and test, and the prompts of each split
have phrasings of their own; two domains (``UNSEEN_DOMAINS``: six tools) appear only in test, as the family
``unseen_service``, so a model must use tools it has only seen described in the request.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from tools.context import ToolContext
from tools.spec import ToolSpec
from training.tasks.base import FAULT_KINDS, Demonstration, Fault, Plan, format_number

CURRENCIES = {"EUR": 1.0, "USD": 1.1, "GBP": 0.85}  # a quote's total in each, from its price in EUR
EXPRESS_FEE = 15  # EUR added to a quote with express service
SPLIT_OF_KEY = ("train",) * 4 + ("validation", "test")  # a seen domain's keys by position, in runs of six


@dataclass(frozen=True)
class Attribute:
    name: str  # the field in tool results and schemas, e.g. "fare"
    phrase: str  # how a prompt names it, e.g. "fare"
    kind: Literal["integer", "enum"]
    choices: tuple[str, ...] = ()  # an enum's values
    low: int = 0  # an integer's range
    high: int = 0


@dataclass(frozen=True)
class Domain:
    name: str
    entity: str  # "flight"
    plural: str  # "flights"
    ref: str  # how a prompt names one record: "flight {key}"
    key: str  # the key parameter: "flight_number"
    key_phrase: str  # "flight number"
    prefixes: tuple[str, ...]  # keys are prefix + suffix pairs
    suffixes: tuple[str, ...]
    attributes: tuple[Attribute, ...]
    category: str  # the enum attribute searches filter on
    price: str  # the integer attribute quotes multiply and searches bound and sort by
    unit: str  # what a quote's quantity counts: "seats"
    tools: tuple[str, str, str]  # the look-up, search and quote tools' names
    what: str  # what the service is, for descriptions: "the airline's flight schedule"
    size: int = 18
    joiner: str = " "

    def attribute(self, name: str) -> Attribute:
        return next(a for a in self.attributes if a.name == name)

    def ref_of(self, key: str) -> str:
        return self.ref.format(key=key)


def _int(name: str, phrase: str, low: int, high: int) -> Attribute:
    return Attribute(name, phrase, "integer", low=low, high=high)


def _enum(name: str, phrase: str, *choices: str) -> Attribute:
    return Attribute(name, phrase, "enum", choices=choices)


DOMAINS: tuple[Domain, ...] = (
    Domain("flights", "flight", "flights", "flight {key}", "flight_number", "flight number",
           ("AZ", "KL", "LX", "OS", "SK", "TP"), ("214", "388", "452", "617", "730", "845"),
           (_enum("status", "status", "on time", "delayed", "cancelled", "boarding"),
            _enum("terminal", "terminal", "north", "south", "central"),
            _int("fare", "fare", 60, 480), _int("seats_left", "number of free seats", 0, 90)),
           "status", "fare", "seats", ("get_flight", "search_flights", "quote_fare"),
           "the airline's flight schedule", joiner=""),
    Domain("books", "book", "books", "the book {key}", "title", "title",
           ("Winter", "Silent", "Hidden", "Golden", "Broken", "Distant"),
           ("Harbor", "Orchard", "Lantern", "Compass", "Meadow", "Archive"),
           (_enum("genre", "genre", "mystery", "history", "poetry", "science"),
            _enum("shelf", "shelf", "upper", "middle", "lower"),
            _int("weekly_rent", "weekly rental price", 2, 40), _int("copies", "number of copies", 1, 12)),
           "genre", "weekly_rent", "weeks", ("find_book", "search_catalog", "quote_rental"),
           "the library catalogue"),
    Domain("hotels", "hotel", "hotels", "the {key} hotel", "hotel", "hotel name",
           ("Aurora", "Cedar", "Harbour", "Linden", "Maple", "Summit"),
           ("Lodge", "Court", "House", "Palace", "Inn", "Suites"),
           (_enum("board", "board", "breakfast", "half board", "full board", "room only"),
            _enum("district", "district", "old town", "riverside", "station"),
            _int("nightly_rate", "nightly rate", 45, 390), _int("stars", "star rating", 1, 5)),
           "board", "nightly_rate", "nights", ("get_hotel", "search_hotels", "quote_stay"),
           "the hotel booking service"),
    Domain("cars", "rental car", "rental cars", "the rental car {key}", "plate", "plate number",
           ("RC", "RT", "RV", "RW", "RX", "RY"), ("1042", "2317", "3580", "4621", "5903", "6174"),
           (_enum("category", "category", "economy", "compact", "estate", "minivan"),
            _enum("gearbox", "gearbox", "manual", "automatic"),
            _int("daily_rate", "daily rate", 18, 140), _int("doors", "number of doors", 2, 5)),
           "category", "daily_rate", "days", ("get_car", "search_cars", "quote_rental_car"),
           "the car rental fleet", joiner="-"),
    Domain("dishes", "dish", "dishes", "the dish {key}", "dish", "dish name",
           ("smoked", "spiced", "grilled", "roasted", "braised", "glazed"),
           ("trout", "lentils", "aubergine", "lamb", "tofu", "risotto"),
           (_enum("cuisine", "cuisine", "nordic", "levantine", "andean", "bengali"),
            _enum("course", "course", "starter", "main", "dessert"),
            _int("price", "menu price", 6, 58), _int("calories", "calorie count", 180, 1200)),
           "cuisine", "price", "portions", ("get_dish", "search_menu", "quote_order"),
           "the restaurant's menu"),
    Domain("parcels", "parcel", "parcels", "parcel {key}", "tracking_id", "tracking id",
           ("PK", "PL", "PM", "PN", "PQ", "PR"), ("4821", "5370", "6194", "7038", "8265", "9412"),
           (_enum("state", "delivery state", "in transit", "delivered", "held at customs", "out for delivery"),
            _enum("service", "shipping service", "standard", "priority", "freight"),
            _int("fee", "shipping fee", 4, 96), _int("weight_kg", "weight in kilograms", 1, 40)),
           "state", "fee", "parcels", ("track_parcel", "search_parcels", "quote_shipping"),
           "the courier's tracking system", joiner="-"),
    # Test only: no train or validation task offers these tools.
    Domain("concerts", "concert", "concerts", "the {key} concert", "concert", "concert name",
           ("Velvet", "Copper", "Crimson", "Ivory", "Cobalt", "Amber"),
           ("Echoes", "Tides", "Skyline", "Rhythms", "Voices", "Strings"),
           (_enum("venue", "venue", "arena", "opera house", "open-air stage", "jazz club"),
            _enum("genre", "genre", "rock", "classical", "folk", "electronic"),
            _int("ticket_price", "ticket price", 15, 220), _int("tickets_left", "number of tickets left", 0, 500)),
           "venue", "ticket_price", "tickets", ("get_concert", "search_concerts", "quote_tickets"),
           "the concert box office"),
    Domain("medicines", "medicine", "medicines", "the medicine {key}", "medicine", "medicine name",
           ("Nexo", "Calvi", "Dorma", "Lumi", "Pira", "Tolva"),
           ("dine", "prazole", "cillin", "statin", "mab", "sartan"),
           (_enum("form", "form", "tablet", "capsule", "syrup", "cream"),
            _enum("prescription", "prescription status", "prescription only", "over the counter"),
            _int("pack_price", "pack price", 3, 85), _int("stock", "packs in stock", 0, 300)),
           "form", "pack_price", "packs", ("get_medicine", "search_pharmacy", "quote_medicine"),
           "the pharmacy's stock system", joiner=""),
)
UNSEEN_DOMAINS = ("concerts", "medicines")
_DOMAIN = {d.name: d for d in DOMAINS}

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

    def search(self, value: str | None, bound: int | None = None) -> list[str]:
        """The keys of the records matching, cheapest first."""
        d = self.domain
        keys = [k for k, r in self.records.items() if (value is None or r[d.category] == value)
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
                    d.category: {"type": "string", "enum": list(d.attribute(d.category).choices)},
                    f"max_{d.price}": {"type": "integer", "minimum": 0}}, "additionalProperties": False},
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
    "service_search": ("count", "count", "count_bound"),
    "service_quote": ("quote", "quote", "quote_express"),
    "service_chain": ("diff", "cheapest"),
    "service_recovery": ("lookup", "quote"),
    "service_decline": ("lookup",),
    "unseen_service": ("lookup", "quote", "count", "diff", "cheapest"),
}
FAMILIES = tuple(KINDS)
ID_PREFIX = {family: family.replace("_", "-") for family in FAMILIES}


def phrasings(split: str) -> list[str]:
    return [p for kinds in PHRASINGS.values() for p in kinds[split]]


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


async def _quote(demo: Demonstration, d: Domain, key: str, quantity: int, options: dict[str, Any]) -> None:
    data = json.loads(await demo.call(d.tools[2], {d.key: key, "quantity": quantity, "options": options}))
    demo.answer(f"The total is {format_number(data['total'])} {data['currency']}.")


async def _diff(demo: Demonstration, d: Domain, a: str, b: str) -> None:
    prices = [json.loads(await demo.call(d.tools[0], {d.key: k}))[d.price] for k in (a, b)]
    out = await demo.call("calculator", {"expression": f"{prices[0]} - {prices[1]}"})
    demo.answer(f"The difference is {format_number(float(out))}.")


async def _cheapest(demo: Demonstration, d: Domain, value: str, attribute: str) -> None:
    found = json.loads(await demo.call(d.tools[1], {"filter": {d.category: value}, "limit": 1}))
    key = found["results"][0][d.key]
    data = json.loads(await demo.call(d.tools[0], {d.key: key}))
    demo.answer(f"The {d.attribute(attribute).phrase} of {d.ref_of(key)} is {_value(data[attribute])}.")


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
        names = UNSEEN_DOMAINS if family == "unseen_service" else \
            tuple(d.name for d in DOMAINS if d.name not in UNSEEN_DOMAINS)
        # In turn over the domains; a split may hold no record a "cheapest" question can end on: the next domain.
        for step in range(len(names)):
            catalogue = self.catalogues[names[(i // len(kinds) + step) % len(names)]]
            drawn = self._draw(kind, catalogue, split, decline=family == "service_decline")
            if drawn is not None:
                break
        else:  # pragma: no cover - every split holds some domain's cheapest record
            raise RuntimeError(f"no domain can give a {kind} task for {split}")
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
        if kind in ("count", "count_bound"):
            value = r.choice(d.attribute(d.category).choices)
            where: dict[str, Any] = {d.category: value}
            price = d.attribute(d.price)
            bound = r.randrange(price.low + (price.high - price.low) // 3, price.high, 5)
            if kind == "count_bound":
                where[f"max_{d.price}"] = bound
            expected = len(catalogue.search(value, where.get(f"max_{d.price}")))
            prompt = phrasing.format(plural=d.plural, category=d.attribute(d.category).phrase, value=value,
                                     price=price.phrase, bound=bound)
            return Drawn(prompt, expected, partial(_count, d=d, where=where), tools)
        if kind in ("quote", "quote_express"):
            key, n, currency = r.choice(keys), r.randint(2, 9), r.choice(tuple(CURRENCIES))
            express = kind == "quote_express"
            options: dict[str, Any] = {"currency": currency, **({"express": True} if express else {})}
            prompt = phrasing.format(n=n, unit=d.unit, ref=d.ref_of(key), currency=currency)
            return Drawn(prompt, catalogue.quote(key, n, currency, express),
                         partial(_quote, d=d, key=key, quantity=n, options=options), tools)
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

