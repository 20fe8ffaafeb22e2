#!/usr/bin/env python3
"""The web console's latency on a large store: the list page, search and trajectory pages, timed by the gateway.

1. Generates (or reuses, from ``bench/results/``) an SQLite store of N trajectories (default 100,000) of 5 model calls
   each, plus one agent run of 50 steps with its tool calls, events and per-step rewards. Rows are written straight
   into the file with ``sqlite3`` in large transactions (the store's own write path would take an hour), but they
   are the rows the store's writer makes: the schema from ``replay.schema.migrate``, the writer's own INSERT
   statements, content-addressed message bodies (``replay.hashing``) in ``blobs`` with each call's
   ``request_messages`` / ``response_messages`` holding their keys, and each call's ``trajectory_text`` row from
   ``replay.search_text.call_text``. Text is drawn from a Zipf-distributed vocabulary of 4,000 made-up words, with
   a few planted words of known rarity to search for. Sources, statuses, models, adapters, rewards and tenants
   vary; ``created_at`` spreads over 30 days, and ids are ULIDs of that time, as the store's are. Before timing,
   the script reads the store back through ``TrajectoryStore`` (``get_trajectory`` on the long run and on a
   normal one, ``search`` for a planted word, with and without filters) and checks what comes back.
2. Starts ``harness serve`` on it (``[server] log_format = "json"``, an admin key in ``HARNESS_ADMIN_KEY``, an
   ``openai`` backend on a closed port, so no model loads) and signs in at ``POST /ui/login`` with the admin key,
   as a browser does (the form's CSRF cookie and field from ``GET /ui/login``).
3. Sends the cases below one at a time (after a warm-up), interleaved round-robin over ``--rounds`` rounds, and
   reads each request's server-side ``latency_ms`` from the gateway's JSON access log (matched to the request by
   order and path); the client's own time is kept beside it. Reports p50 / p95 / max per case and the targets:
   list pages p95 ≤ 150 ms, searches p95 ≤ 1 s, the 50-step trajectory page p95 ≤ 300 ms.

    python bench/console.py                         # 100,000 trajectories (generated once: about a minute)
    python bench/console.py --trajectories 2000     # a quick check of the script
    python bench/console.py --explain               # also print each listing query's plan

Never run in CI; its figures depend on the machine (and on the page cache: the first run after generation reads
a cold file, which the warm-up absorbs only in part).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime as dt
import json
import os
import random
import re
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from ulid import ULID

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gateway_overhead import BenchError, Services, console, free_port, gateway_env, wait_ready  # noqa: E402
from replay import hashing  # noqa: E402
from replay.records import pack  # noqa: E402
from replay.schema import migrate  # noqa: E402
from replay.search_text import call_text  # noqa: E402
from replay.writer import _INSERT_CALL, _INSERT_TEXT, _INSERT_TOOL_CALL, _UPSERT_BLOB  # noqa: E402

RESULTS = REPO / "bench" / "results"
GENERATOR_VERSION = 3  # bump when the generated rows change: the cached file's name carries it
END = dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()  # the newest trajectory; the oldest 30 days before
SPAN = 30 * 86400.0
CHUNK = 2000  # trajectories per transaction
TARGETS = {"list": 150.0, "search": 1000.0, "long": 300.0}  # p95, ms, server side

# Planted words and the share of trajectories whose user message carries each (the rest of the text never does).
PLANTED = {"quokkaflux": 0.00005, "zephyrine": 0.0005, "marigoldia": 0.01}
RARE, MEDIUM = "zephyrine", "marigoldia"

SOURCES = [("proxy", 50), ("agent", 22), ("rollout", 12), ("eval", 6), ("bot", 5), ("demo", 3), ("import", 2)]
STATUSES = [("completed", 80), ("terminated", 8), ("error", 5), ("client_disconnected", 3), ("interrupted", 2),
            ("running", 1), ("pending_approval", 1)]
REASONS = {"terminated": ["max_steps", "loop_detected", "tool_failures", "deadline", "max_total_tokens"],
           "error": ["backend_error"], "client_disconnected": ["client_disconnected"]}
MODELS = [("gpt-4o-mini", "gpt-4o-mini", 30), ("qwen2.5-7b-instruct", "qwen2.5-7b-instruct", 25),
          ("llama-3.1-8b-instruct", "llama-3.1-8b-instruct", 20), ("agent:research", "smollm2-135m", 15),
          ("smollm2-135m", "smollm2-135m", 8), ("mistral-small", "mistral-small", 2)]
ADAPTERS = ["support-lora", "tools-sft", "research-rl"]
TENANTS = [f"tenant-{i:02d}" for i in range(20)]
TOOL_NAMES = ["search", "fetch_page", "calculator", "read_file", "sql_query"]
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name}: a tool the agent may call.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query"]}}} for name in TOOL_NAMES]


def _weights(pairs: list[tuple[Any, ...]]) -> tuple[list[Any], list[float]]:
    values = [p[:-1] if len(p) > 2 else p[0] for p in pairs]
    total, cum = 0.0, []
    for p in pairs:
        total += p[-1]
        cum.append(total)
    return values, cum


def _vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    syllables = ["ka", "lo", "mi", "ren", "tas", "vo", "pel", "qui", "dor", "an", "es", "ul", "bri", "gat", "sen",
                 "ho", "nu", "zar", "fel", "ti", "mor", "cla", "pra", "ver", "sto", "ind", "ex", "ro", "lu", "ba"]
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))))
    ordered = sorted(words)
    rng.shuffle(ordered)
    return [w for w in ordered if w not in PLANTED]


@dataclass
class Plan:
    """What the generator made, for the checks and the cases: ids and values with known answers."""

    trajectories: int
    calls: int
    long_steps: int
    long_id: str = ""
    normal_ids: list[str] = field(default_factory=list)
    deep_before: str = ""
    common_word: str = ""
    planted: dict[str, list[str]] = field(default_factory=dict)  # word -> ids of the trajectories holding it
    filtered_model: str = ""
    since: str = ""
    until: str = ""


class Generator:
    def __init__(self, n: int, calls: int, long_steps: int, seed: int) -> None:
        self.n, self.calls, self.long_steps = n, calls, long_steps
        self.rng = random.Random(seed)
        self.vocab = _vocabulary(self.rng)
        self.vocab_cum = list(_zipf_cum(len(self.vocab)))
        self.sources, self.sources_cum = _weights(SOURCES)
        self.statuses, self.statuses_cum = _weights(STATUSES)
        self.models, self.models_cum = _weights(MODELS)
        self.systems = [{"role": "system", "content": f"You are agent profile {k}. " + self.words(60)}
                        for k in range(8)]
        self.plan = Plan(n, calls, long_steps, common_word=self.vocab[0], planted={w: [] for w in PLANTED},
                         filtered_model=MODELS[4][0])
        self.long_index = n // 2
        self.shared_keys: dict[int, str] = {}  # id() of a shared body (system prompts, tool specs) -> its key

    def words(self, k: int) -> str:
        return " ".join(self.rng.choices(self.vocab, cum_weights=self.vocab_cum, k=k))

    def pick(self, values: list[Any], cum: list[float]) -> Any:
        return values[bisect.bisect_left(cum, self.rng.random() * cum[-1])]

    def ulid(self, at: float) -> str:
        return str(ULID.from_bytes(int(at * 1000).to_bytes(6, "big") + self.rng.randbytes(10)))

    # -- one trajectory's rows -------------------------------------------------------------------------------

    def trajectory(self, i: int, rows: Rows) -> None:
        rng = self.rng
        steps = self.long_steps if i == self.long_index else self.calls
        long = i == self.long_index
        at = END - SPAN + SPAN * i / self.n + rng.random() * SPAN / self.n * 0.5
        tid = self.ulid(at)
        source = "agent" if long else self.pick(self.sources, self.sources_cum)
        status = "completed" if long else self.pick(self.statuses, self.statuses_cum)
        if source == "agent" and status == "running":
            # A run left running would be taken over by the gateway's sweep (its lease long expired), which would
            # write to the store while it is measured.
            status = "interrupted"
        requested, base = self.pick(self.models, self.models_cum)
        adapter = rng.choice(ADAPTERS) if rng.random() < 0.2 else None
        tenant = TENANTS[min(int(rng.expovariate(0.25)), len(TENANTS) - 1)]
        agentic = source in ("agent", "rollout", "eval")
        task = f"task-{rng.randrange(500)}" if source in ("rollout", "eval") else None
        group = f"group-{i // 8}" if source == "rollout" else None
        reward = round(rng.random(), 3) if (agentic or rng.random() < 0.3) and status == "completed" else None
        user_text = f"Request {i}: " + self.words(rng.randint(15, 40))
        for word, share in PLANTED.items():
            if rng.random() < share:
                user_text += f" {word}"
                self.plan.planted[word].append(tid)
        messages: list[dict[str, Any]] = [self.systems[i % len(self.systems)], {"role": "user", "content": user_text}]
        call_at = at
        prompt_total = completion_total = 0
        latency_total = 0.0
        for seq in range(steps):
            last = seq == steps - 1
            failed = last and status == "error"
            if last:
                reply: dict[str, Any] = {"role": "assistant", "content": self.words(rng.randint(20, 60))}
                tool_calls: list[dict[str, Any]] = []
            else:
                call_id = f"call_{i}_{seq}"
                tool = rng.choice(TOOL_NAMES)
                arguments = orjson.dumps({"query": self.words(3), "limit": rng.randint(1, 10)}).decode()
                reply = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": tool, "arguments": arguments}}]}
                valid = rng.random() > (0.2 if long else 0.05)
                result = f"Result of {tool}: " + self.words(rng.randint(30, 90))
                tool_calls = [{"call_id": call_id, "name": tool, "raw_arguments": arguments, "valid": valid,
                               "result": result if valid else None,
                               "validation_error": None if valid else "'query' is a required property"}]
            prompt = 40 * len(messages) + rng.randrange(40)
            completion = rng.randint(8, 120)
            latency = round(rng.uniform(80, 2500), 1)
            rows.call(self, tid, seq, call_at, list(messages), None if failed else reply, requested, base, adapter,
                      prompt, completion, latency, source)
            if agentic or long:
                for t in tool_calls:
                    rows.tool_calls.append((
                        self.ulid(call_at), tid, seq, t["call_id"], t["name"], t["raw_arguments"], 1, 0,
                        int(t["valid"]), t["validation_error"], "ok" if t["valid"] else "invalid", t["result"],
                        round(rng.uniform(1, 400), 1) if t["valid"] else None, call_at))
                states = ("CALL_MODEL", "PARSE", "VALIDATE", "EXECUTE", "OBSERVE") if long else ("CALL_MODEL",
                                                                                                 "EXECUTE")
                for state in states:
                    rows.events.append((tid, seq, state, orjson.dumps({"step": seq}).decode() if state == "EXECUTE"
                                        else None, call_at))
                if long:
                    rows.feedback.append((self.ulid(call_at), tid, seq, "reward", "step_progress",
                                          round(rng.random(), 3), None, None, call_at + 1))
            prompt_total += prompt
            completion_total += completion
            latency_total += latency
            if not last:
                messages.append(reply)
                messages.append({"role": "tool", "tool_call_id": tool_calls[0]["call_id"],
                                 "content": tool_calls[0]["result"] or "Not run: the call was invalid."})
            call_at += rng.uniform(0.5, 6.0)
            if failed:
                break
        if agentic or long:
            rows.events.append((tid, steps, "FINAL" if status == "completed" else "TERMINATED", None, call_at))
        final_messages = messages + ([reply] if status != "error" else [])
        head = hashing.prefix_hashes(final_messages)[-1]
        reason = rng.choice(REASONS[status]) if status in REASONS else None
        if source == "agent":
            rows.runs.append((tid, "research", status, reason, steps, orjson.dumps({"profile": "research"}).decode(),
                              orjson.dumps({"answer": reply.get("content")}).decode() if status == "completed"
                              else None, at, call_at))
        if reward is not None:
            rows.feedback.append((self.ulid(call_at), tid, None, "reward", "final", reward, None, None, call_at + 1))
        parent = None
        if i > 0 and rng.random() < 0.01 and rows.recent:
            parent = rng.choice(rows.recent)
        rows.recent = (rows.recent + [tid])[-50:]
        rows.trajectories.append((
            tid, source, tenant, f"key-{tenant}-{rng.randrange(3)}", f"session-{i}" if source == "bot" else None,
            requested, base, adapter, "3" if adapter else None, task, group, parent, status, reason, head,
            len(final_messages), steps if status != "error" else seq + 1, seq + 1, prompt_total, completion_total,
            round(latency_total, 1), reward,
            orjson.dumps({"client": "bench", "run": i % 7}).decode() if rng.random() < 0.3 else None, at, call_at))
        if long:
            self.plan.long_id = tid
        elif len(self.plan.normal_ids) < 64 and rng.random() < 64 / self.n * 4 and status != "error":
            self.plan.normal_ids.append(tid)
        if i == self.n // 5:
            self.plan.deep_before = tid  # 80% of the list newer than it
        if i == self.n // 2:
            self.plan.since = dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d")
            self.plan.until = dt.datetime.fromtimestamp(at + 3 * 86400, dt.UTC).strftime("%Y-%m-%d")


def _zipf_cum(n: int, s: float = 1.0) -> Iterator[float]:
    total = 0.0
    for rank in range(1, n + 1):
        total += 1.0 / rank ** s
        yield total


class Rows:
    """A chunk's rows, each as the writer would make it."""

    def __init__(self) -> None:
        self.recent: list[str] = []
        self.clear()

    def clear(self) -> None:
        self.blobs: dict[str, tuple[str, bytes, float]] = {}
        self.trajectories: list[tuple[Any, ...]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.tool_calls: list[tuple[Any, ...]] = []
        self.texts: list[tuple[str, str]] = []
        self.events: list[tuple[Any, ...]] = []
        self.feedback: list[tuple[Any, ...]] = []
        self.runs: list[tuple[Any, ...]] = []

    def put_blob(self, value: Any, at: float, cache: dict[int, str]) -> str:
        cached = cache.get(id(value))  # the shared system prompts and tool specs, hashed once
        if cached is not None:
            self.blobs.setdefault(cached, (cached, hashing.exact_json(value), at))
            return cached
        body = hashing.exact_json(value)
        key = hashing.blob_hash(body)
        self.blobs[key] = (key, body, at)
        return key

    def call(self, gen: Generator, tid: str, seq: int, at: float, request: list[dict[str, Any]],
             reply: dict[str, Any] | None, requested: str, base: str, adapter: str | None, prompt: int,
             completion: int, latency: float, source: str) -> None:
        cache = gen.shared_keys
        request_keys = [self.put_blob(m, at, cache) for m in request]
        tools_key = self.put_blob(TOOLS, at, cache) if source != "bot" else None
        replies = [reply] if reply is not None else []
        response_keys = [self.put_blob(r, at, cache) for r in replies]
        response = None
        if reply is not None:
            response = {"id": f"chatcmpl-{tid[-10:]}-{seq}", "object": "chat.completion", "created": int(at),
                        "model": base, "choices": [{"index": 0, "finish_reason": "tool_calls" if reply.get(
                            "tool_calls") else "stop", "logprobs": None}],
                        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                  "total_tokens": prompt + completion}}
        status = "ok" if reply is not None else "error"
        self.calls.append((
            gen.ulid(at), tid, seq, at, "upstream" if source != "rollout" else "local", base, adapter, 0,
            orjson.dumps(request_keys).decode(), tools_key,
            orjson.dumps({"temperature": 0.7, "max_tokens": 512}).decode(),
            orjson.dumps(response).decode() if response else None, orjson.dumps(response_keys).decode(), status,
            None if reply is not None else "upstream answered 502", prompt, completion if reply else 0, latency,
            None, pack(None), pack(None), pack(None), pack(None), None, None, None))
        text = call_text(seq, request, replies)
        if text:
            self.texts.append((text, tid))


_INSERT_TRAJECTORY = """
    INSERT INTO trajectories(id, source, tenant, key_id, session_key, requested_model, base_model, adapter,
        adapter_version, task_id, group_id, parent_id, status, termination_reason, head_hash, message_count, n_calls,
        next_seq, prompt_tokens, completion_tokens, latency_ms, final_reward, metadata, created_at, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""
_INSERT_EVENT = "INSERT INTO events(trajectory_id, step, state, data, created_at) VALUES (?, ?, ?, ?, ?)"
_INSERT_FEEDBACK = """INSERT INTO feedback(id, trajectory_id, model_call_seq, source, name, value, label, comment,
    created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"""
_INSERT_RUN = """INSERT INTO agent_runs(id, profile, status, termination_reason, steps, state, result, created_at,
    updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"""


def generate(path: Path, n: int, calls: int, long_steps: int, seed: int) -> Plan:
    partial = path.with_suffix(".partial")
    for leftover in (partial, Path(f"{partial}-wal"), Path(f"{partial}-shm")):
        leftover.unlink(missing_ok=True)
    conn = sqlite3.connect(partial, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    migrate(conn)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA cache_size=-262144")  # 256 MiB while building; the gateway uses its own defaults
    gen = Generator(n, calls, long_steps, seed)
    gen.shared_keys.update({id(m): hashing.blob_hash(hashing.exact_json(m)) for m in (*gen.systems, TOOLS)})
    rows = Rows()
    started = time.perf_counter()
    for lo in range(0, n, CHUNK):
        for i in range(lo, min(n, lo + CHUNK)):
            gen.trajectory(i, rows)
        conn.execute("BEGIN")
        conn.executemany(_UPSERT_BLOB, list(rows.blobs.values()))
        conn.executemany(_INSERT_TRAJECTORY, rows.trajectories)
        conn.executemany(_INSERT_CALL, rows.calls)
        conn.executemany(_INSERT_TOOL_CALL, rows.tool_calls)
        conn.executemany(_INSERT_TEXT, rows.texts)
        conn.executemany(_INSERT_EVENT, rows.events)
        conn.executemany(_INSERT_FEEDBACK, rows.feedback)
        conn.executemany(_INSERT_RUN, rows.runs)
        conn.execute("COMMIT")
        rows.clear()
        done = min(n, lo + CHUNK)
        if done % (CHUNK * 10) == 0 or done == n:
            rate = done / (time.perf_counter() - started)
            console.print(f"[dim]  {done:,} of {n:,} trajectories ({rate:,.0f}/s)[/]")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    partial.rename(path)
    return gen.plan


# -- checks through the real store ----------------------------------------------------------------------------


async def verify(path: Path, plan: Plan) -> None:
    """Read the store back through ``TrajectoryStore`` and check it holds what was generated."""
    from replay.filters import Filters
    from replay.store import TrajectoryStore

    store = TrajectoryStore(str(path))
    await store.start()
    try:
        long = await store.get_trajectory(plan.long_id, all_tenants=True)
        assert long is not None and len(long.calls) == plan.long_steps, "the long run did not read back whole"
        assert [c.seq for c in long.calls] == list(range(plan.long_steps))
        last = long.calls[-1]
        assert len(last.messages) == 2 * plan.long_steps, len(last.messages)
        assert all(isinstance(m, dict) and m.get("role") for m in last.messages), "a body is missing"
        assert last.response and last.response["choices"][0]["message"]["content"], "the last reply is missing"
        assert len(long.tool_calls) == plan.long_steps - 1 and len(long.events) == 5 * plan.long_steps + 1
        assert sum(f.model_call_seq is not None for f in long.feedback) == plan.long_steps
        # The tool result a step saw is the next call's last message.
        assert long.calls[1].messages[-1]["content"] == (long.tool_calls[0].result or
                                                         "Not run: the call was invalid.")
        normal = await store.get_trajectory(plan.normal_ids[0], all_tenants=True)
        assert normal is not None and 1 <= len(normal.calls) <= plan.calls and normal.calls[0].messages
        for word, ids in plan.planted.items():
            if not ids or len(ids) > 200:
                continue
            found = await store.search(word, all_tenants=True, limit=len(ids) + 10)
            assert sorted(t.id for t in found) == sorted(ids), f"search {word!r}: {len(found)} of {len(ids)}"
            assert [t.id for t in found] == sorted(ids, reverse=True), "search results are not newest first"
            agent = await store.search(word, all_tenants=True, limit=len(ids) + 10, filters=Filters(source="agent"))
            assert {t.id for t in agent} <= set(ids) and all(t.source == "agent" for t in agent)
        newest = await store.list_trajectories(all_tenants=True, limit=3)
        assert len(newest) == 3 and newest[0].id > newest[1].id > newest[2].id
        common = await store.search(plan.common_word, all_tenants=True, limit=5)
        assert len(common) == 5, "the common word is not found"
    finally:
        await store.close()


# -- the gateway ----------------------------------------------------------------------------------------------


def write_config(tmp: Path, db: Path, port: int) -> Path:
    config = tmp / "harness.toml"
    config.write_text(f"""[server]
host = "127.0.0.1"
port = {port}
log_format = "json"
log_level = "info"

[store]
path = "{db}"

[[backends]]
name = "closed-port"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
models = ["bench-model"]
""")
    return config


def sign_in(client: httpx.Client, base: str, admin_key: str) -> None:
    form = client.get(f"{base}/ui/login")
    form.raise_for_status()
    match = re.search(r'name="csrf" value="([^"]+)"', form.text)
    if match is None:
        raise BenchError("the sign-in form has no csrf field")
    answer = client.post(f"{base}/ui/login", data={"csrf": match.group(1), "key": admin_key,
                                                     "next": "/ui/trajectories"},
                         headers={"origin": base})
    if answer.status_code != 303 or "harness_console" not in client.cookies:
        raise BenchError(f"sign-in failed: {answer.status_code} {answer.text[:300]}")


@dataclass
class Case:
    name: str
    kind: str  # list | search | long | page
    urls: list[str]
    count: int
    samples: list[tuple[int, float, float]] = field(default_factory=list)  # (round, server ms, client ms)


def cases(plan: Plan, args: argparse.Namespace) -> list[Case]:
    lists, searches, pages = args.list_requests, args.search_requests, args.page_requests
    word = plan.common_word
    return [
        Case("list: first page", "list", ["/ui/trajectories"], lists),
        Case("list: deep page (before=)", "list", [f"/ui/trajectories?before={plan.deep_before}"], lists),
        Case("list: source+status+reward", "list",
             ["/ui/trajectories?source=agent&status=completed&min_reward=0.2&max_reward=0.6"], lists),
        Case("list: model", "list", [f"/ui/trajectories?model={plan.filtered_model}"], lists),
        Case("list: date range", "list", [f"/ui/trajectories?since={plan.since}&until={plan.until}"], lists),
        Case("list: rare model+status", "list", ["/ui/trajectories?model=mistral-small&status=interrupted"], lists),
        Case(f"search: common ({word})", "search", [f"/ui/trajectories?q={word}"], searches),
        Case(f"search: rare ({RARE})", "search", [f"/ui/trajectories?q={RARE}"], searches),
        Case(f"search: 1% word ({MEDIUM})", "search", [f"/ui/trajectories?q={MEDIUM}"], searches),
        Case("search: common + filters", "search",
             [f"/ui/trajectories?q={word}&source=agent&status=completed&min_reward=0.2"], searches),
        Case("search: rare + filters", "search", [f"/ui/trajectories?q={RARE}&source=proxy&status=completed"],
             searches),
        Case(f"page: {plan.long_steps}-step trajectory", "long", [f"/ui/trajectories/{plan.long_id}"], pages),
        Case(f"page: {plan.calls}-call trajectory", "page",
             [f"/ui/trajectories/{t}" for t in plan.normal_ids], pages),
    ]


def schedule(all_cases: list[Case], rounds: int, warmup: int) -> list[tuple[int, Case, str]]:
    """(round, case, url): ``warmup`` requests of each case (round -1), then each case's count spread over the
    rounds, the cases taking turns request by request."""
    out: list[tuple[int, Case, str]] = []
    for k in range(warmup):
        out += [(-1, c, c.urls[k % len(c.urls)]) for c in all_cases]
    sent = {c.name: 0 for c in all_cases}
    for r in range(rounds):
        quota = {c.name: c.count * (r + 1) // rounds - c.count * r // rounds for c in all_cases}
        while any(quota.values()):
            for c in all_cases:
                if quota[c.name]:
                    quota[c.name] -= 1
                    out.append((r, c, c.urls[sent[c.name] % len(c.urls)]))
                    sent[c.name] += 1
    return out


def access_lines(log: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    with open(log, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    lines = []
    for raw in data[:end].splitlines():
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(line, dict) and line.get("event") == "request":
            lines.append(line)
    return lines, offset + end


def run_cases(base: str, client: httpx.Client, log: Path, plan_cases: list[Case], rounds: int,
              warmup: int) -> None:
    offset = log.stat().st_size
    order = schedule(plan_cases, rounds, warmup)
    pending: list[tuple[int, Case, str, float]] = []
    done = 0
    for rnd, case, url in order:
        started = time.perf_counter()
        answer = client.get(base + url)
        elapsed = (time.perf_counter() - started) * 1000
        if answer.status_code != 200:
            raise BenchError(f"{url}: {answer.status_code} {answer.text[:300]}")
        if case.kind in ("list", "search") and "trajectory-list" not in answer.text:
            raise BenchError(f"{url}: not the list page")
        pending.append((rnd, case, url, elapsed))
        done += 1
        if done % 200 == 0:
            console.print(f"[dim]  {done:,} of {len(order):,} requests[/]")
    deadline = time.monotonic() + 10
    lines: list[dict[str, Any]] = []
    while len(lines) < len(pending) and time.monotonic() < deadline:
        more, offset = access_lines(log, offset)
        lines += [line for line in more if str(line.get("path", "")).startswith("/ui/trajectories")]
        if len(lines) < len(pending):
            time.sleep(0.2)
    if len(lines) != len(pending):
        raise BenchError(f"{len(pending)} requests sent, {len(lines)} access-log lines found")
    for (rnd, case, url, elapsed), line in zip(pending, lines, strict=True):
        if line["path"] != url.split("?")[0] or line.get("status") != 200:
            raise BenchError(f"access log out of step: {line} for {url}")
        if rnd >= 0:
            case.samples.append((rnd, float(line["latency_ms"]), elapsed))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(all_cases: list[Case], rounds: int) -> list[dict[str, Any]]:
    out = []
    for c in all_cases:
        server = [s for _, s, _ in c.samples]
        client = [e for _, _, e in c.samples]
        per_round = [percentile([s for r, s, _ in c.samples if r == rnd], 0.95) for rnd in range(rounds)]
        target = TARGETS.get(c.kind)
        p95 = percentile(server, 0.95)
        out.append({"case": c.name, "kind": c.kind, "n": len(server), "p50": percentile(server, 0.5), "p95": p95,
                    "max": max(server), "p95_round_median": statistics.median(per_round),
                    "client_p50": percentile(client, 0.5), "client_p95": percentile(client, 0.95),
                    "target_p95": target, "met": None if target is None else p95 <= target,
                    "url": c.urls[0]})
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table("case", "n", "p50 ms", "p95 ms", "max ms", "p95 (round median)", "client p50 / p95",
                  "target p95", "met", title="server-side latency (the gateway's access log)")
    for s in summary:
        met = "" if s["met"] is None else ("[green]yes[/]" if s["met"] else "[red]NO[/]")
        table.add_row(s["case"], str(s["n"]), f"{s['p50']:.1f}", f"{s['p95']:.1f}", f"{s['max']:.1f}",
                      f"{s['p95_round_median']:.1f}", f"{s['client_p50']:.1f} / {s['client_p95']:.1f}",
                      f"≤ {s['target_p95']:.0f}" if s["target_p95"] else "", met)
    console.print(table)


def explain(db: Path, plan: Plan) -> None:
    """The plans of the listing queries the cases make (as ``replay.queries.listing`` builds them)."""
    from replay.filters import Filters, parse_time

    match = "SELECT trajectory_id FROM trajectory_text WHERE trajectory_text MATCH ?"
    queries: list[tuple[str, Filters, str | None]] = [
        ("first page", Filters(), None),
        ("source+status+reward", Filters(source="agent", status="completed", min_reward=0.2, max_reward=0.6), None),
        ("model", Filters(model=plan.filtered_model), None),
        ("date range", Filters(since=parse_time(plan.since), until=parse_time(plan.until)), None),
        ("search common", Filters(), plan.common_word),
        ("search rare + filters", Filters(source="proxy", status="completed"), RARE),
    ]
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    for name, filters, word in queries:
        where, args = filters.where("t")
        if word:
            where += f" AND id IN ({match})"
            args.append(f'"{word}"')
        sql = f"SELECT * FROM trajectories t WHERE {where} ORDER BY id DESC LIMIT 51"
        plan_rows = conn.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall()
        console.print(f"[bold]{name}[/]: " + "; ".join(r[-1] for r in plan_rows))
    conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=100_000, help="Trajectories in the generated store.")
    p.add_argument("--calls", type=int, default=5, help="Model calls per trajectory.")
    p.add_argument("--long-steps", type=int, default=50, help="Model calls of the one long agent run.")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--db", type=Path, help="The store's file (default: bench/results/, named by the parameters; "
                                           "generated when missing, reused otherwise).")
    p.add_argument("--regenerate", action="store_true", help="Generate the store again even if it exists.")
    p.add_argument("--rounds", type=int, default=5, help="Interleaved rounds the requests are spread over.")
    p.add_argument("--warmup", type=int, default=3, help="Untimed requests of each case first.")
    p.add_argument("--list-requests", type=int, default=200, help="Requests of each list case.")
    p.add_argument("--search-requests", type=int, default=50, help="Requests of each search case.")
    p.add_argument("--page-requests", type=int, default=50, help="Requests of each trajectory page case.")
    p.add_argument("--index", action="append", default=[], metavar="SQL",
                   help="CREATE INDEX statement to add to the store for this run (dropped afterwards): the effect of "
                        "an index the schema lacks.")
    p.add_argument("--explain", action="store_true", help="Print the listing queries' plans.")
    p.add_argument("--json", type=Path, default=RESULTS / "console.json", help="Where the figures are written.")
    p.add_argument("--keep-tmp", action="store_true", help="Keep the temp dir (config, gateway log).")
    args = p.parse_args(argv)

    from gateway.logging import configure_logging

    configure_logging("console", "warning")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"console-store-v{GENERATOR_VERSION}-{args.trajectories}x{args.calls}-long{args.long_steps}-s{args.seed}"
    db = args.db or RESULTS / f"{name}.db"
    plan_file = db.with_suffix(".plan.json")
    if args.regenerate or not db.exists() or not plan_file.exists():
        db.unlink(missing_ok=True)
        console.print(f"[bold]Generating[/] {args.trajectories:,} trajectories × {args.calls} calls "
                      f"+ one of {args.long_steps} steps into {db}")
        started = time.perf_counter()
        plan = generate(db, args.trajectories, args.calls, args.long_steps, args.seed)
        generated_s = time.perf_counter() - started
        plan_file.write_text(json.dumps(plan.__dict__, indent=1))
        console.print(f"generated in {generated_s:.1f} s")
    else:
        plan = Plan(**json.loads(plan_file.read_text()))
        generated_s = None
        console.print(f"reusing {db}")
    size = db.stat().st_size
    conn = sqlite3.connect(db)
    counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]  # noqa: S608 - our own table names
              for t in ("trajectories", "model_calls", "blobs", "trajectory_text", "tool_calls", "events")}
    conn.close()
    console.print(f"store: {size / 2**20:,.0f} MiB; " + ", ".join(f"{k} {v:,}" for k, v in counts.items()) +
                  "; planted: " + ", ".join(f"{w} in {len(ids)}" for w, ids in plan.planted.items()))
    started = time.perf_counter()
    asyncio.run(verify(db, plan))
    console.print(f"read back through TrajectoryStore: ok ({time.perf_counter() - started:.1f} s)")

    added: list[str] = []
    if args.index:
        conn = sqlite3.connect(db)
        for statement in args.index:
            match = re.match(r"\s*CREATE\s+INDEX\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", statement, re.IGNORECASE)
            if match is None:
                raise SystemExit(f"--index takes a CREATE INDEX statement: {statement}")
            started = time.perf_counter()
            conn.execute(statement)
            added.append(match.group(1))
            console.print(f"index {match.group(1)} created in {time.perf_counter() - started:.1f} s")
        conn.close()
    if args.explain:
        explain(db, plan)

    services = Services()
    tmp = Path(tempfile.mkdtemp(prefix="console-bench-"))
    admin_key = "bench-admin-" + os.urandom(12).hex()
    all_cases = cases(plan, args)
    try:
        port = free_port()
        config = write_config(tmp, db, port)
        env = {**gateway_env(), "HARNESS_ADMIN_KEY": admin_key}
        log = tmp / "gateway.log"
        gw = services.start("gateway", [sys.executable, "-m", "harness.main", "serve", "--config", str(config)],
                            log, env=env, cwd=REPO)
        base = f"http://127.0.0.1:{port}"
        wait_ready(gw, f"{base}/healthz", 120)
        with httpx.Client(timeout=60) as client:
            sign_in(client, base, admin_key)
            console.print(f"[bold]Measuring[/] {sum(c.count for c in all_cases):,} requests over {args.rounds} "
                          f"interleaved rounds after {args.warmup} warm-up requests of each case")
            run_cases(base, client, log, all_cases, args.rounds, args.warmup)
    except KeyboardInterrupt:
        return 130
    except BenchError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        services.stop_all()
        if added:
            conn = sqlite3.connect(db)
            for index in added:
                conn.execute(f"DROP INDEX IF EXISTS {index}")
            conn.close()
        if args.keep_tmp:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    summary = summarize(all_cases, args.rounds)
    print_table(summary)
    for kind, label in (("list", "list pages"), ("search", "searches"), ("long", "the long trajectory page")):
        worst = max(s["p95"] for s in summary if s["kind"] == kind)
        verdict = "met" if worst <= TARGETS[kind] else "NOT met"
        console.print(f"{label}: worst p95 {worst:,.1f} ms (target ≤ {TARGETS[kind]:.0f} ms): {verdict}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "benchmark": "console", "trajectories": args.trajectories, "calls": args.calls, "long_steps": args.long_steps,
        "store_bytes": size, "rows": counts, "generated_s": generated_s, "cpus": os.cpu_count(),
        "indexes_added": args.index, "rounds": args.rounds, "results": summary,
        "samples": {c.name: c.samples for c in all_cases}}, indent=1) + "\n")
    console.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
