"""The "tools" suite: short tool-use tasks over a calculator, a small SQLite database, a unit converter and
generated service tools.

Families (see README.md for sizes and the reasons behind the held-out parts):

- ``calculator``: arithmetic answered with the ``calculator`` tool;
- ``sql_lookup``: one value looked up with ``sql_query`` (an employee's salary, department or city; a
  product's price or stock);
- ``chain``: a look-up followed by a calculation (a salary difference, the cost of n units, ...);
- ``cannot``: the right answer is that it cannot be answered (someone or something not in the database,
  a fact the database does not hold, a question no tool can answer);
- ``recovery``: a calculator, sql_lookup or chain task whose first call of one tool fails (timeout,
  empty result or error); success needs a retry;
- the service families (``services.py``): look-ups, searches, quotes, chains, recovery and decline tasks over
  24 tools generated from eight domain templates;
- test only: ``aggregate`` (SUM/AVG/MAX/MIN/COUNT over the database), ``unit_conversion`` (the
  ``convert_units`` tool, offered in no other split) and ``unseen_service`` (two domains' six tools, offered in
  no other split).

Test prompts use their own phrasings and their own employees and products (present in the database,
never asked about in train or validation), so a model cannot pass by recalling training answers; validation
prompts have phrasings and entities of their own too, held out from train and test alike, so choosing a
checkpoint on validation measures more than recall.

Everything is generated from a fixed seed on first use; the database is written once (atomically) to
``<data_dir>/tools-v<N>.db``, ``data_dir`` being ``[training] tasks_dir`` (default
``~/.cache/agent-harness/tasks``).
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from gateway.config import ToolsSettings
from tools.builtin import calculator, sql_query
from tools.context import ToolContext
from tools.registry import ToolRegistry
from training.tasks import services
from training.tasks.base import FAULT_KINDS, SPLITS, Demonstration, Fault, Plan, Suite, Task, format_number
from training.tasks.units import CONVERT_UNITS, convert

SEED = 20240611
DB_VERSION = 2

SYSTEM_PROMPT = (
    "You are a helpful assistant that answers with tools. sql_query reads the company database: "
    "employees(name, department, salary, city) and products(name, price, stock). calculator does arithmetic. "
    "If a tool call fails or returns nothing, call it again. Make independent calls together in one turn. "
    "If a question needs data the tools do not have, say that you cannot; answer general knowledge yourself, "
    "without a call. Answer in one short sentence."
)

BASE_TOOLS = ("calculator", "sql_query")
TEST_TOOL = "convert_units"
TEST_FAMILIES = ("aggregate", "unit_conversion", "unseen_service")

# Decline tasks (cannot, service_decline) stay under a tenth of every split, so a policy that always refuses
# solves less than 10%.
SIZES: dict[str, dict[str, int]] = {
    "train": {"calculator": 66, "sql_lookup": 66, "chain": 52, "cannot": 20, "recovery": 36,
              "service_lookup": 30, "service_search": 18, "service_quote": 18, "service_chain": 18,
              "service_recovery": 12, "service_decline": 8, "service_parallel": 16, "service_choice": 16,
              "no_tool": 48},
    "validation": {"calculator": 7, "sql_lookup": 7, "chain": 7, "cannot": 3, "recovery": 7,
                   "service_lookup": 4, "service_search": 2, "service_quote": 2, "service_chain": 2,
                   "service_recovery": 2, "service_decline": 1, "service_parallel": 2, "service_choice": 2,
                   "no_tool": 3},
    "test": {"calculator": 6, "sql_lookup": 6, "chain": 6, "cannot": 4, "recovery": 5, "aggregate": 7,
             "unit_conversion": 7, "service_lookup": 3, "service_search": 2, "service_quote": 2, "service_chain": 2,
             "service_recovery": 2, "service_decline": 1, "unseen_service": 10, "service_parallel": 2,
             "service_choice": 2, "no_tool": 4},
}
FAULTED_FAMILIES = ("recovery", "service_recovery")  # every task of these has an injected fault
DIRECT_FAMILIES = ("no_tool",)  # no offered tool fits: answered without a call
_ID_PREFIX = {"calculator": "calc", "sql_lookup": "sql", "chain": "chain", "cannot": "cannot", "recovery": "recovery",
              "aggregate": "aggregate", "unit_conversion": "convert", **services.ID_PREFIX}

# -- the database -----------------------------------------------------------------------------------

EMPLOYEES: tuple[tuple[str, str, int, str], ...] = (  # name, department, salary, city
    ("Alice", "Sales", 5200, "Paris"), ("Bob", "Engineering", 6100, "London"),
    ("Carol", "Marketing", 4800, "Berlin"), ("David", "Finance", 5600, "Madrid"),
    ("Emma", "Engineering", 7200, "Paris"), ("Frank", "Support", 3900, "Rome"),
    ("Grace", "Sales", 4500, "London"), ("Henry", "Finance", 6800, "Berlin"),
    ("Irene", "Marketing", 5100, "Oslo"), ("Jack", "Support", 4100, "Madrid"),
    ("Karen", "Engineering", 6600, "Oslo"), ("Leo", "Sales", 3800, "Rome"),
    ("Maria", "Finance", 5900, "Paris"), ("Nathan", "Support", 4300, "Berlin"),
    ("Olivia", "Marketing", 6200, "London"), ("Peter", "Engineering", 5400, "Madrid"),
    ("Quinn", "Sales", 4700, "Oslo"), ("Rachel", "Support", 3600, "Paris"),
    ("Sam", "Finance", 7000, "Rome"), ("Tina", "Marketing", 4400, "Madrid"),
    # asked about only in the validation split
    ("Abel", "Support", 4200, "Rome"), ("Bianca", "Engineering", 6500, "London"),
    ("Cyrus", "Finance", 5300, "Oslo"), ("Dora", "Marketing", 4600, "Berlin"),
    # asked about only in the test split
    ("Umar", "Engineering", 6300, "Berlin"), ("Victor", "Sales", 5000, "Rome"),
    ("Wendy", "Finance", 4900, "London"), ("Xavier", "Support", 4000, "Oslo"),
    ("Yara", "Marketing", 5700, "Paris"), ("Zoe", "Engineering", 6900, "Madrid"),
)
PRODUCTS: tuple[tuple[str, int, int], ...] = (  # name, price, stock
    ("desk lamp", 35, 120), ("office chair", 180, 45), ("standing desk", 420, 12), ("monitor", 240, 60),
    ("keyboard", 45, 150), ("mouse", 20, 300), ("webcam", 60, 80), ("headset", 75, 95),
    ("notebook", 4, 900), ("stapler", 12, 210), ("printer", 260, 18), ("router", 90, 40),
    # asked about only in the validation split
    ("filing cabinet", 130, 22), ("desk mat", 15, 340), ("extension cord", 18, 260),
    # asked about only in the test split
    ("bookshelf", 150, 25), ("whiteboard", 110, 30), ("coffee mug", 8, 500), ("backpack", 55, 70),
)
VALIDATION_EMPLOYEES = ("Abel", "Bianca", "Cyrus", "Dora")
VALIDATION_PRODUCTS = ("filing cabinet", "desk mat", "extension cord")
TEST_EMPLOYEES = ("Umar", "Victor", "Wendy", "Xavier", "Yara", "Zoe")
TEST_PRODUCTS = ("bookshelf", "whiteboard", "coffee mug", "backpack")
# Not in the database: for the cannot family.
UNKNOWN_PEOPLE = ("Hugo", "Nina", "Oscar", "Paula", "Ravi", "Sofia", "Theo", "Felix", "Greta", "Ivan", "Julia",
                  "Kofi")
VALIDATION_UNKNOWN_PEOPLE = ("Hedda", "Ruben", "Talia")
TEST_UNKNOWN_PEOPLE = ("Mateo", "Lena", "Omar", "Beatrix")
UNKNOWN_PRODUCTS = ("tablet", "projector", "scanner", "speaker", "microphone", "shredder")
VALIDATION_UNKNOWN_PRODUCTS = ("label printer", "desk clock")
TEST_UNKNOWN_PRODUCTS = ("drone", "camera", "heater")

_EMPLOYEE = {e[0]: e for e in EMPLOYEES}
_PRODUCT = {p[0]: p for p in PRODUCTS}
_COLUMN_OF = {"salary": 2, "department": 1, "city": 3, "price": 1, "stock": 2}
_VALUES = tuple(sorted({e[1] for e in EMPLOYEES} | {e[3] for e in EMPLOYEES}))  # what a string answer can be


def build_database(path: Path) -> None:
    """Writes the suite's database to ``path`` (atomically: a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        db = sqlite3.connect(tmp)
        with db:
            db.execute("CREATE TABLE employees (name TEXT PRIMARY KEY, department TEXT NOT NULL, "
                       "salary INTEGER NOT NULL, city TEXT NOT NULL)")
            db.execute("CREATE TABLE products (name TEXT PRIMARY KEY, price INTEGER NOT NULL, "
                       "stock INTEGER NOT NULL)")
            db.executemany("INSERT INTO employees VALUES (?, ?, ?, ?)", EMPLOYEES)
            db.executemany("INSERT INTO products VALUES (?, ?, ?)", PRODUCTS)
            db.execute(f"PRAGMA user_version = {DB_VERSION}")
        db.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def database_ok(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            counts = (db.execute("SELECT count(*) FROM employees").fetchone()[0],
                      db.execute("SELECT count(*) FROM products").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return False
    return version == DB_VERSION and counts == (len(EMPLOYEES), len(PRODUCTS))


DEFAULT_DATA_DIR = "~/.cache/agent-harness/tasks"  # [training] tasks_dir's default


# -- phrasings ----------------------------------------------------------------------------------------
# "seen" phrasings serve train; "validation" and "test" phrasings appear only in their own split, so validation
# (checkpoint choice, rollback, the hacking alarm) measures more than recall of the training prompts.

_CALC_EXPRESSIONS = {
    "add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "div": "{a} / {b}", "sqrt": "sqrt({a})",
    "pow": "{a} ** {b}", "addmul": "({a} + {b}) * {c}", "submul": "({a} - {b}) * {c}",
}
CALC_SEEN: tuple[tuple[str, str], ...] = (  # (kind, phrasing)
    ("add", "What is {a} plus {b}?"), ("sub", "What is {a} minus {b}?"), ("mul", "What is {a} times {b}?"),
    ("div", "What is {a} divided by {b}?"), ("sqrt", "What is the square root of {a}?"),
    ("add", "Add {a} and {b}."), ("sub", "Subtract {b} from {a}."), ("mul", "Multiply {a} by {b}."),
    ("div", "Divide {a} by {b}."), ("pow", "What is {a} to the power of {b}?"),
    ("add", "Calculate {a} + {b}."), ("sub", "Calculate {a} - {b}."), ("mul", "Calculate {a} * {b}."),
    ("div", "Calculate {a} / {b}."), ("sqrt", "Calculate sqrt({a})."), ("pow", "Calculate {a} ** {b}."),
    ("add", "What is the sum of {a} and {b}?"), ("addmul", "What is ({a} + {b}) * {c}?"),
    ("submul", "Calculate ({a} - {b}) * {c}."),
    ("add", "What is the total of {a} and {b}?"), ("sub", "How much is {a} less {b}?"),
    ("mul", "What is the product of {a} and {b}?"), ("div", "How much is {a} divided by {b}?"),
    ("sqrt", "Find the square root of {a}."), ("pow", "What is {a} raised to the power {b}?"),
    ("addmul", "Multiply the sum of {a} and {b} by {c}."), ("sub", "If you subtract {b} from {a}, what is left?"),
    ("mul", "Compute {a} multiplied by {b}."), ("div", "What is {a} over {b}?"),
    ("submul", "Multiply the difference of {a} and {b} by {c}."), ("add", "Compute {a} plus {b}."),
    ("sqrt", "Give me the square root of {a}."), ("addmul", "Compute ({a} + {b}) * {c}."),
)
CALC_VALIDATION: tuple[tuple[str, str], ...] = (
    ("add", "Please work out {a} added to {b}."), ("sub", "Tell me what is left when {b} is taken from {a}."),
    ("mul", "What do you get when {a} is multiplied by {b}?"), ("div", "Work out {a} split into {b} equal parts."),
    ("pow", "Raise {a} to exponent {b} and give the result."),
    ("submul", "Subtract {b} from {a} and multiply what is left by {c}."),
)
CALC_TEST: tuple[tuple[str, str], ...] = (
    ("add", "Using exact arithmetic, what do {a} and {b} add up to?"),
    ("sub", "Starting from {a}, take away {b}. What remains?"),
    ("mul", "Find the result of multiplying {a} by {b}."),
    ("div", "If {a} is shared equally between {b} people, how much does each person get?"),
    ("sqrt", "Which number, multiplied by itself, gives {a}?"),
    ("addmul", "Take {a}, add {b}, then multiply the result by {c}. What is the outcome?"),
)

LOOKUP_SEEN: tuple[tuple[str, str], ...] = (  # (attribute, phrasing)
    ("salary", "What is {name}'s salary?"), ("department", "Which department does {name} work in?"),
    ("city", "In which city does {name} work?"), ("price", "What is the price of the {product}?"),
    ("stock", "How many units of the {product} are in stock?"), ("salary", "How much does {name} earn?"),
    ("department", "What department is {name} in?"), ("city", "Which city is {name} based in?"),
    ("price", "How much does the {product} cost?"), ("stock", "What is the stock of the {product}?"),
    ("salary", "Look up the salary of {name}."), ("department", "Look up the department of {name}."),
    ("city", "What city does {name} work in?"), ("price", "Look up the price of the {product}."),
    ("stock", "How many {product} units do we have?"), ("salary", "What does {name} make?"),
    ("department", "{name} belongs to which department?"), ("city", "Look up the city of {name}."),
    ("price", "What does the {product} cost?"), ("stock", "Look up the stock of the {product}."),
    ("salary", "Tell me how much {name} earns."), ("department", "In what department does {name} work?"),
    ("city", "What city is {name} in?"), ("price", "Give me the price of the {product}."),
    ("stock", "How much stock of the {product} is there?"), ("salary", "Give me the salary of {name}."),
)
LOOKUP_VALIDATION: tuple[tuple[str, str], ...] = (
    ("salary", "Find out the pay of {name}."), ("department", "Tell me {name}'s department."),
    ("city", "Where is {name}'s office located?"), ("price", "Tell me what the {product} is priced at."),
    ("stock", "Check how many of the {product} we still have."),
)
LOOKUP_TEST: tuple[tuple[str, str], ...] = (
    ("salary", "According to the records, what is {name} paid?"),
    ("department", "Name the department that employs {name}."),
    ("city", "{name} is assigned to an office in which city?"),
    ("price", "What would a single {product} set me back?"),
    ("stock", "How many {product} items are left in the warehouse?"),
)
LOOKUP_ANSWERS = {
    "salary": "{name}'s salary is {v}.", "department": "{name} works in the {v} department.",
    "city": "{name} is based in {v}.", "price": "The {product} costs {v}.",
    "stock": "There are {v} units of the {product} in stock.",
}

CHAIN_SEEN: tuple[tuple[str, str], ...] = (  # (kind, phrasing)
    ("diff", "How much more does {a} earn than {b}?"), ("together", "What do {a} and {b} earn together?"),
    ("cost", "How much do {n} units of the {product} cost?"),
    ("value", "What is the total value of the {product} stock?"),
    ("raise", "What would {a}'s salary be after a {p} percent raise?"),
    ("diff", "What is the difference between {a}'s salary and {b}'s salary?"),
    ("together", "What is the combined salary of {a} and {b}?"),
    ("cost", "What would it cost to buy {n} units of the {product}?"),
    ("value", "How much is the whole stock of the {product} worth?"),
    ("raise", "If {a} gets a {p} percent raise, what is the new salary?"),
    ("diff", "How much less does {b} earn than {a}?"), ("together", "Add {a}'s salary to {b}'s salary."),
    ("cost", "What is the price of {n} units of the {product} in total?"),
    ("value", "Multiply the price of the {product} by its stock."),
    ("raise", "What is {a}'s salary after a {p} percent increase?"),
    ("diff", "Subtract {b}'s salary from {a}'s salary."),
    ("together", "What is the sum of the salaries of {a} and {b}?"),
    ("cost", "Tell me the total cost of {n} units of the {product}."),
    ("value", "What is all the stock of the {product} worth at its price?"),
    ("raise", "{a}'s salary goes up by {p} percent. What is it now?"),
)
CHAIN_VALIDATION: tuple[tuple[str, str], ...] = (
    ("diff", "Work out the pay gap between {a} and {b}."),
    ("together", "Tell me the total pay of {a} plus {b}."),
    ("cost", "Price out an order of {n} of the {product}."),
    ("value", "Put a value on all the {product} units we hold."),
    ("raise", "Work out {a}'s pay once it goes up by {p} percent."),
)
CHAIN_TEST: tuple[tuple[str, str], ...] = (
    ("diff", "By how much does the pay of {a} exceed the pay of {b}?"),
    ("together", "If you combine the pay of {a} and {b}, what figure do you get?"),
    ("cost", "I want to order {n} units of the {product}. What will the bill come to?"),
    ("value", "At list price, what is the {product} inventory worth?"),
    ("raise", "Suppose {a} gets a pay increase of {p} percent. What would the new salary be?"),
)

MISSING_SEEN: tuple[tuple[str, str], ...] = (  # (what the database lacks, phrasing)
    ("age", "What is {name}'s age?"), ("email address", "What is {name}'s email address?"),
    ("phone number", "What is {name}'s phone number?"), ("start date", "When did {name} join the company?"),
    ("nationality", "What is {name}'s nationality?"), ("job title", "What is {name}'s job title?"),
    ("work experience", "How many years of experience does {name} have?"),
    ("hobby", "What does {name} like to do on weekends?"),
)
MISSING_VALIDATION: tuple[tuple[str, str], ...] = (
    ("home address", "Where does {name} live?"), ("birthday", "On which day is {name}'s birthday?"),
)
MISSING_TEST: tuple[tuple[str, str], ...] = (
    ("education", "From which university did {name} earn a degree?"),
    ("manager", "Who is the line manager of {name}?"),
)
SCOPE_SEEN: tuple[str, ...] = (
    "What is the weather in Paris today?", "Who won the football match last night?",
    "What time is it in Tokyo right now?", "What will the price of gold be next year?",
    "Book me a flight to Rome for Friday.", "What is the latest news about the company?",
    "Send an email to Alice saying hello.", "What is the exchange rate of the dollar today?",
    "What song is playing on the radio right now?", "How many people visited our website yesterday?",
    "Order a pizza for the office.", "Is it going to rain in London tomorrow?",
)
SCOPE_VALIDATION: tuple[str, ...] = (
    "Reserve a meeting room for tomorrow at ten.", "What are the top headlines this hour?",
    "How busy is the motorway to the airport right now?",
)
SCOPE_TEST: tuple[str, ...] = (
    "Will the evening train to Berlin be late?", "Which team will win the next World Cup?",
    "Translate this contract into Japanese and post it to our lawyer.",
    "How many emails did Carol receive this morning?",
)

AGGREGATE_TEST: tuple[tuple[str, str], ...] = (  # (kind, phrasing); test only
    ("sum_dept", "Add up the salaries of everyone in the {dept} department."),
    ("count_city", "How many employees are based in {city}?"),
    ("avg_dept", "What is the average salary in the {dept} department?"),
    ("max_dept", "What is the highest salary in the {dept} department?"),
    ("count_price", "How many products cost more than {p}?"),
    ("min_city", "Which is the smallest salary anyone in {city} earns?"),
)
CONVERT_TEST: tuple[tuple[str, str, str], ...] = (  # (from, to, phrasing); test only
    ("km", "mi", "How many miles is {v} kilometers?"), ("lb", "kg", "Convert {v} pounds to kilograms."),
    ("F", "C", "What is {v} degrees Fahrenheit in Celsius?"), ("in", "cm", "How many centimeters are in {v} inches?"),
    ("kg", "lb", "Express {v} kilograms in pounds."), ("C", "F", "What is {v} degrees Celsius in Fahrenheit?"),
)
_UNIT_NAMES = {"mi": "miles", "kg": "kilograms", "C": "degrees Celsius", "cm": "centimeters", "lb": "pounds",
               "F": "degrees Fahrenheit"}

REFUSE_PERSON = "I cannot answer that: there is no employee named {name} in the database."
REFUSE_PRODUCT = "I cannot answer that: there is no product called {product} in the database."
REFUSE_MISSING = "I cannot answer that: the database has no {what} information."
REFUSE_SCOPE = "I cannot answer that: none of my tools can provide this information."

ANSWER = "The answer is {v}."

# What each split draws its phrasings from.
CALC = {"train": CALC_SEEN, "validation": CALC_VALIDATION, "test": CALC_TEST}
LOOKUP = {"train": LOOKUP_SEEN, "validation": LOOKUP_VALIDATION, "test": LOOKUP_TEST}
CHAIN = {"train": CHAIN_SEEN, "validation": CHAIN_VALIDATION, "test": CHAIN_TEST}
MISSING = {"train": MISSING_SEEN, "validation": MISSING_VALIDATION, "test": MISSING_TEST}
SCOPE = {"train": SCOPE_SEEN, "validation": SCOPE_VALIDATION, "test": SCOPE_TEST}
UNKNOWN = {"train": (UNKNOWN_PEOPLE, UNKNOWN_PRODUCTS), "validation": (VALIDATION_UNKNOWN_PEOPLE,
           VALIDATION_UNKNOWN_PRODUCTS), "test": (TEST_UNKNOWN_PEOPLE, TEST_UNKNOWN_PRODUCTS)}


def _fragments(phrasing: str) -> list[str]:
    return [f.strip() for f in re.split(r"\{\w+\}", phrasing) if f.strip()]


def held_out_fragments(split: str) -> tuple[str, ...]:
    """One distinctive piece of text per phrasing only ``split`` (validation or test) uses: its longest literal
    fragment."""
    extra = (*AGGREGATE_TEST, *CONVERT_TEST) if split == "test" else ()
    phrasings = [p for *_, p in (*CALC[split], *LOOKUP[split], *CHAIN[split], *MISSING[split], *extra)]
    return tuple(max(_fragments(p), key=len) for p in (*phrasings, *SCOPE[split], *services.phrasings(split)))


def test_only_fragments() -> tuple[str, ...]:
    """One distinctive piece of text per test-only phrasing: its longest literal fragment."""
    return held_out_fragments("test")


test_only_fragments.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


# -- plans: how a perfect agent solves each task -----------------------------------------------------



def _rows(output: str) -> list[dict[str, Any]]:
    data = json.loads(output)
    return [dict(zip(data["columns"], row, strict=True)) for row in data["rows"]]


def _number(text: str) -> float | int:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def retry_arguments(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments a demonstration retries a failed call with: the same request written a little differently.

    (The agent loop refuses the very same call made twice in a row, so a retry must differ.)
    """
    if name == "sql_query":
        query = arguments["query"]
        pair = re.fullmatch(r"(SELECT name, .*) WHERE name IN \('([^']*)', '([^']*)'\)", query)
        if pair:
            return {"query": f"{pair.group(1)} WHERE name = '{pair.group(2)}' OR name = '{pair.group(3)}'"}
        if query.startswith("SELECT ") and not query.startswith("SELECT name"):
            return {"query": "SELECT name, " + query.removeprefix("SELECT ")}
        return {"query": query + " LIMIT 100"}
    if name == "calculator":
        expression = arguments["expression"]
        return {"expression": expression.replace(" ", "") if " " in expression else f"({expression})"}
    if name == "convert_units":
        return {**arguments, "value": float(arguments["value"])} if isinstance(arguments["value"], int) \
            else {**arguments, "from_unit": arguments["from_unit"] + " "}
    return arguments


async def _calc(demo: Demonstration, expression: str) -> None:
    out = await demo.call("calculator", {"expression": expression})
    demo.answer(ANSWER.format(v=format_number(_number(out))))


async def _lookup(demo: Demonstration, table: str, key: str, column: str, answer: str, refusal: str) -> None:
    rows = _rows(await demo.call("sql_query", {"query": f"SELECT {column} FROM {table} WHERE name = {_quote(key)}"}))
    if not rows:
        demo.answer(refusal)
        return
    value = rows[0][column]
    demo.answer(answer.format(v=format_number(value) if isinstance(value, int | float) else value))


async def _pair(demo: Demonstration, a: str, b: str, op: str) -> None:
    rows = _rows(await demo.call(
        "sql_query", {"query": f"SELECT name, salary FROM employees WHERE name IN ({_quote(a)}, {_quote(b)})"}))
    salary = {r["name"]: r["salary"] for r in rows}
    await _calc(demo, f"{salary[a]} {op} {salary[b]}")


async def _product(demo: Demonstration, product: str, columns: str, expression: str) -> None:
    query = f"SELECT {columns} FROM products WHERE name = {_quote(product)}"
    rows = _rows(await demo.call("sql_query", {"query": query}))
    await _calc(demo, expression.format(**rows[0]))


async def _raise(demo: Demonstration, name: str, percent: int) -> None:
    rows = _rows(await demo.call("sql_query", {"query": f"SELECT salary FROM employees WHERE name = {_quote(name)}"}))
    await _calc(demo, f"{rows[0]['salary']} * (100 + {percent}) / 100")


async def _aggregate(demo: Demonstration, query: str) -> None:
    rows = _rows(await demo.call("sql_query", {"query": query}))
    demo.answer(ANSWER.format(v=format_number(next(iter(rows[0].values())))))


async def _convert(demo: Demonstration, value: int, source: str, target: str) -> None:
    data = json.loads(await demo.call("convert_units", {"value": value, "from_unit": source, "to_unit": target}))
    demo.answer(ANSWER.format(v=f"{format_number(data['value'])} {_UNIT_NAMES[target]}"))


async def _say(demo: Demonstration, text: str) -> None:
    demo.answer(text)


# -- generation -------------------------------------------------------------------------------------

Draft = tuple[str, Any, Plan, str | None]  # prompt, expected, plan, the tool a recovery fault should hit


def _held(name: str, validation: tuple[str, ...], test: tuple[str, ...]) -> str:
    """Which split asks about ``name``: its own held-out list's, else train."""
    return "validation" if name in validation else "test" if name in test else "train"


class _Generator:
    """Draws every split's tasks in one fixed order from one seeded ``random.Random``."""

    def __init__(self, seed: int, stream: str | None = None) -> None:
        """``stream``: a name for a draw of its own (e.g. the gate's), from random streams apart from the splits'
        (the records and tools, drawn from ``seed`` alone, stay the same)."""
        self.rng = random.Random(seed if stream is None else f"{seed}:{stream}")
        self.services = services.ServiceTasks(seed)
        if stream is not None:
            self.services.rng = random.Random(f"{seed}:services:{stream}")
        self.seen: set[str] = set()
        self.tasks: dict[str, list[Task]] = {}
        self.plans: dict[str, Plan] = {}
        self.alternatives: dict[str, tuple[str, ...]] = {}

    def run(self) -> None:
        for split in ("train", "validation", "test"):
            self.tasks[split] = self.draw(split, SIZES[split], split)

    def draw(self, split: str, counts: dict[str, int], label: str) -> list[Task]:
        """``counts`` tasks of each family from ``split``'s templates, their ids under ``tools/<label>/``."""
        return [self._task(split, family, i, label) for family, count in counts.items() for i in range(count)]

    def _task(self, split: str, family: str, i: int, label: str | None = None) -> Task:
        for _ in range(1000):
            drawn = self.services.draw(family, split, i) if family in services.FAMILIES else \
                self._database_task(split, family, i)
            if drawn.prompt not in self.seen:
                break
        else:  # pragma: no cover - the pools are far larger than the sizes
            raise RuntimeError(f"could not draw a fresh {family} prompt for {split}")
        self.seen.add(drawn.prompt)
        task_id = f"tools/{label or split}/{_ID_PREFIX[family]}-{i:03d}"
        self.plans[task_id] = drawn.plan
        if drawn.alternatives:
            self.alternatives[task_id] = drawn.alternatives
        return Task(id=task_id, suite="tools", family=family, split=split, prompt=drawn.prompt, tools=drawn.tools,
                    expected=drawn.expected, fault=drawn.fault)

    def _database_task(self, split: str, family: str, i: int) -> services.Drawn:
        """One draw of a task of the database families (calculator, look-ups, chains, cannot, recovery, ...)."""
        if family != "recovery":
            prompt, expected, plan, _ = self._draft(family, split, i)
            tools = (*BASE_TOOLS, TEST_TOOL) if family == "unit_conversion" else BASE_TOOLS
            return services.Drawn(prompt, expected, plan, tools)
        # Every (base family, fault kind) pair once in each run of nine; a chain's fault hits its
        # look-up in three of those runs' chains and its calculation in the next three.
        base = ("sql_lookup", "calculator", "chain")[i % 3]
        prompt, expected, plan, fault_tool = self._draft(base, split, i // 3)
        if base == "chain":
            fault_tool = ("sql_query", "calculator")[(i // 9) % 2]
        assert fault_tool is not None
        fault = Fault(tool=fault_tool, kind=FAULT_KINDS[(i + i // 3) % 3])  # type: ignore[arg-type]
        return services.Drawn(prompt, expected, plan, BASE_TOOLS, fault)

    def _draft(self, family: str, split: str, i: int) -> Draft:
        return getattr(self, f"_{family}")(split, i)

    # Each family: (prompt, expected, plan, fault tool for a recovery variant).

    def _calculator(self, split: str, i: int) -> Draft:
        bank = CALC[split]
        kind, phrasing = bank[i % len(bank)]
        r = self.rng
        c = r.randint(2, 12)
        if kind == "add":
            a, b = r.randint(12, 999), r.randint(12, 999)
            expected: float = a + b
        elif kind == "sub":
            a = r.randint(100, 999)
            b = r.randint(11, a - 1)
            expected = a - b
        elif kind == "mul":
            a, b = r.randint(3, 99), r.randint(3, 49)
            expected = a * b
        elif kind == "div":
            b, q = r.randint(2, 24), r.randint(3, 60)
            a, expected = b * q, q
        elif kind == "sqrt":
            b = expected = r.randint(4, 40)
            a = b * b
        elif kind == "pow":
            a, b = r.randint(2, 12), r.randint(2, 4)
            expected = a ** b
        elif kind == "addmul":
            a, b = r.randint(2, 60), r.randint(2, 60)
            expected = (a + b) * c
        else:  # submul
            a = r.randint(20, 99)
            b = r.randint(2, a - 1)
            expected = (a - b) * c
        expression = _CALC_EXPRESSIONS[kind].format(a=a, b=b, c=c)
        return phrasing.format(a=a, b=b, c=c), expected, partial(_calc, expression=expression), "calculator"

    def _people(self, split: str) -> list[str]:
        return [e[0] for e in EMPLOYEES if _held(e[0], VALIDATION_EMPLOYEES, TEST_EMPLOYEES) == split]

    def _products(self, split: str) -> list[str]:
        return [p[0] for p in PRODUCTS if _held(p[0], VALIDATION_PRODUCTS, TEST_PRODUCTS) == split]

    def _sql_lookup(self, split: str, i: int) -> Draft:
        bank = LOOKUP[split]
        attribute, phrasing = bank[i % len(bank)]
        if attribute in ("price", "stock"):
            product = self.rng.choice(self._products(split))
            expected = _PRODUCT[product][_COLUMN_OF[attribute]]
            plan = partial(_lookup, table="products", key=product, column=attribute,
                           answer=LOOKUP_ANSWERS[attribute].replace("{product}", product),
                           refusal=REFUSE_PRODUCT.format(product=product))
            return phrasing.format(product=product), expected, plan, "sql_query"
        name = self.rng.choice(self._people(split))
        expected = _EMPLOYEE[name][_COLUMN_OF[attribute]]
        plan = partial(_lookup, table="employees", key=name, column=attribute,
                       answer=LOOKUP_ANSWERS[attribute].replace("{name}", name),
                       refusal=REFUSE_PERSON.format(name=name))
        return phrasing.format(name=name), expected, plan, "sql_query"

    def _chain(self, split: str, i: int) -> Draft:
        bank = CHAIN[split]
        kind, phrasing = bank[i % len(bank)]
        r = self.rng
        fault_tool = "sql_query"
        if kind in ("diff", "together"):
            a, b = r.sample(self._people(split), 2)
            sa, sb = _EMPLOYEE[a][2], _EMPLOYEE[b][2]
            if kind == "diff":
                if sa == sb:
                    return self._chain(split, i)
                if sa < sb:
                    a, b, sa, sb = b, a, sb, sa
            op = "-" if kind == "diff" else "+"
            expected = sa - sb if kind == "diff" else sa + sb
            return phrasing.format(a=a, b=b), expected, partial(_pair, a=a, b=b, op=op), fault_tool
        if kind == "raise":
            a, p = r.choice(self._people(split)), r.choice((5, 10, 20, 25))
            expected = _EMPLOYEE[a][2] * (100 + p) // 100
            return phrasing.format(a=a, p=p), expected, partial(_raise, name=a, percent=p), fault_tool
        product = r.choice(self._products(split))
        _, price, stock = _PRODUCT[product]
        if kind == "cost":
            n = r.randint(2, 12)
            plan = partial(_product, product=product, columns="price", expression=f"{{price}} * {n}")
            return phrasing.format(n=n, product=product), price * n, plan, fault_tool
        plan = partial(_product, product=product, columns="price, stock", expression="{price} * {stock}")
        return phrasing.format(product=product), price * stock, plan, fault_tool

    def _cannot(self, split: str, i: int) -> Draft:
        kind = ("person", "product", "missing", "scope", "person")[i % 5] if split == "test" else \
            ("person", "product", "missing", "scope")[i % 4]
        r = self.rng
        if kind == "scope":
            return r.choice(SCOPE[split]), None, partial(_say, text=REFUSE_SCOPE), None
        if kind == "missing":
            what, phrasing = r.choice(MISSING[split])
            name = r.choice(self._people(split))
            return phrasing.format(name=name), None, partial(_say, text=REFUSE_MISSING.format(what=what)), None
        wanted = ("price", "stock") if kind == "product" else ("salary", "department", "city")
        attribute, phrasing = r.choice([(a, p) for a, p in LOOKUP[split] if a in wanted])
        people, products = UNKNOWN[split]
        if kind == "product":
            product = r.choice(products)
            plan = partial(_lookup, table="products", key=product, column=attribute, answer="",
                           refusal=REFUSE_PRODUCT.format(product=product))
            return phrasing.format(product=product), None, plan, None
        name = r.choice(people)
        plan = partial(_lookup, table="employees", key=name, column=attribute, answer="",
                       refusal=REFUSE_PERSON.format(name=name))
        return phrasing.format(name=name), None, plan, None

    def _aggregate(self, split: str, i: int) -> Draft:
        assert split == "test", "aggregate is a test-only family"
        kind, phrasing = AGGREGATE_TEST[i % len(AGGREGATE_TEST)]
        r = self.rng
        departments = sorted({e[1] for e in EMPLOYEES})
        cities = sorted({e[3] for e in EMPLOYEES})
        if kind == "count_price":
            p = r.choice((30, 50, 100, 200))
            expected: float = sum(1 for x in PRODUCTS if x[1] > p)
            query = f"SELECT COUNT(*) FROM products WHERE price > {p}"
            return phrasing.format(p=p), expected, partial(_aggregate, query=query), "sql_query"
        if kind in ("count_city", "min_city"):
            city = r.choice(cities)
            salaries = [e[2] for e in EMPLOYEES if e[3] == city]
            expected = len(salaries) if kind == "count_city" else min(salaries)
            what = "COUNT(*)" if kind == "count_city" else "MIN(salary)"
            query = f"SELECT {what} FROM employees WHERE city = {_quote(city)}"
            return phrasing.format(city=city), expected, partial(_aggregate, query=query), "sql_query"
        dept = r.choice(departments)
        salaries = [e[2] for e in EMPLOYEES if e[1] == dept]
        what, expected = {"sum_dept": ("SUM(salary)", sum(salaries)),
                          "avg_dept": ("AVG(salary)", sum(salaries) / len(salaries)),
                          "max_dept": ("MAX(salary)", max(salaries))}[kind]
        query = f"SELECT {what} FROM employees WHERE department = {_quote(dept)}"
        return phrasing.format(dept=dept), expected, partial(_aggregate, query=query), "sql_query"

    def _unit_conversion(self, split: str, i: int) -> Draft:
        assert split == "test", "unit_conversion is a test-only family"
        source, target, phrasing = CONVERT_TEST[i % len(CONVERT_TEST)]
        low, high = {"km": (3, 100), "lb": (2, 200), "F": (32, 104), "in": (2, 60), "kg": (1, 100),
                     "C": (0, 40)}[source]
        v = self.rng.randint(low, high)
        plan = partial(_convert, value=v, source=source, target=target)
        return phrasing.format(v=v), round(convert(v, source, target), 6), plan, TEST_TOOL


def _mix(sizes: dict[str, int], count: int, min_faulted: int, min_direct: int = 0) -> dict[str, int]:
    """``count`` tasks shared among the families in proportion to ``sizes`` (largest remainders), the faulted
    families' share raised to ``min_faulted`` and the direct ones' to ``min_direct`` when it is less."""
    groups = [(FAULTED_FAMILIES, min_faulted), (DIRECT_FAMILIES, min_direct)]
    total = sum(sizes.values())
    counts: dict[str, int] = {}
    left = count
    for families, floor in groups:
        group = {f: n for f, n in sizes.items() if f in families}
        if group:
            n = min(left, max(round(count * sum(group.values()) / total), floor))
            counts.update(_shares(group, n))
            left -= n
    grouped = {f for families, _ in groups for f in families}
    return {**_shares({f: n for f, n in sizes.items() if f not in grouped}, left), **counts}


def _shares(weights: dict[str, int], total: int) -> dict[str, int]:
    if not weights:
        return {}
    exact = {f: total * w / sum(weights.values()) for f, w in weights.items()}
    counts = {f: int(x) for f, x in exact.items()}
    for f in sorted(exact, key=lambda f: counts[f] - exact[f])[:total - sum(counts.values())]:
        counts[f] += 1
    return counts


# -- the suite --------------------------------------------------------------------------------------


class ToolsSuite(Suite):
    """Calculator, database look-ups, chains of both, refusals and recovery from tool faults."""

    name = "tools"
    system_prompt = SYSTEM_PROMPT
    # 2: held-out validation and the strict verifier; 3: the service tools; 4: thirty domains, parallel calls, other
    # domains' tools offered, questions no tool fits
    version = "5"

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, seed: int = SEED) -> None:
        self.data_dir = Path(data_dir if data_dir is not None else DEFAULT_DATA_DIR).expanduser()
        self.db_path = self.data_dir / f"tools-v{DB_VERSION}.db"
        self.seed = seed
        self._generated: _Generator | None = None
        self._registry: ToolRegistry | None = None
        self._context: ToolContext | None = None
        self._db_checked = False

    def _generate(self) -> _Generator:
        if self._generated is None:
            generator = _Generator(self.seed)
            generator.run()
            self._generated = generator
        return self._generated

    def tasks(self, split: str) -> list[Task]:
        self.check_split(split)
        return list(self._generate().tasks[split])

    def settings(self) -> ToolsSettings:
        return ToolsSettings(sql_database=str(self.db_path))

    def alternatives(self, task: Task) -> tuple[str, ...]:
        # A department or a city: every department and city; a service field: its enum's values. A reply listing
        # them all fails.
        if not all(isinstance(v, str) for v in task.values):
            return ()
        return self._generate().alternatives.get(task.id, _VALUES)

    def registry(self) -> ToolRegistry:
        if self._registry is None:
            settings = self.settings()
            self._registry = ToolRegistry([calculator.build(settings), sql_query.build(settings), CONVERT_UNITS,
                                           *self._generate().services.tools()])
        return self._registry

    def ensure_database(self) -> Path:
        """The database file, written first when it is missing or out of date."""
        if not self._db_checked or not self.db_path.is_file():
            if not database_ok(self.db_path):
                build_database(self.db_path)
            self._db_checked = True
        return self.db_path

    def context(self) -> ToolContext:
        self.ensure_database()
        if self._context is None:
            self._context = ToolContext(self.settings())
        return self._context

    def plan(self, task: Task) -> Plan:
        plan = self._generate().plans.get(task.id)
        if plan is None or task.suite != self.name:
            raise KeyError(f"no task {task.id!r} in suite {self.name!r}")
        return plan

    def retry_arguments(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return retry_arguments(name, arguments)

    def draw(self, split: str, count: int, *, seed: int, min_faulted: int = 0, min_direct: int = 0) -> list[Task]:
        """``count`` fresh tasks from ``split``'s templates (its phrasings, records and tools), drawn with ``seed``
        in the split's family mix, faulted families raised to ``min_faulted`` tasks in all and those no offered tool
        fits to ``min_direct``. Ids are
        ``tools/<split>-draw-<seed>/...``; no prompt is one of the train or validation split's. The suite can
        solve and verify them like its own."""
        self.check_split(split)
        main = self._generate()
        generator = _Generator(self.seed, stream=f"draw:{split}:{seed}")
        generator.seen = {t.prompt for other in SPLITS if other != split for t in main.tasks[other]}
        tasks = generator.draw(split, _mix(SIZES[split], count, min_faulted, min_direct), f"{split}-draw-{seed}")
        main.plans.update(generator.plans)
        main.alternatives.update(generator.alternatives)
        return tasks

    def test_only_phrasings(self) -> tuple[str, ...]:
        return test_only_fragments()

    def phrasings(self, split: str) -> Sequence[str]:
        """Every phrasing template a split draws from (for inspection)."""
        self.check_split(split)
        if split == "test":
            banks = (CALC_TEST, LOOKUP_TEST, CHAIN_TEST, MISSING_TEST, AGGREGATE_TEST, CONVERT_TEST)
            return [p for bank in banks for *_, p in bank] + list(SCOPE_TEST) + services.phrasings(split)
        banks = (CALC[split], LOOKUP[split], CHAIN[split], MISSING[split])
        return [p for bank in banks for *_, p in bank] + list(SCOPE[split]) + services.phrasings(split)
