#!/usr/bin/env python3
"""HTTP clients alone against a fixed upstream: what each costs the gateway's process per request.

nginx answers every POST with the same chat completion (bench/gateway_overhead.py's config); each client, in this
one process on uvloop, sends N requests at concurrency 1 and at 64 through one pooled client and reads each answer
whole. Reported: requests/second and this process's CPU per request, clients interleaved over rounds, medians.
Compared: aiohttp (the gateway's upstream client), httpx2 (the openai SDK's) and httpx 0.28.

    python bench/upstream_clients.py [--requests 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gateway_overhead import REQUEST_BODY, free_port, nginx_conf  # noqa: E402

BODY = orjson.dumps(REQUEST_BODY)
HEADERS = {"Content-Type": "application/json"}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def aiohttp_client(url: str) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256),
                                    timeout=aiohttp.ClientTimeout(total=30))

    async def one() -> None:
        async with session.post(url, data=BODY, headers=HEADERS) as r:
            orjson.loads(await r.read())
    return one, session.close


async def httpx_like(module: str, url: str) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    httpx = __import__(module)
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
                               timeout=httpx.Timeout(30))

    async def one() -> None:
        r = await client.post(url, content=BODY, headers=HEADERS)
        orjson.loads(r.content)
    return one, client.aclose


CLIENTS = {"aiohttp": aiohttp_client, "httpx2": lambda url: httpx_like("httpx2", url),
           "httpx": lambda url: httpx_like("httpx", url)}


async def measure(name: str, url: str, requests: int, concurrency: int) -> tuple[float, float]:
    one, close = await CLIENTS[name](url)
    try:
        for _ in range(200):  # warm the pool
            await one()
        gate = asyncio.Semaphore(concurrency)

        async def limited() -> None:
            async with gate:
                await one()
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(limited() for _ in range(requests)))
        cpu1, t1 = cpu_seconds(), time.perf_counter()
    finally:
        await close()
    return requests / (t1 - t0), 1000 * (cpu1 - cpu0) / requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    args = p.parse_args()
    if not shutil.which("nginx"):
        print("nginx not found: apt-get install nginx-light", file=sys.stderr)
        return 2
    available = []
    for name in args.clients:
        try:
            __import__(name)
            available.append(name)
        except ImportError:
            print(f"skipping {name}: not installed")
    tmp = Path(tempfile.mkdtemp(prefix="upstream-clients-"))
    port = free_port()
    nginx = subprocess.Popen(["nginx", "-e", str(tmp / "nginx" / "error.log"), "-p", str(tmp / "nginx"), "-c",
                              str(nginx_conf(tmp, port))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        time.sleep(0.5)
        figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for name in available:
                for concurrency in (1, 64):
                    figures.setdefault((name, concurrency), []).append(
                        uvloop.run(measure(name, url, args.requests, concurrency)))
        print(f"{'client':<8} {'conc':>4} {'req/s':>9} {'CPU ms/req':>11}   (medians of {args.rounds} rounds, "
              f"{args.requests} requests each)")
        for (name, concurrency), runs in figures.items():
            rps = statistics.median(r for r, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(f"{name:<8} {concurrency:>4} {rps:>9,.0f} {cpu:>11.3f}")
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
