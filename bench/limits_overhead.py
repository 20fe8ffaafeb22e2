#!/usr/bin/env python3
"""What limits cost: CPU per request at high concurrency with limits on every key, against the same gateway
without limits, counted in this process's memory and in Redis.

One upstream (nginx returning a fixed ``chat.completion``), one load generator (``wrk -t2 -cN``, default 64), three
targets, each a freshly started gateway on a fresh SQLite file with capture on, every request sent with an API key:

    limits_off     the key has no limits
    limits_memory  ``[limits.key]`` sets every limit (requests, tokens, concurrency, token and money budgets per day
                   and month; none ever reached), counted in the gateway's memory
    limits_redis   the same limits, counted in a Redis server the script starts (``redis-server --save ''``)

Rounds interleave the targets (three by default); the figures are medians over the rounds. Reports requests per
second, the gateway's CPU per request, Redis's CPU per request apart, and each limited target's CPU as a ratio to
``limits_off``'s, against the target (at most 5% more in-process). Needs ``wrk``, ``nginx`` and ``redis-server``.

    python bench/limits_overhead.py
    python bench/limits_overhead.py --duration 5 --warmup 2 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gateway_overhead import (  # noqa: E402
    LABELS,
    REQUEST_BODY,
    BenchError,
    Load,
    Services,
    Target,
    check_chat,
    console,
    free_port,
    gateway_env,
    gateway_toml,
    measure,
    nginx_conf,
    serving,
    start_gateway,
    wrk_script,
)

DEFAULT_JSON = REPO / "bench" / "results" / "limits_overhead.json"
TARGETS = ("limits_off", "limits_memory", "limits_redis")
LABELS.update(limits_off="gateway, key without limits", limits_memory="gateway, every limit, in memory",
              limits_redis="gateway, every limit, in Redis")
MAX_EXTRA_CPU = {"limits_memory": 0.05, "limits_redis": None}  # the target: in-process at most 5% more
# Every limit, none of which the benchmark reaches.
EVERY_LIMIT = """
[limits.key]
requests_per_minute = 100000000
tokens_per_minute = 1000000000
max_concurrent = 100000
tokens_per_day = 100000000000
tokens_per_month = 1000000000000
usd_per_day = 1000000.0
usd_per_month = 10000000.0

[prices.bench-model]
input = 0.5
output = 1.5
"""


def create_key(config: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "harness.main", "keys", "create", "--tenant", "bench",
                          "--config", str(config)], cwd=REPO, env=gateway_env(), capture_output=True, text=True,
                         timeout=120, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("key:"):
            return line.split()[1]
    raise BenchError(f"harness keys create failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")


def gateway_session(services: Services, tmp: Path, name: str, upstream_port: int, limits: str,
                    redis_pid: int | None) -> Any:
    runs = 0

    @contextlib.contextmanager
    def session() -> Iterator[Target]:
        nonlocal runs
        runs += 1
        port = free_port()
        config = gateway_toml(tmp, f"{name}-{runs}", port, upstream_port)
        config.write_text(config.read_text() + limits)
        headers = {"Authorization": f"Bearer {create_key(config)}"}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with serving(services, start_gateway(services, tmp, f"{name}-{runs}", config, port)) as gw:
            answered = check_chat(name, url, headers)
            limited = any(k.lower().startswith("x-ratelimit-") for k in answered)
            if limited != (name != "limits_off"):
                raise BenchError(f"{name}: x-ratelimit headers {'present' if limited else 'absent'}")
            # Redis's CPU is counted apart, as the database's is in the overhead benchmark.
            yield Target(url, wrk_script(tmp, f"{name}-{runs}", headers, REQUEST_BODY), gw,
                         str(config.parent / "harness.db"), measured_requests=1, db_pid=redis_pid)

    return session


def start_redis(services: Services, tmp: Path) -> tuple[str, int]:
    port = free_port()
    svc = services.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(tmp)], tmp / "redis.log")
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True,
                         check=False).stdout.strip() != "PONG":
        if time.monotonic() > deadline or svc.proc.poll() is not None:
            raise BenchError(f"redis-server did not start:\n{svc.log_tail()}")
        time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0", svc.proc.pid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="Interleaved rounds; figures are medians.")
    p.add_argument("--duration", type=float, default=10.0, help="Seconds per measurement.")
    p.add_argument("--warmup", type=float, default=3.0, help="Seconds of load before each measurement.")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", default=str(DEFAULT_JSON), help="Where the figures are written.")
    args = p.parse_args(argv)
    # What measure() reads beside these: retry a measurement other work disturbed, once.
    args.retries, args.quiet_threshold, args.quiet_wait, args.wrk_timeout = 1, 15.0, 60.0, 10.0
    for tool in ("wrk", "nginx", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            console.print(f"[red]error:[/] {tool} not found (Debian: wrk, nginx-light, redis-server)")
            return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    services = Services()
    tmp = Path(tempfile.mkdtemp(prefix="limits-overhead-"))
    load = Load(args.concurrency, 2)
    rounds: dict[str, list[dict[str, Any]]] = {}
    try:
        upstream_port = free_port()
        conf = nginx_conf(tmp, upstream_port)
        services.start("nginx", ["nginx", "-e", str(tmp / "nginx" / "error.log"), "-p", str(tmp / "nginx"),
                                 "-c", str(conf)], tmp / "nginx.log")
        time.sleep(0.5)
        redis_url, redis_pid = start_redis(services, tmp)
        sessions = {
            "limits_off": gateway_session(services, tmp, "limits_off", upstream_port, "", None),
            "limits_memory": gateway_session(services, tmp, "limits_memory", upstream_port, EVERY_LIMIT, None),
            "limits_redis": gateway_session(services, tmp, "limits_redis", upstream_port,
                                            f'\n[limits]\nstorage = "{redis_url}"\n' + EVERY_LIMIT, redis_pid),
        }
        console.print(f"[bold]Limits overhead[/]: {args.rounds} interleaved round(s), c={args.concurrency}; "
                      f"temp dir {tmp}")
        for rnd in range(args.rounds):
            console.print(f"[bold]Round {rnd + 1} of {args.rounds}[/]")
            for name, session in sessions.items():
                rounds.setdefault(name, []).append(measure(name, session, [load], args)[f"c{load.concurrency}"])
    except KeyboardInterrupt:
        return 130
    except BenchError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        services.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)

    def median(name: str, key: str) -> float | None:
        values = [r[key] for r in rounds[name] if r.get(key) is not None]
        return statistics.median(values) if values else None

    base = median("limits_off", "server_cpu_ms_per_request")
    summary: dict[str, Any] = {}
    console.print(f"\n{'target':<15} {'req/s':>9} {'CPU ms/req':>11} {'Redis ms/req':>13} {'CPU vs off':>11}  target")
    for name in TARGETS:
        cpu = median(name, "server_cpu_ms_per_request")
        ratio = cpu / base if cpu and base else None
        limit = MAX_EXTRA_CPU.get(name)
        verdict = "" if limit is None or ratio is None else (
            f"≤ +{limit:.0%}: {'met' if ratio - 1 <= limit else 'NOT met'}")
        redis_cpu = median(name, "db_cpu_ms_per_request")
        summary[name] = {"rps": median(name, "rps"), "cpu_ms_per_request": cpu, "redis_cpu_ms_per_request": redis_cpu,
                         "cpu_vs_off": ratio, "rounds": [{k: v for k, v in r.items() if k != "wrk_output"}
                                                         for r in rounds[name]]}
        console.print(f"{name:<15} {median(name, 'rps') or 0:>9.1f} {cpu or 0:>11.3f} "
                      f"{(f'{redis_cpu:.3f}' if redis_cpu is not None else '-'):>13} "
                      f"{(f'{ratio - 1:+.1%}' if ratio else '-'):>11}  {verdict}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "limits_overhead", "rounds": args.rounds, "duration_s": args.duration,
                               "concurrency": args.concurrency, "results": summary}, indent=2) + "\n")
    console.print(f"figures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
