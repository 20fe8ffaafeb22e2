#!/usr/bin/env python3
"""Soak: ten minutes of mixed traffic against a real gateway, its memory and descriptors sampled as it goes.

    python bench/soak.py                                   # both targets, 10 minutes each
    python bench/soak.py --target standin --minutes 3      # a shorter look

Targets (each a fresh ``harness serve`` process on its own SQLite file):

    standin    in front of the stand-in upstream (tests/standin.py): the gateway is all that works
    embedded   on the embedded SmolLM2-135M (replies capped at a few tokens): the engine is in the process too

The traffic, from ``--clients`` threads, each request drawn by weight: plain and streamed chat completions, a
stream the client drops after its first chunk, Responses API requests, agent runs (``POST /v1/agent/runs``, then
polled to the end), signed webhook messages to the bot, bad input that must get a 400 (the held-out list of
what OpenAI refuses), and attacks (``ATTACKS``: what docs/security.md defends against, each with the answer it must
get). Every 10 s the gateway process's RSS and open file descriptors are sampled. Afterwards: errors by type (any
status other than the one expected, and every exception), the store's ``integrity_check``, every acknowledged
exchange looked up in the store, and three verdicts: RSS grows by at most 10% from minute 2 to the end, the
descriptors return to their baseline (sampled before the traffic) once it stops, and no acknowledged exchange is
missing. Prints a table, writes ``bench/results/soak.json`` and a
PNG of both series. Never run in CI: it takes as long as it is told to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gateway.bot.signing import signed_headers  # noqa: E402
from replay.store import TrajectoryStore  # noqa: E402
from tests.processes import GatewayProcess, upstream_config  # noqa: E402
from tests.standin import ServerThread, StandIn  # noqa: E402

SECRET = "soak-bot-secret"
SAMPLE_SECONDS = 10.0
STORE = "cache_entries = {entries}\n"
BOT = """
[bot]
profile = "echo"
sync_timeout_seconds = 5
rate_limit_messages = 0
"""
PROFILE = """
[[profiles]]
name = "echo"
model = "{model}"
system_prompt = "You answer briefly. Use the calculator for arithmetic."
tools = ["calculator"]
max_steps = 2
max_tokens = {tokens}
temperature = 0
"""
USER = {"role": "user", "content": "x"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
BAD = [  # what OpenAI answers with a 400
    {"messages": [USER, CALL, {"role": "tool", "content": "1"}]},
    {"messages": [USER], "stream": "yes"},
    {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}},
    {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
    {"messages": [USER], "response_format": {"type": "yaml"}},
    {"messages": "hi"},
    {"messages": [USER], "temperature": "hot"},
]
WEIGHTS = {"plain": 25, "stream": 20, "disconnect": 10, "responses": 10, "agent": 10, "webhook": 10, "bad": 15,
           "attack": 10}
_DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 200 + '{"type": "string"}' + "}}" * 200


def _attacks(model: str, target: str) -> list[tuple[str, dict[str, Any], set[str]]]:
    """(name, request, the outcomes it may get) for each attack of docs/security.md that one request makes."""
    deep_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100 + "]" * 100}}
    attacks = [
        ("nested schema", {"content": (f'{{"model": "{model}", "messages": [{{"role": "user", "content": "x"}}], '
                                       '"response_format": {"type": "json_schema", "json_schema": {"name": "d", '
                                       f'"schema": {_DEEP_SCHEMA}}}}}}}').encode()}, {"400"}),
        ("nested arguments", {"json": {"model": model, "messages": [USER, {**CALL, "tool_calls": [deep_call]},
                                                                     {"role": "tool", "tool_call_id": "c1",
                                                                      "content": "1"}]}}, {"400"}),
        ("large head", {"json": {"model": model, "messages": [USER]}, "headers": {"x-pad": "a" * 100_000}}, {"431"}),
        # the client gives up at once: the gateway must stop the work and record the exchange
        ("plain disconnect", {"json": {"model": model, "messages": [{"role": "user", "content": "slow:1"}],
                                       "max_tokens": 64, "ignore_eos": True}, "timeout": 0.3}, {"ReadTimeout"}),
    ]
    if target == "standin":
        attacks.append(("deep upstream answer", {"json": {"model": model, "messages": [
            {"role": "user", "content": "deep:300"}]}}, {"502"}))
    else:
        attacks.append(("max_tokens past the context", {"json": {"model": model, "messages": [USER],
                                                                 "max_tokens": 10**9}}, {"400"}))
        attacks.append(("costly schema", {"json": {"model": model, "messages": [USER], "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string",
                                                                          "pattern": "^" + "ab" * 5000 + "$"}}}}},
                        {"400"}))
    return attacks


@dataclass
class Target:
    name: str
    config: str
    model: str
    start_timeout: float


@dataclass
class Run:
    started: float = field(default_factory=time.monotonic)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: Counter[tuple[str, str]] = field(default_factory=Counter)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, RSS bytes, descriptors)
    acked: list[str] = field(default_factory=list)  # trajectories of acknowledged exchanges
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str, outcome: str, expected: bool) -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if not expected:
                self.errors[(kind, outcome)] += 1


def _fd_targets(pid: int) -> Counter[str]:
    """What each open descriptor is (a socket, a file), counted: the extra ones after the traffic are named."""
    targets: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        targets["socket" if target.startswith("socket:") else target] += 1
    return targets


def _sockets(pid: int) -> list[str]:
    """The process's TCP sockets as ``ss`` lists them (state, local and peer address)."""
    listed = subprocess.run(["ss", "-tanp"], capture_output=True, text=True, check=False).stdout
    return [" ".join(line.split()[:1] + line.split()[3:5]) for line in listed.splitlines() if f"pid={pid}," in line]


def _rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _one(client: httpx.Client, url: str, model: str, kind: str, rng: random.Random, *, target: str = "standin",
         acked: list[str] | None = None) -> tuple[str, bool]:
    """One request of ``kind``: its outcome (a status, or what went wrong) and whether it was the expected one.
    The trajectory of each exchange the gateway acknowledged (a 200, a stream to its end) goes to ``acked``."""
    text = f"soak {rng.randrange(10**6)}: what is 6 times 7?"
    chat = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    acked = [] if acked is None else acked
    if kind == "plain":
        r = client.post(url + "/v1/chat/completions", json=chat)
        if r.status_code == 200:
            acked.append(r.headers["x-harness-trajectory-id"])
        return str(r.status_code), r.status_code == 200 and bool(r.json()["choices"])
    if kind in ("stream", "disconnect"):
        with client.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
            body = b""
            for i, part in enumerate(r.iter_bytes()):
                body += part
                if kind == "disconnect" and i == 0:
                    break  # the client goes away mid-stream; the gateway must still record and let go
        if kind == "stream" and body.rstrip().endswith(b"[DONE]"):
            acked.append(r.headers["x-harness-trajectory-id"])
        return str(r.status_code), r.status_code == 200
    if kind == "responses":
        r = client.post(url + "/v1/responses", json={"model": model, "input": text, "max_output_tokens": 8})
        if r.status_code == 200:
            acked.append(r.headers["x-harness-trajectory-id"])
        return str(r.status_code), r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")
    if kind == "attack":
        name, request, allowed = rng.choice(_attacks(model, target))
        try:
            r = client.post(url + "/v1/chat/completions", **request)
        except httpx.ReadTimeout:
            return f"{name}: ReadTimeout", "ReadTimeout" in allowed
        return f"{name}: {r.status_code}", str(r.status_code) in allowed
    if kind == "agent":
        r = client.post(url + "/v1/agent/runs", json={"profile": "echo", "input": text})
        if r.status_code != 201:
            return str(r.status_code), False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            polled = client.get(f"{url}/v1/agent/runs/{r.json()['id']}")
            if polled.status_code != 200:
                return f"201, then {polled.status_code} {polled.json()['error']['code']}", False
            run = polled.json()
            if run["status"] != "running":
                return f"201 {run['status']}", run["status"] in ("completed", "terminated")
            time.sleep(0.2)
        return "201 unfinished", False
    if kind == "webhook":
        # 20 conversations at a time, a new set every 30 s: conversations of tens of turns, not thousands
        conversation = f"c{int(time.monotonic() // 30)}-{rng.randrange(20)}"
        raw = orjson.dumps({"conversation_id": conversation, "user_id": f"u{rng.randrange(5)}", "text": text})
        r = client.post(url + "/bot/v1/messages", content=raw,
                        headers={**signed_headers(SECRET.encode(), raw, time.time()),
                                 "Content-Type": "application/json"})
        return str(r.status_code), r.status_code in (200, 202)
    body = {"model": model, **rng.choice(BAD)}
    r = client.post(url + "/v1/chat/completions", json=body)
    return str(r.status_code), r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                                   "code"}


def _client_loop(url: str, model: str, target: str, run: Run, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome, expected = _one(client, url, model, kind, rng, target=target, acked=run.acked)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                outcome, expected = type(exc).__name__, False
            run.count(kind, outcome, expected)


def soak(target: Target, minutes: float, clients: int, workdir: Path) -> dict[str, Any]:
    console = Console()
    proc = GatewayProcess(target.config, workdir, env={"HARNESS_BOT_SECRET": SECRET}).start(target.start_timeout)
    assert proc.proc is not None
    pid = proc.proc.pid
    try:
        # One request of each kind first: the baseline holds the connections a warm gateway keeps (its pool to
        # the upstream, the store's), so what it measures is what the traffic leaves behind.
        with httpx.Client(timeout=300) as client:
            for kind in WEIGHTS:
                _one(client, proc.url, target.model, kind, random.Random(0))
        time.sleep(2)
        _, baseline_fds = _rss_and_fds(pid)
        baseline_targets = _fd_targets(pid)
        run = Run()
        stop = threading.Event()
        threads = [threading.Thread(target=_client_loop, args=(proc.url, target.model, target.name, run, stop, i),
                                    daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        end = run.started + minutes * 60
        while (now := time.monotonic()) < end:
            rss, fds = _rss_and_fds(pid)
            run.samples.append((now - run.started, rss, fds))
            done = sum(run.outcomes.values())
            console.print(f"[dim]{target.name} {now - run.started:6.0f} s  RSS {rss / 2**20:7.1f} MiB  fds {fds:4d}  "
                          f"requests {done}  unexpected {sum(run.errors.values())}[/dim]")
            time.sleep(min(SAMPLE_SECONDS, max(0.0, end - time.monotonic())))
        stop.set()
        for t in threads:
            t.join(180)
        settle = time.monotonic() + 30
        while (fds_after := _rss_and_fds(pid)[1]) > baseline_fds and time.monotonic() < settle:
            time.sleep(1)
        extra = _fd_targets(pid) - baseline_targets
        sockets = _sockets(pid) if extra["socket"] else []
        # An upstream connection the upstream closed while it sat idle in the gateway's pool (CLOSE-WAIT) is let
        # go only when the pool is next used: one more request tells such a socket from a leaked one.
        with httpx.Client(timeout=60) as client:
            _one(client, proc.url, target.model, "plain", random.Random(0))
        time.sleep(1)
        fds_next = _rss_and_fds(pid)[1]
    finally:
        proc.stop()
    integrity = asyncio.run(_integrity(proc.db))
    lost = _missing(proc.db, run.acked)
    at_two = next((rss for s, rss, _ in run.samples if s >= 120), run.samples[0][1])
    growth = run.samples[-1][1] / at_two - 1
    return {"target": target.name, "minutes": minutes, "clients": clients,
            "requests": sum(run.outcomes.values()),
            "outcomes": {f"{k} {o}": n for (k, o), n in sorted(run.outcomes.items())},
            "errors": {f"{k} {o}": n for (k, o), n in sorted(run.errors.items())},
            "samples": run.samples, "rss_minute_2": at_two, "rss_end": run.samples[-1][1],
            "rss_growth": growth, "rss_flat": growth <= 0.10,
            "fds_baseline": baseline_fds, "fds_after": fds_after, "fds_back": fds_after <= baseline_fds,
            "fds_extra": dict(extra), "sockets_after": sockets, "fds_after_next_request": fds_next,
            "integrity": integrity, "acknowledged": len(run.acked), "lost": lost}


def _missing(db: Path, trajectories: list[str]) -> int:
    """How many acknowledged exchanges' trajectories have no model call in the store."""
    with sqlite3.connect(db) as conn:
        stored = {row[0] for row in conn.execute("SELECT DISTINCT trajectory_id FROM model_calls")}
    return len(set(trajectories) - stored)


async def _integrity(db: Path) -> list[str]:
    store = TrajectoryStore(str(db))
    await store.start()
    try:
        return await store.integrity_check()
    finally:
        await store.close()


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for result in results:
        seconds = [s / 60 for s, _, _ in result["samples"]]
        top.plot(seconds, [rss / 2**20 for _, rss, _ in result["samples"]], label=result["target"])
        bottom.plot(seconds, [fds for _, _, fds in result["samples"]], label=result["target"])
    top.set_ylabel("RSS (MiB)")
    bottom.set_ylabel("open descriptors")
    bottom.set_xlabel("minutes")
    top.axvline(2, color="grey", linestyle=":")
    top.legend()
    fig.suptitle("Gateway under mixed traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=["standin", "embedded"],
                        help="repeatable; default: both")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4, help="client threads (the embedded target uses half)")
    parser.add_argument("--cache-entries", type=int, help="[store] cache_entries of the gateways (default: theirs)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 130))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        standin = StandIn()
        with ServerThread(standin.app) as upstream:
            store = STORE.format(entries=args.cache_entries) if args.cache_entries else ""
            targets = {
                "standin": Target("standin", upstream_config(
                    upstream.url, store=store, extra=PROFILE.format(model="stand-in-model", tokens=16) + BOT),
                                  "stand-in-model", 120),
                "embedded": Target("embedded", '[store]\npath = "harness.db"\n' + store + PROFILE.format(
                    model="smollm2-135m-instruct", tokens=16) + BOT, "smollm2-135m-instruct", 300),
            }
            for name in args.target or list(targets):
                workdir = Path(tmp) / name
                workdir.mkdir()
                clients = args.clients if name == "standin" else max(1, args.clients // 2)
                results.append(soak(targets[name], args.minutes, clients, workdir))
    table = Table(title=f"Soak: {args.minutes:g} minutes of mixed traffic")
    for column in ("target", "requests", "unexpected", "RSS min 2 → end", "growth", "fds base → after",
                   "integrity", "acknowledged, lost", "verdict"):
        table.add_column(column)
    for r in results:
        flat = r["rss_flat"] and r["fds_back"] and r["integrity"] == ["ok"] and not r["errors"] and not r["lost"]
        table.add_row(r["target"], str(r["requests"]), str(sum(r["errors"].values())),
                      f"{r['rss_minute_2'] / 2**20:.0f} → {r['rss_end'] / 2**20:.0f} MiB", f"{r['rss_growth']:+.1%}",
                      f"{r['fds_baseline']} → {r['fds_after']}", ",".join(r["integrity"])[:40],
                      f"{r['acknowledged']}, {r['lost']}",
                      "[green]flat[/green]" if flat else "[red]NOT flat[/red]")
    console.print(table)
    for r in results:
        console.print(f"{r['target']} outcomes: {r['outcomes']}")
        if r["errors"]:
            console.print(f"[red]{r['target']} unexpected: {r['errors']}[/red]")
        if r["fds_extra"]:
            console.print(f"{r['target']} descriptors above the baseline: {r['fds_extra']}; TCP: {r['sockets_after']}; "
                          f"after one more request: {r['fds_after_next_request']} (baseline {r['fds_baseline']})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(results, indent=1))
    _plot(results, args.out / "soak.png")
    console.print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")


if __name__ == "__main__":
    main()
