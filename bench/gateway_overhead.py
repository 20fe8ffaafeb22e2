#!/usr/bin/env python3
"""Gateway overhead benchmark: what the gateway adds on top of an upstream, against LiteLLM's proxy.

One run, one upstream (nginx returning a fixed ``chat.completion`` body, so the upstream is never the
bottleneck), one load generator (``wrk``, so no Python client competes for the cores). Targets:

    direct            wrk -> nginx
    capture_on        wrk -> gateway (open, no keys; every exchange recorded in SQLite) -> nginx
    capture_off       wrk -> gateway (a ``--no-capture`` API key, on its own database) -> nginx
    capture_on_pg     wrk -> gateway (capture on, the store on PostgreSQL, one process) -> nginx
    capture_on_pg_w2  wrk -> gateway (capture on, PostgreSQL, ``[server] workers = 2``) -> nginx
    litellm           wrk -> LiteLLM proxy (one worker, no database) -> nginx

each at concurrency 1 (``wrk -t1 -c1``) and N (``wrk -t2 -cN``, default 64), after a warm-up, POSTing
``{"model": "bench-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}``.
Each gateway measurement gets a freshly started gateway on a fresh database (``--prefill N`` starts it
with N trajectories instead): what capture costs depends on what the database holds. The PostgreSQL targets
share one throwaway cluster the script starts (``tests/postgres.py``: initdb in a temp folder, a free loopback
port, fsync on) and stops at the end, each measurement on a fresh database of it; they skip, with the reason
printed, when PostgreSQL's server binaries or psycopg are missing, and the two-worker one when the gateway has
no ``[server] workers`` (or starts a single process with it).

Reports requests/second, p50 and p99, the latency each proxy adds over direct, our throughput and p99
as ratios to LiteLLM's, capture's throughput cost, and pass/fail marks against the targets. For the
capture-on targets it also reports the store's side of each measurement window: CPU seconds per request of
the gateway (its process group, every worker) and of PostgreSQL (the postmaster and its children) apart,
and model_calls rows per writer commit (SQLite: the gateway's ``harness_store_commit_batch_size``
histogram; PostgreSQL: distinct inserting transactions, ``xmin``, of the rows the window added). Writes the
figures as JSON too. Needs ``wrk`` and ``nginx`` (Debian: ``apt-get install wrk nginx-light``); LiteLLM
runs from its own virtualenv (created on first run, see ``--litellm-venv``). ``--profile DIR`` then
profiles the gateway with py-spy under the capture-on high-concurrency load.

Never run in CI: it takes a few minutes and its figures depend on the machine.

    python bench/gateway_overhead.py                      # full run, 3 s warm-up + 10 s per measurement
    python bench/gateway_overhead.py --duration 3 --warmup 1 --skip litellm
    python bench/gateway_overhead.py --profile /tmp/gw-profile
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procstat import CLK_TCK, group_cpu_seconds, group_processes, tree_cpu_seconds  # noqa: E402

LITELLM_REQUIREMENT = "litellm[proxy]==1.108.0"
DEFAULT_LITELLM_VENV = REPO / "bench" / ".venv-litellm"
DEFAULT_JSON = REPO / "bench" / "results" / "gateway_overhead.json"
MODEL = "bench-model"
REQUEST_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
UPSTREAM_BODY = {
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
}
STREAM_REQUEST_BODY = {**REQUEST_BODY, "stream": True}
# Streamed targets run against bench/stream_upstream.py (50 chunks, a small gap before each), at the high
# concurrency only.
STREAM_TARGETS = ("stream_direct", "stream_capture_on", "stream_litellm")
TARGETS = ("direct", "capture_on", "capture_off", "capture_on_pg", "capture_on_pg_w2", "litellm", *STREAM_TARGETS)
PG_WORKERS = 2
LABELS = {"direct": "direct (nginx)", "capture_on": "gateway capture on",
          "capture_off": "gateway capture off", "capture_on_pg": "gateway capture on, PG",
          "capture_on_pg_w2": f"gateway capture on, PG, {PG_WORKERS} workers", "litellm": "LiteLLM proxy",
          "stream_direct": "streamed, direct (upstream)", "stream_capture_on": "streamed, gateway capture on",
          "stream_litellm": "streamed, LiteLLM proxy"}


@dataclass(frozen=True)
class GatewayMode:
    """How a gateway target runs: its store, its processes, whether it records."""

    store: str  # "sqlite" or "postgresql"
    workers: int = 1
    capture: bool = True


GATEWAY_MODES = {
    "capture_on": GatewayMode("sqlite"),
    "capture_off": GatewayMode("sqlite", capture=False),
    "capture_on_pg": GatewayMode("postgresql"),
    "capture_on_pg_w2": GatewayMode("postgresql", workers=PG_WORKERS),
}
LABEL_WIDTH = max(len(label) for label in LABELS.values())
PG_TARGETS = tuple(name for name, mode in GATEWAY_MODES.items() if mode.store == "postgresql")
CAPTURE_TARGETS = tuple(name for name, mode in GATEWAY_MODES.items() if mode.capture)

# Targets printed next to the measurements: (required, aim); None where there is no required figure.
CPU_MS_PER_REQUEST = (1.5, 1.0)  # capture on, at the high concurrency
THROUGHPUT_X_LITELLM = (10.0, 15.0)  # capture on, at the high concurrency
MAX_CAPTURE_COST = (None, 0.10)  # at the high concurrency
MAX_ADDED_P50_MS_C1 = {"capture_off": (None, 0.5), "capture_on": (None, 0.8)}
MIN_PG_W2_X_SQLITE = 1.6  # two workers on PostgreSQL against one process on SQLite, at the high concurrency

# Wide enough for the tables when the output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 180)


class BenchError(RuntimeError):
    pass


class TargetUnavailable(BenchError):
    """A target this machine or this checkout cannot run (it is skipped, with the reason, not a failure)."""


# -- processes -------------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class Services:
    """Every process this script starts, each in its own process group, stopped on any exit."""

    def __init__(self) -> None:
        self.running: list[Service] = []

    def start(self, name: str, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Service:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=cwd, start_new_session=True)
        svc = Service(name, proc, log_path)
        self.running.append(svc)
        return svc

    def stop(self, svc: Service, timeout: float = 20.0) -> None:
        if svc in self.running:
            self.running.remove(svc)
        if svc.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(svc.proc.pid, signal.SIGTERM)
            try:
                svc.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                console.print(f"[yellow]{svc.name} ignored SIGTERM for {timeout:.0f} s; killing it[/]")
        # The leader may be gone while its children (workers) live on: sweep the whole group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(svc.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            svc.proc.wait(5)

    def stop_all(self) -> None:
        for svc in reversed(list(self.running)):
            self.stop(svc)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def wait_ready(svc: Service, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise BenchError(f"{svc.name} exited with {svc.proc.returncode} while starting:\n"
                             f"{svc.log_tail()}")
        with contextlib.suppress(OSError):
            if http("GET", url, timeout=2)[0] == 200:
                return
        time.sleep(0.2)
    raise BenchError(f"{svc.name} was not ready at {url} after {timeout:.0f} s:\n{svc.log_tail()}")


def check_chat(name: str, url: str, headers: dict[str, str]) -> dict[str, str]:
    """One request before the load: the target must answer 200 with a chat completion."""
    status, resp_headers, body = http("POST", url, REQUEST_BODY, headers)
    try:
        ok = status == 200 and isinstance(json.loads(body).get("choices"), list)
    except ValueError:
        ok = False
    if not ok:
        raise BenchError(f"{name}: POST {url} answered {status}: {body[:500]!r}")
    return resp_headers


# -- the pieces ------------------------------------------------------------------------------------


def nginx_conf(tmp: Path, port: int) -> Path:
    body = json.dumps(UPSTREAM_BODY, separators=(",", ":"))
    assert "'" not in body
    for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / "nginx" / d).mkdir(parents=True, exist_ok=True)
    conf = tmp / "nginx" / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {tmp}/nginx/nginx.pid;
error_log {tmp}/nginx/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx/client_body;
    proxy_temp_path {tmp}/nginx/proxy;
    fastcgi_temp_path {tmp}/nginx/fastcgi;
    uwsgi_temp_path {tmp}/nginx/uwsgi;
    scgi_temp_path {tmp}/nginx/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    server {{
        listen 127.0.0.1:{port};
        location /v1/chat/completions {{
            default_type application/json;
            return 200 '{body}';
        }}
    }}
}}
""")
    return conf


def gateway_toml(tmp: Path, name: str, port: int, upstream_port: int, *, store_url: str | None = None,
                 workers: int = 1) -> Path:
    d = tmp / name
    d.mkdir()
    path = d / "harness.toml"
    db = d / "harness.db"
    store = f'url = "{store_url}"' if store_url else f'path = "{db}"'
    # Only written when asked for: a gateway without the setting refuses the key.
    workers_line = f"workers = {workers}\n" if workers != 1 else ""
    path.write_text(f"""[server]
host = "127.0.0.1"
port = {port}
log_level = "warning"
{workers_line}
[store]
{store}

[[backends]]
name = "upstream"
kind = "openai"
base_url = "http://127.0.0.1:{upstream_port}/v1"
models = ["{MODEL}"]
""")
    return path


def gateway_env() -> dict[str, str]:
    # HARNESS_* variables would override the config written here; the benchmark runs without them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def create_no_capture_key(config: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "harness.main", "keys", "create", "--tenant", "bench",
                          "--no-capture", "--config", str(config)], cwd=REPO, env=gateway_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    m = re.search(r"^key:\s*(\S+)", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not m:
        raise BenchError(f"harness keys create failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return m.group(1)


def is_pg(db: str) -> bool:
    return db.startswith(("postgresql://", "postgres://"))


def pg_connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=30)


def count_rows(db: str, table: str = "model_calls") -> int:
    """Rows in a gateway database (a SQLite file or a PostgreSQL URL); safe while the gateway runs."""
    if is_pg(db):
        with pg_connect(db) as conn:
            return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def pg_calls_and_commits(url: str) -> tuple[int, int]:
    """model_calls rows, and the transactions that inserted them: a row's ``xmin`` is the id of the transaction
    that inserted it (the gateway never updates a call), so rows committed in one writer batch share it."""
    with pg_connect(url) as conn:
        rows, commits = conn.execute("SELECT COUNT(*), COUNT(DISTINCT xmin::text) FROM model_calls").fetchone()
    return rows, commits


_COMMIT_METRIC = re.compile(r"^harness_store_commit_batch_size_(count|sum) ([0-9.e+]+)$", re.MULTILINE)


def commit_metrics(base_url: str) -> dict[str, float] | None:
    """The writer's commits and the records they held, from one gateway process's /metrics."""
    try:
        status, _, body = http("GET", f"{base_url}/metrics")
    except OSError:
        return None
    found = dict(_COMMIT_METRIC.findall(body.decode(errors="replace"))) if status == 200 else {}
    if "count" not in found:
        return None
    return {"commits": float(found["count"]), "records": float(found.get("sum", 0))}


def litellm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_litellm(venv: Path, install: bool) -> None:
    if (venv / "bin" / "litellm").exists():
        return
    cmd = f"{sys.executable} -m venv {venv} && {venv}/bin/pip install '{LITELLM_REQUIREMENT}'"
    if not install:
        raise BenchError(f"LiteLLM is not installed in {venv}. Install it with:\n  {cmd}\n"
                         "or run without --no-install-litellm, or pass --skip litellm.")
    console.print(f"[bold]Installing LiteLLM into {venv}[/] (first run only):\n  {escape(cmd)}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LITELLM_REQUIREMENT], check=True)


def litellm_config(tmp: Path, upstream_port: int, name: str = "litellm") -> Path:
    d = tmp / name
    d.mkdir()
    path = d / "config.yaml"
    path.write_text(f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: sk-dummy-upstream-key
litellm_settings:
  set_verbose: false
  json_logs: false
  turn_off_message_logging: true
  drop_params: true
  callbacks: []
  success_callback: []
  failure_callback: []
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  disable_spend_logs: true
""")
    return path


def litellm_env(master_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LITELLM_", "DATABASE_URL", "REDIS_"))}
    env.update({
        "LITELLM_MASTER_KEY": master_key,
        "LITELLM_TELEMETRY_DISABLED": "true",   # its usage telemetry
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list at start
        "LITELLM_LOG": "ERROR",
        "LITELLM_MODE": "PRODUCTION",            # no .env loading
        "DISABLE_ADMIN_UI": "True",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else "unknown"


# -- load ------------------------------------------------------------------------------------------

WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "\nBENCH_JSON {\"requests\":%d,\"duration_us\":%d,\"bytes\":%d," ..
    "\"p50_us\":%d,\"p90_us\":%d,\"p99_us\":%d," ..
    "\"max_us\":%d,\"mean_us\":%.2f,\"err_connect\":%d,\"err_read\":%d,\"err_write\":%d,\"err_status\":%d," ..
    "\"err_timeout\":%d}\n",
    summary.requests, summary.duration, summary.bytes, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def wrk_script(tmp: Path, name: str, headers: dict[str, str], body: dict[str, Any] = REQUEST_BODY) -> Path:
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body))}",
             'wrk.headers["Content-Type"] = "application/json"']
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    path = tmp / f"{name}.lua"
    path.write_text("\n".join(lines) + "\n" + WRK_DONE)
    return path


@dataclass
class Load:
    concurrency: int
    threads: int


def machine_busy_seconds() -> float:
    """CPU seconds (summed over cores) the whole machine has spent busy since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user/nice
    return (sum(fields) - idle - guest) / CLK_TCK


def wait_until_quiet(threshold_pct: float, max_wait: float) -> float:
    """Wait until the machine's other work stays under threshold_pct of one core for a second.

    Between measurements nothing of ours is busy, so what is busy belongs to someone else (tests run
    by other people on a shared machine skew every figure). Returns the seconds waited.
    """
    if threshold_pct <= 0:
        return 0.0
    started = time.monotonic()
    told = False
    while True:
        b0, t0 = machine_busy_seconds(), time.monotonic()
        time.sleep(1.0)
        busy = 100 * (machine_busy_seconds() - b0) / (time.monotonic() - t0)
        waited = time.monotonic() - started
        if busy <= threshold_pct:
            return round(waited, 1)
        if waited >= max_wait:
            console.print(f"  [yellow]the machine is still busy ({busy:.0f}% of a core) after "
                          f"{waited:.0f} s; measuring anyway[/]")
            return round(waited, 1)
        if not told:
            console.print(f"  [yellow]waiting for other work to finish ({busy:.0f}% of a core busy)...[/]")
            told = True


def run_wrk(url: str, script: Path, load: Load, seconds: float, timeout_s: float,
            server: Service | None = None, db_pid: int | None = None,
            upstream_pid: int | None = None) -> dict[str, Any]:
    """One wrk run; with ``server``, the CPU its process group used meanwhile, and with ``db_pid`` (PostgreSQL's
    postmaster) the database's apart. ``upstream_pid``: an upstream of ours whose CPU is no other work's."""
    argv = ["wrk", f"-t{load.threads}", f"-c{load.concurrency}", f"-d{max(1, round(seconds))}s",
            f"--timeout={timeout_s:g}s", "--latency", "-s", str(script), url]
    cpu0 = group_cpu_seconds(server.proc.pid) if server else 0.0
    db0 = tree_cpu_seconds(db_pid) if db_pid else 0.0
    up0 = tree_cpu_seconds(upstream_pid) if upstream_pid else 0.0
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = machine_busy_seconds()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + timeout_s + 60,
                         check=False)
    busy = machine_busy_seconds() - busy0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = group_cpu_seconds(server.proc.pid) - cpu0 if server else None
    db_cpu = tree_cpu_seconds(db_pid) - db0 if db_pid else None
    upstream_cpu = tree_cpu_seconds(upstream_pid) - up0 if upstream_pid else 0.0
    m = re.search(r"^BENCH_JSON (\{.*\})$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not m:
        raise BenchError(f"wrk failed ({out.returncode}): {' '.join(argv)}\n{out.stdout}\n{out.stderr}")
    raw = json.loads(m.group(1))
    errors = sum(raw[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
    secs = raw["duration_us"] / 1e6
    wrk_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    cpu: dict[str, Any] = {"wrk_cpu_pct": round(100 * wrk_cpu / secs, 1) if secs else None}
    if db_cpu is not None:
        cpu.update({"db_cpu_pct": round(100 * db_cpu / secs, 1) if secs else None,
                    "db_cpu_ms_per_request": round(1000 * db_cpu / raw["requests"], 4) if raw["requests"] else None})
    if server_cpu is not None:
        cpu.update({"server_cpu_pct": round(100 * server_cpu / secs, 1) if secs else None,
                    "server_cpu_ms_per_request": round(1000 * server_cpu / raw["requests"], 4)
                    if raw["requests"] else None,
                    # Everything else the machine did meanwhile (other people's work, this script: small).
                    "other_cpu_pct": round(max(0.0, 100 * (busy - server_cpu - (db_cpu or 0.0) - wrk_cpu
                                                           - upstream_cpu) / secs), 1) if secs else None})
    return {
        "concurrency": load.concurrency, "threads": load.threads, "duration_s": round(secs, 3),
        "requests": raw["requests"], "errors": errors,
        "error_detail": {k[4:]: raw[k] for k in raw if k.startswith("err_") and raw[k]},
        # Only successful responses count as throughput.
        "rps": round((raw["requests"] - raw["err_status"]) / secs, 1) if secs else 0.0,
        "p50_ms": raw["p50_us"] / 1000, "p90_ms": raw["p90_us"] / 1000, "p99_ms": raw["p99_us"] / 1000,
        "max_ms": raw["max_us"] / 1000, "mean_ms": round(raw["mean_us"] / 1000, 3), **cpu,
        "wrk_output": out.stdout.split("\nBENCH_JSON")[0].strip(),
    }


@dataclass
class Target:
    """What one measurement runs against: the URL, wrk's script, the server's processes, its database (a
    SQLite file or a PostgreSQL URL), PostgreSQL's postmaster, how many gateway processes serve."""

    url: str
    script: Path
    server: Service
    db: str | None = None
    measured_requests: int = 0
    db_pid: int | None = None
    workers: int = 1
    probe_headers: dict[str, str] | None = None  # set: streamed; time to first byte is probed during the load
    upstream_pid: int | None = None  # the streaming upstream, ours: its CPU is not other work

    @property
    def base_url(self) -> str:
        return self.url.split("/v1/", 1)[0]


def store_snapshot(target: Target) -> dict[str, Any]:
    """What the store holds and how many writer commits made it, at one moment (before or after a window)."""
    assert target.db
    snap: dict[str, Any] = {"trajectories": count_rows(target.db, "trajectories")}
    # /metrics is one process's: with several workers it would be whichever answered.
    metrics = commit_metrics(target.base_url) if target.workers == 1 else None
    if is_pg(target.db):
        snap["calls"], snap["commits"] = pg_calls_and_commits(target.db)
        snap["commits_source"] = "xmin"
    else:
        snap["calls"] = count_rows(target.db)
        snap["commits"] = metrics["commits"] if metrics else None
        snap["commits_source"] = "metrics"
    snap["metrics"] = metrics
    return snap


def store_window(before: dict[str, Any], after: dict[str, Any], secs: float) -> dict[str, Any]:
    """The store's side of one window: rows added, writer commits, rows per commit."""
    calls = after["calls"] - before["calls"]
    out: dict[str, Any] = {"db_calls_added": calls, "commits_source": after["commits_source"]}
    if after["commits"] is not None and before["commits"] is not None:
        commits = int(after["commits"] - before["commits"])
        out.update(writer_commits=commits, commits_per_s=round(commits / secs, 1) if secs else None,
                   rows_per_commit=round(calls / commits, 2) if commits else None)
    if after["metrics"] and before["metrics"] and after["commits_source"] != "metrics":
        # One process on PostgreSQL: its histogram too, as a check of the xmin count.
        m = after["metrics"]["commits"] - before["metrics"]["commits"]
        out["metrics_commits"] = int(m)
    return out


def first_byte_ms(url: str, headers: dict[str, str]) -> float | None:
    """One streamed request on a new connection: milliseconds to the first event's bytes, read to its end."""
    host, _, rest = url.removeprefix("http://").partition("/")
    hostname, _, port = host.partition(":")
    body = json.dumps(STREAM_REQUEST_BODY).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json",
                                                   "Content-Length": str(len(body)), **headers}.items())
    with socket.create_connection((hostname, int(port)), timeout=30) as sock:
        started = time.perf_counter()
        sock.sendall(f"POST /{rest} HTTP/1.1\r\n{head}\r\n".encode() + body)
        seen, first = b"", None
        while not seen.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            if not data:
                break
            seen += data
            if first is None and b"data:" in seen:
                first = (time.perf_counter() - started) * 1000
        return first


class FirstBytes:
    """Streamed requests one after another beside the load, each timed to its first event."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = url, headers
        self.samples: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ms = first_byte_ms(self.url, self.headers)
            except OSError:
                ms = None
            if ms is None:
                self.failures += 1
            else:
                self.samples.append(ms)
            self._stop.wait(0.05)

    def __enter__(self) -> FirstBytes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=40)

    def figures(self) -> dict[str, Any]:
        ordered = sorted(self.samples)
        if not ordered:
            return {"ttfb_samples": 0, "ttfb_failures": self.failures}
        return {"ttfb_samples": len(ordered), "ttfb_failures": self.failures,
                "ttfb_p50_ms": round(statistics.median(ordered), 3),
                "ttfb_p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}


def measure(name: str, session: Any, loads: list[Load], args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then measure each load; a measurement the machine's other work disturbed is retried.

    ``session()`` is a context manager giving the Target for one measurement: the same long-lived server
    for direct and LiteLLM, a fresh gateway on a fresh database for the gateway modes (what capture costs
    depends on what the database holds, so every measurement starts from the same state).
    """
    results = {}
    for load in loads:
        best: dict[str, Any] | None = None
        for attempt in range(1 + max(0, args.retries)):
            with session() as target:
                waited = wait_until_quiet(args.quiet_threshold, args.quiet_wait)
                if args.warmup > 0:
                    target.measured_requests += run_wrk(target.url, target.script, load, args.warmup,
                                                        args.wrk_timeout)["requests"]
                before = store_snapshot(target) if target.db else None
                probe = FirstBytes(target.url, target.probe_headers) if target.probe_headers is not None else None
                with probe or contextlib.nullcontext():
                    r = run_wrk(target.url, target.script, load, args.duration, args.wrk_timeout, target.server,
                                target.db_pid, target.upstream_pid)
                if probe is not None:
                    r.update(probe.figures())
                target.measured_requests += r["requests"]
                r.update(attempt=attempt + 1, waited_for_quiet_s=waited, workers=target.workers)
                if before is not None:
                    after = store_snapshot(target)
                    r.update(db_trajectories_before=before["trajectories"],
                             db_trajectories_after=after["trajectories"],
                             **store_window(before, after, r["duration_s"]))
            if best is None or r["other_cpu_pct"] < best["other_cpu_pct"]:
                best = r
            noisy = args.quiet_threshold > 0 and r["other_cpu_pct"] > args.quiet_threshold
            err = f", [red]{r['errors']} errors {r['error_detail']}[/]" if r["errors"] else ""
            note = (f" [yellow](other work used {r['other_cpu_pct']:.0f}% of a core: noisy)[/]"
                    if noisy else "")
            db_note = (f", DB {r['db_trajectories_before']:,}->{r['db_trajectories_after']:,} trajectories"
                       if "db_trajectories_before" in r else "")
            if r.get("rows_per_commit") is not None:
                db_note += f", {r['rows_per_commit']:.1f} rows/commit"
            pg_note = (f"PG CPU {r['db_cpu_pct']:5.1f}% ({r['db_cpu_ms_per_request']:.3f} ms/req), "
                       if r.get("db_cpu_pct") is not None else "")
            console.print(f"  {LABELS[name]:<{LABEL_WIDTH}} c={load.concurrency:<3} {r['rps']:>9.1f} req/s  "
                          f"p50 {r['p50_ms']:7.3f} ms  p99 {r['p99_ms']:8.3f} ms  "
                          f"server CPU {r['server_cpu_pct']:5.1f}% "
                          f"({r['server_cpu_ms_per_request']:.3f} ms/req), " + pg_note +
                          f"wrk CPU {r['wrk_cpu_pct']:5.1f}%, other {r['other_cpu_pct']:4.1f}%"
                          + db_note + err + note)
            if not noisy:
                break
        assert best is not None
        best["noisy"] = args.quiet_threshold > 0 and best["other_cpu_pct"] > args.quiet_threshold
        results[f"c{load.concurrency}"] = best
    return results


def fixed_session(target: Target) -> Any:
    @contextlib.contextmanager
    def session() -> Iterator[Target]:
        yield target
    return session


def gateway_session(services: Services, tmp: Path, mode: str, upstream_port: int, prefill: int,
                    checks: dict[str, Any], pg: Any = None, *, stream: bool = False,
                    upstream_pid: int | None = None) -> Any:
    """A fresh gateway on a fresh database per measurement, checked to capture (or not) as its mode says.

    PostgreSQL modes take a new database of the bench's cluster (``pg``) each time and drop it afterwards. A mode
    with several workers raises TargetUnavailable when its first gateway will not start or starts one process:
    the gateway has no ``[server] workers`` (yet)."""
    spec = GATEWAY_MODES[mode]
    runs = 0

    @contextlib.contextmanager
    def session() -> Iterator[Target]:
        nonlocal runs
        runs += 1
        name = f"{'stream_' if stream else ''}{mode}-{runs}"
        port = free_port()
        url_db = pg.database() if spec.store == "postgresql" else None
        config = gateway_toml(tmp, name, port, upstream_port, store_url=url_db, workers=spec.workers)
        db = url_db or str(config.parent / "harness.db")
        auth: dict[str, str] = {}
        if not spec.capture:
            auth = {"Authorization": f"Bearer {create_no_capture_key(config)}"}
        if prefill:
            prefill_trajectories(db, prefill)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            try:
                svc = start_gateway(services, tmp, name, config, port)
            except BenchError as exc:
                if spec.workers > 1 and runs == 1:
                    raise TargetUnavailable(f"the gateway did not start with [server] workers = {spec.workers} "
                                            f"(not implemented yet?): {exc}") from None
                raise
            with serving(services, svc) as gw:
                if spec.workers > 1:
                    check_workers(gw, spec.workers, first=runs == 1)
                check_chat(name, url, auth)
                if not spec.capture:
                    # The gateway is closed (a key exists): a request without the key must be refused.
                    status = http("POST", url, REQUEST_BODY)[0]
                    if status != 401:
                        raise BenchError(f"{name}: answered {status} to a request without a key; expected 401")
                script = wrk_script(tmp, name, auth, STREAM_REQUEST_BODY if stream else REQUEST_BODY)
                target = Target(url, script, gw, db, measured_requests=1,
                                db_pid=pg.postmaster_pid() if url_db else None, workers=spec.workers,
                                probe_headers=auth if stream else None, upstream_pid=upstream_pid)
                yield target
            recorded = count_rows(db)
            checks.setdefault(mode, []).append({"measured_requests": target.measured_requests,
                                                "recorded_calls": recorded})
            if spec.capture and recorded < target.measured_requests:
                raise BenchError(f"{name}: recorded {recorded} calls for {target.measured_requests} requests: "
                                 "it was not capturing")
            if not spec.capture and recorded:
                raise BenchError(f"{name}: recorded {recorded} calls with a --no-capture key")
        finally:
            if url_db:
                pg.drop(url_db)

    return session


def check_workers(gw: Service, workers: int, *, first: bool) -> None:
    """A gateway asked for several workers must run at least that many processes (in its process group)."""
    deadline = time.monotonic() + 30
    while (n := group_processes(gw.proc.pid)) < workers:
        if time.monotonic() > deadline:
            message = (f"the gateway runs {n} process(es) with [server] workers = {workers}: the setting seems to "
                       "be ignored")
            raise TargetUnavailable(message) if first else BenchError(message)
        time.sleep(0.2)


def prefill_trajectories(db: str, n: int) -> None:
    """Give a fresh database n finished single-call trajectories of the open tenant, as a busy one holds."""
    from replay.schema import migrate, migrate_postgres  # the gateway's own schema

    now = time.time() - 86400
    rows = [(f"prefill-{i:09d}", secrets.token_hex(32), now + i * 1e-3, now + i * 1e-3) for i in range(n)]
    sql = ("INSERT INTO trajectories(id, source, status, head_hash, message_count, n_calls, created_at, "
           "updated_at) VALUES (?, 'proxy', 'completed', ?, 2, 1, ?, ?)")
    if is_pg(db):
        with pg_connect(db) as conn:
            migrate_postgres(conn)
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)
        return
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        migrate(conn)
        conn.executemany(sql, rows)
        conn.commit()


class BenchPostgres:
    """The PostgreSQL cluster the PostgreSQL targets share: tests/postgres.py's throwaway server (initdb in a temp
    folder, a free loopback port, fsync on), started once and stopped at the end."""

    def __init__(self) -> None:
        try:
            import psycopg  # noqa: F401

            from tests.postgres import PostgresServer, _bin_dir
        except ImportError as exc:
            raise TargetUnavailable(f"cannot use PostgreSQL here ({exc}); install the dev extras") from None
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise TargetUnavailable("PostgreSQL's server binaries are not installed (Debian: apt-get install "
                                    "postgresql)")
        self.bin_dir = bin_dir
        self.server = PostgresServer(bin_dir)
        try:
            self.server.start()
        except subprocess.CalledProcessError as exc:
            log = self.server.log.read_text(errors="replace") if self.server.log.exists() else ""
            self.server.stop()
            raise BenchError(f"PostgreSQL did not start: {exc}\n{(exc.stderr or b'').decode(errors='replace')}"
                             f"\n{log}") from None
        self.version = tool_version([str(bin_dir / "postgres"), "--version"])
        with pg_connect(self.server.admin_url) as conn:
            self.settings = {k: v for k, v in conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', "
                "'shared_buffers', 'max_connections', 'wal_level', 'full_page_writes')").fetchall()}

    def postmaster_pid(self) -> int:
        return int((self.server.data / "postmaster.pid").read_text().split()[0])

    def database(self) -> str:
        return self.server.database()

    def drop(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        try:
            with pg_connect(self.server.admin_url) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except psycopg.Error as exc:
            console.print(f"[yellow]could not drop the database {name}: {escape(str(exc))}[/]")

    def stop(self) -> None:
        self.server.stop()


def litellm_session(services: Services, tmp: Path, name: str, venv: Path, upstream_port: int, *,
                    stream: bool = False, upstream_pid: int | None = None) -> Any:
    """A LiteLLM proxy (one worker, no database) in front of the upstream, started for each measurement and stopped
    after it, as the gateways are: an idle LiteLLM left running spends CPU the other targets would share."""
    runs = 0

    @contextlib.contextmanager
    def session() -> Iterator[Target]:
        nonlocal runs
        runs += 1
        run = f"{name}-{runs}"
        port = free_port()
        master_key = "sk-" + secrets.token_hex(20)
        config = litellm_config(tmp, upstream_port, run)
        svc = services.start(run, [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
                                   "--port", str(port), "--num_workers", "1"],
                             tmp / run / "litellm.log", env=litellm_env(master_key), cwd=tmp / run)
        with serving(services, svc):
            wait_ready(svc, f"http://127.0.0.1:{port}/health/liveliness", 180)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            auth = {"Authorization": f"Bearer {master_key}"}
            check_chat(run, url, auth)
            yield Target(url, wrk_script(tmp, run, auth, STREAM_REQUEST_BODY if stream else REQUEST_BODY), svc,
                         probe_headers=auth if stream else None, upstream_pid=upstream_pid)

    return session


def wait_listening(svc: Service, port: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if svc.proc.poll() is not None:
            raise BenchError(f"{svc.name} exited:\n{svc.log_tail()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"{svc.name} does not listen on {port}") from None
            time.sleep(0.1)


def median_of(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency level, each figure's median over the rounds (figures that are not numbers: the first
    round's), and every round's figures under ``rounds``."""
    out: dict[str, Any] = {}
    for level in measured[0]:
        runs = [m[level] for m in measured if level in m]
        merged: dict[str, Any] = {}
        for key, first in runs[0].items():
            values = [r.get(key) for r in runs]
            numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            merged[key] = statistics.median(numbers) if len(numbers) == len(values) else first
        merged["rounds"] = [{k: v for k, v in r.items() if k != "wrk_output"} for r in runs]
        out[level] = merged
    return out


@contextlib.contextmanager
def serving(services: Services, svc: Service) -> Iterator[Service]:
    try:
        yield svc
    finally:
        services.stop(svc)


def start_gateway(services: Services, tmp: Path, name: str, config: Path, port: int) -> Service:
    svc = services.start(name, [sys.executable, "-m", "harness.main", "serve", "--config", str(config)],
                         tmp / name / "gateway.log", env=gateway_env(), cwd=REPO)
    wait_ready(svc, f"http://127.0.0.1:{port}/healthz", 90)
    return svc


# -- profiling -------------------------------------------------------------------------------------

# Frames every main-thread stack starts with; they say nothing about where the time goes.
_ENTRY_FRAME = re.compile(r"^((_run_module_as_main|_run_code|<module>|Typer\.\w+|TyperGroup\.\w+|"
                          r"Command\.\w+|Context\.invoke|_main|get_callback\.<locals>\.wrapper|serve|run|Server\.run|"
                          r"asyncio_run|Runner\.run|Thread\.\w+) \(|thread \(|process )")


def _frame_key(frame: str, keep_line: bool = False) -> str:
    """py-spy frames look like "function (path/to/file.py:123)": shorten the path, keep or drop the line."""
    m = re.match(r"^(.*) \((.*?)(:\d+)?\)$", frame)
    if not m:
        return frame
    func, path, line = m.groups()
    for marker in ("site-packages/", "dist-packages/", f"{REPO}/", "lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "lib/python3.":
                path = path.split("/", 1)[-1]
            break
    return f"{func} ({path}{(line or '') if keep_line else ''})"


def summarize_collapsed(path: Path, top: int, *, rate_hz: int, seconds: float) -> dict[str, Any]:
    """Self and total time per function (and per line of this repo's code) from py-spy's raw output."""
    self_fn: Counter[str] = Counter()
    total_fn: Counter[str] = Counter()
    self_line: Counter[str] = Counter()
    repo_line: Counter[str] = Counter()
    samples = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        raw = [f for f in stack.split(";") if f]
        if not raw:
            continue
        samples += count
        frames = [_frame_key(f) for f in raw]
        self_fn[frames[-1]] += count
        self_line[_frame_key(raw[-1], keep_line=True)] += count
        for f in set(frames):
            total_fn[f] += count
        for f in {_frame_key(f, keep_line=True) for f in raw}:
            if re.search(r" \((gateway|replay)/", f) and not _ENTRY_FRAME.match(f):
                repo_line[f] += count

    def rows(counter: Counter[str], n: int, skip_entry: bool = False,
             lines: bool = False) -> list[dict[str, Any]]:
        out = []
        for f, c in counter.most_common():
            if skip_entry and _ENTRY_FRAME.match(f):
                continue
            if lines:
                out.append({"line": f, "samples": c, "pct": round(100 * c / samples, 2)})
            else:
                out.append({"function": f, "self_pct": round(100 * self_fn[f] / samples, 2),
                            "total_pct": round(100 * total_fn[f] / samples, 2)})
            if len(out) == n:
                break
        return out

    if not samples:
        return {"samples": 0, "by_self": [], "by_total": [], "self_lines": [], "repo_lines": []}
    return {
        "samples": samples,
        # With --gil a sample exists only when some thread held the GIL: this is how busy the GIL was.
        "busy_pct": round(100 * samples / (rate_hz * seconds), 1),
        "by_self": rows(self_fn, top),
        "by_total": rows(total_fn, top, skip_entry=True),
        "self_lines": rows(self_line, top, lines=True),
        "repo_lines": rows(repo_line, top, lines=True),
    }


def profile_gateway(services: Services, tmp: Path, upstream_port: int, args: argparse.Namespace,
                    load: Load) -> dict[str, Any]:
    """py-spy on a fresh capture-on gateway under the high-concurrency load.

    Three recordings of the same length: GIL-holding samples as collapsed stacks (the Python CPU work:
    the hotspot tables) and as a flame graph, and wall-clock samples of every thread (where the
    threads spend their time, waiting included).
    """
    pyspy = shutil.which("py-spy")
    if not pyspy:
        raise BenchError("--profile needs py-spy: pip install py-spy")
    out_dir = Path(args.profile).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = gateway_toml(tmp, "profile", port, upstream_port)
    if args.prefill:
        prefill_trajectories(config.parent / "harness.db", args.prefill)
    seconds = max(1, round(args.profile_duration))
    recordings = (("gil", ["--gil", "--format", "raw"], "gil.txt"),
                  ("gil_flamegraph", ["--gil", "--format", "flamegraph"], "gil.svg"),
                  ("wall", ["--threads", "--format", "raw"], "wall.txt"))
    rps: dict[str, float] = {}
    with serving(services, start_gateway(services, tmp, "profile", config, port)) as gw:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        check_chat("profile", url, {})
        script = wrk_script(tmp, "profile", {})
        run_wrk(url, script, load, max(args.warmup, 1), args.wrk_timeout)
        console.print(f"[bold]Profiling[/] the capture-on gateway (pid {gw.proc.pid}) with py-spy, "
                      f"{len(recordings)} x {seconds} s under wrk -t{load.threads} -c{load.concurrency}")
        for name, opts, filename in recordings:
            mode = ["--nonblocking"] if args.profile_nonblocking else []
            spy = subprocess.Popen([pyspy, "record", "--pid", str(gw.proc.pid), "-d", str(seconds), "-r",
                                    str(args.profile_rate), *mode, *opts, "-o", str(out_dir / filename)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                time.sleep(0.5)  # let py-spy attach before the load starts
                rps[name] = run_wrk(url, script, load, seconds, args.wrk_timeout)["rps"]
                spy_out = spy.communicate(timeout=seconds + 60)[0].decode(errors="replace")
            finally:
                if spy.poll() is None:
                    os.killpg(spy.pid, signal.SIGKILL)
                    spy.wait()
            if spy.returncode != 0:
                raise BenchError(f"py-spy failed ({spy.returncode}):\n{spy_out}")
    kw = {"rate_hz": args.profile_rate, "seconds": seconds}
    summary = {"gil": summarize_collapsed(out_dir / "gil.txt", args.profile_top, **kw),
               "wall": summarize_collapsed(out_dir / "wall.txt", args.profile_top, **kw),
               "files": {name: str(out_dir / filename) for name, _, filename in recordings},
               "rate_hz": args.profile_rate, "seconds": seconds, "concurrency": load.concurrency,
               "nonblocking": args.profile_nonblocking,
               "rps_while_profiled": rps}
    summary["wall"].pop("busy_pct", None)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_profile(summary: dict[str, Any]) -> None:
    gil = summary["gil"]
    head = (f"capture on, c={summary['concurrency']}, {summary['rate_hz']} Hz x {summary['seconds']} s")
    console.print(f"[bold]Gateway profile[/] ({head}): the GIL was held in ~{gil.get('busy_pct', 0)}% "
                  "of the sampling intervals; "
                  "throughput while profiled: "
                  + ", ".join(f"{k} {v:,.0f} req/s" for k, v in summary["rps_while_profiled"].items()))
    tables = (("gil", "by_self", "Python CPU (GIL held): functions by self time", "self"),
              ("gil", "by_total", "Python CPU (GIL held): functions by total time", "total"),
              ("gil", "repo_lines", "Python CPU (GIL held): this repo's lines by total time", "pct"),
              ("wall", "self_lines", "Wall clock, all threads (waiting included): leaf lines", "pct"))
    for part, key, title, _ in tables:
        data = summary[part]
        table = Table(title=f"{title} ({data['samples']} samples)", title_justify="left")
        table.add_column("#", justify="right")
        table.add_column("function (file)" if "lines" not in key else "function (file:line)")
        table.add_column("self %", justify="right")
        table.add_column("total %", justify="right")
        for i, r in enumerate(data[key], 1):
            if "lines" in key:
                table.add_row(str(i), r["line"], f"{r['pct']:.1f}" if key == "self_lines" else "",
                              f"{r['pct']:.1f}" if key == "repo_lines" else "")
            else:
                table.add_row(str(i), r["function"], f"{r['self_pct']:.1f}", f"{r['total_pct']:.1f}")
        console.print(table)
    console.print("files: " + ", ".join(f"{k} {v}" for k, v in summary["files"].items()))


# -- report ----------------------------------------------------------------------------------------


def derive(results: dict[str, dict[str, Any]], levels: list[str], high: str) -> dict[str, Any]:
    d: dict[str, Any] = {"added_latency_ms": {}, "vs_litellm": {}, "capture_cost": {}, "store": {},
                         "vs_sqlite": {}}
    direct = results.get("direct")
    for name in (*GATEWAY_MODES, "litellm"):
        if name not in results or direct is None:
            continue
        d["added_latency_ms"][name] = {
            c: {"p50": round(results[name][c]["p50_ms"] - direct[c]["p50_ms"], 3),
                "p99": round(results[name][c]["p99_ms"] - direct[c]["p99_ms"], 3)} for c in levels}
    if "litellm" in results:
        lite = results["litellm"]
        for name in GATEWAY_MODES:
            if name in results:
                d["vs_litellm"][name] = {
                    c: {"throughput_x": _ratio(results[name][c]["rps"], lite[c]["rps"]),
                        "p99_ratio": _ratio(results[name][c]["p99_ms"], lite[c]["p99_ms"])} for c in levels}
    if "capture_on" in results and "capture_off" in results:
        on, off = results["capture_on"], results["capture_off"]
        d["capture_cost"] = {c: round(1 - on[c]["rps"] / off[c]["rps"], 4) if off[c]["rps"] else None
                             for c in levels}

    for name in CAPTURE_TARGETS:
        if name in results:
            d["store"][name] = {c: {k: results[name][c].get(k) for k in (
                "rps", "p99_ms", "server_cpu_ms_per_request", "db_cpu_ms_per_request", "rows_per_commit",
                "writer_commits", "commits_per_s", "db_calls_added", "workers")} for c in levels}
    if "capture_on" in results:
        sqlite = results["capture_on"]
        for name in PG_TARGETS:
            if name in results:
                d["vs_sqlite"][name] = {
                    c: {"throughput_x": _ratio(results[name][c]["rps"], sqlite[c]["rps"]),
                        "p99_ratio": _ratio(results[name][c]["p99_ms"], sqlite[c]["p99_ms"])} for c in levels}

    # Streamed: at the high concurrency only, each beside LiteLLM's.
    d["stream"] = {name: {k: results[name][high].get(k) for k in (
        "rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request", "ttfb_p50_ms", "ttfb_p99_ms", "ttfb_samples")}
        for name in STREAM_TARGETS if name in results}
    if "stream_capture_on" in results and "stream_litellm" in results:
        d["stream"]["vs_litellm"] = {
            "throughput_x": _ratio(results["stream_capture_on"][high]["rps"], results["stream_litellm"][high]["rps"]),
            "cpu_ratio": _ratio(results["stream_capture_on"][high].get("server_cpu_ms_per_request") or 0,
                                results["stream_litellm"][high].get("server_cpu_ms_per_request") or 0)}

    targets: list[dict[str, Any]] = []

    def check(label: str, value: float | None, unit: str, goals: tuple[float | None, float | None],
              at_most: bool) -> None:
        if value is None:
            return
        for kind, goal in zip(("required", "aim"), goals, strict=True):
            if goal is not None:
                ok = value <= goal if at_most else value >= goal
                targets.append({"target": label, "kind": kind, "value": value, "unit": unit,
                                "goal": f"{'<=' if at_most else '>='} {goal:g}{unit}", "pass": ok})

    on = results.get("capture_on")
    if on is not None:
        check(f"throughput at c={high[1:]} ÷ at c=1, capture on", _ratio(on[high]["rps"], on["c1"]["rps"]), "x",
              (1.0, None), at_most=False)
        check(f"CPU per request at c={high[1:]}, capture on", on[high].get("server_cpu_ms_per_request"), " ms",
              CPU_MS_PER_REQUEST, at_most=True)
    check(f"throughput vs LiteLLM at c={high[1:]}, capture on",
          d["vs_litellm"].get("capture_on", {}).get(high, {}).get("throughput_x"), "x", THROUGHPUT_X_LITELLM,
          at_most=False)
    cost = d["capture_cost"].get(high)
    check(f"capture's throughput cost at c={high[1:]}", None if cost is None else round(100 * cost, 2), "%",
          (None, 100 * MAX_CAPTURE_COST[1]), at_most=True)
    for name, goals in MAX_ADDED_P50_MS_C1.items():
        added = d["added_latency_ms"].get(name, {}).get("c1")
        check(f"p50 added latency at c=1, {LABELS[name]}", None if added is None else added["p50"], " ms", goals,
              at_most=True)
    x = d["vs_sqlite"].get("capture_on_pg_w2", {}).get(high, {}).get("throughput_x")
    check(f"throughput at c={high[1:]}, PostgreSQL with {PG_WORKERS} workers ÷ SQLite with one process "
          "(capture on)", x, "x", (None, MIN_PG_W2_X_SQLITE), at_most=False)
    d["targets"] = targets
    return d


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def _signed(v: float | None) -> str:
    return "" if v is None else f"{v:+.3f}"


def print_report(results: dict[str, dict[str, Any]], derived: dict[str, Any], levels: list[str],
                 skipped: dict[str, str] | None = None) -> None:
    table = Table(title="Gateway overhead (wrk, non-streaming chat completion, fixed nginx upstream)",
                  title_justify="left")
    right = {"justify": "right"}
    for col, kw in (("target", {"no_wrap": True}), ("conc", right), ("req/s", right), ("p50 ms", right),
                    ("p99 ms", right), ("Δp50 ms", right), ("Δp99 ms", right), ("req/s ÷ LiteLLM", right),
                    ("p99 ÷ LiteLLM", right), ("server CPU", right), ("CPU ms/req", right),
                    ("other CPU", right), ("errors", right)):
        table.add_column(col, **kw)
    for name in TARGETS:
        if name not in results or name in STREAM_TARGETS:
            continue
        for c in levels:
            r = results[name][c]
            added = derived["added_latency_ms"].get(name, {}).get(c, {})
            vs = derived["vs_litellm"].get(name, {}).get(c, {})
            table.add_row(LABELS[name], c[1:], f"{r['rps']:,.0f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                          _signed(added.get("p50")), _signed(added.get("p99")),
                          f"{vs['throughput_x']:.2f}x" if vs.get("throughput_x") else "",
                          f"{vs['p99_ratio']:.2f}" if vs.get("p99_ratio") else "",
                          f"{r['server_cpu_pct']:.0f}%", f"{r['server_cpu_ms_per_request']:.3f}",
                          f"[yellow]{r['other_cpu_pct']:.0f}% noisy[/]" if r.get("noisy")
                          else f"{r['other_cpu_pct']:.0f}%",
                          str(r["errors"]) if r["errors"] else "0",
                          end_section=c == levels[-1])
    console.print(table)
    console.print("Δp50/Δp99: latency added over direct at the same concurrency. server CPU: the target's "
                  "processes, % of one core (nginx for direct; the gateway's every worker, PostgreSQL not "
                  "included); CPU ms/req: that CPU per request; other CPU: everything else on the machine except "
                  "wrk and PostgreSQL (noise).")
    streamed = [name for name in STREAM_TARGETS if name in results]
    if streamed:
        high = levels[-1]
        t = Table(title=f"Streamed (50 chunks from bench/stream_upstream.py, c={high[1:]})", title_justify="left")
        for col in ("target", "req/s", "p50 ms", "p99 ms", "TTFB p50 ms", "TTFB p99 ms", "server CPU ms/req",
                    "errors"):
            t.add_column(col, justify="left" if col == "target" else "right", no_wrap=col == "target")
        for name in streamed:
            r = results[name][high]
            cpu = r.get("server_cpu_ms_per_request")
            t.add_row(LABELS[name], f"{r['rps']:,.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['ttfb_p50_ms']:.2f}" if r.get("ttfb_p50_ms") is not None else "",
                      f"{r['ttfb_p99_ms']:.2f}" if r.get("ttfb_p99_ms") is not None else "",
                      f"{cpu:.3f}" if cpu is not None else "", str(r["errors"]))
        console.print(t)
        vs = derived["stream"].get("vs_litellm")
        if vs:
            console.print(f"streamed, gateway ÷ LiteLLM: throughput {vs['throughput_x']}x, CPU per request "
                          f"{vs['cpu_ratio']}x")
    stored = [name for name in CAPTURE_TARGETS if name in results]
    if stored:
        t = Table(title="The store under capture (a fresh database per measurement)", title_justify="left")
        for col in ("target", "store", "procs", "conc", "req/s", "p99 ms", "÷ SQLite req/s", "÷ SQLite p99",
                    "gateway CPU ms/req", "PG CPU ms/req", "total CPU ms/req", "rows/commit", "commits/s"):
            t.add_column(col, justify="left" if col in ("target", "store") else "right", no_wrap=col == "target")
        for name in stored:
            spec = GATEWAY_MODES[name]
            for c in levels:
                r = results[name][c]
                vs = derived["vs_sqlite"].get(name, {}).get(c, {})
                gw, db = r.get("server_cpu_ms_per_request"), r.get("db_cpu_ms_per_request")
                rpc = r.get("rows_per_commit")
                t.add_row(LABELS[name], "PostgreSQL" if spec.store == "postgresql" else "SQLite",
                          str(spec.workers), c[1:], f"{r['rps']:,.0f}", f"{r['p99_ms']:.3f}",
                          f"{vs['throughput_x']:.2f}x" if vs.get("throughput_x") else "",
                          f"{vs['p99_ratio']:.2f}" if vs.get("p99_ratio") else "",
                          f"{gw:.3f}" if gw is not None else "", f"{db:.3f}" if db is not None else "",
                          f"{(gw or 0) + (db or 0):.3f}" if gw is not None else "",
                          f"{rpc:.2f}" if rpc is not None else "",
                          f"{r['commits_per_s']:,.0f}" if r.get("commits_per_s") is not None else "",
                          end_section=c == levels[-1])
        console.print(t)
        console.print("gateway CPU: the gateway's process group (every worker); PG CPU: the postmaster and its "
                      "children (backends, WAL writer, checkpointer, autovacuum), both over the measurement "
                      "window. rows/commit: model_calls rows the window added ÷ writer commits (SQLite: the "
                      "gateway's commit histogram; PostgreSQL: distinct xmin of those rows).")
    for name in CAPTURE_TARGETS:
        for c in levels:
            r = results.get(name, {}).get(c)
            if r and "db_trajectories_before" in r:
                console.print(f"{LABELS[name]}, c={c[1:]}: the database held {r['db_trajectories_before']:,} "
                              f"trajectories before the measurement and {r['db_trajectories_after']:,} after")
    if derived["capture_cost"]:
        console.print("capture cost (1 - capture-on req/s ÷ capture-off req/s): " + ", ".join(
            f"c={c[1:]}: {100 * v:.1f}%" for c, v in derived["capture_cost"].items() if v is not None))
    if derived["targets"]:
        t = Table(title="Targets", title_justify="left")
        t.add_column("")
        t.add_column("target")
        t.add_column("kind")
        t.add_column("measured", justify="right")
        t.add_column("goal", justify="right")
        for row in derived["targets"]:
            mark = "[bold green]PASS[/]" if row["pass"] else "[bold red]FAIL[/]"
            t.add_row(mark, row["target"], row["kind"], f"{row['value']:g}{row['unit']}", row["goal"])
        console.print(t)
    for name, reason in (skipped or {}).items():
        console.print(f"[yellow]skipped {LABELS[name]}:[/] {escape(reason)}")


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3,
                   help="Interleaved rounds over every target; each figure reported is the rounds' median.")
    p.add_argument("--duration", type=float, default=10.0,
                   help="Seconds measured per target and concurrency.")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="Seconds of load before each measurement (0: none).")
    p.add_argument("--concurrency", type=int, default=64, help="The high concurrency (connections).")
    p.add_argument("--threads", type=int, default=2, help="wrk threads at the high concurrency.")
    p.add_argument("--wrk-timeout", type=float, default=10.0, help="wrk's per-request timeout, seconds.")
    p.add_argument("--quiet-threshold", type=float, default=15.0,
                   help="Before each measurement wait until other work on the machine uses less than this "
                        "percentage of one core, and retry a measurement during which it used more (0: off).")
    p.add_argument("--quiet-wait", type=float, default=180.0,
                   help="Longest wait, in seconds, for the machine to quiet down before measuring anyway.")
    p.add_argument("--retries", type=int, default=2,
                   help="Extra attempts at a measurement that other work disturbed; the quietest is kept.")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="Start each gateway database with N finished trajectories (as a busy one holds) "
                        "instead of empty.")
    p.add_argument("--skip", action="append", default=[], choices=TARGETS,
                   help="Leave a target out (repeatable).")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="Where to write the figures as JSON.")
    p.add_argument("--litellm-venv", default=str(DEFAULT_LITELLM_VENV),
                   help=f"Virtualenv holding {LITELLM_REQUIREMENT}; created on first use.")
    p.add_argument("--no-install-litellm", action="store_true",
                   help="Fail with the install command instead of creating the LiteLLM virtualenv.")
    p.add_argument("--profile", metavar="DIR", help="Afterwards, profile the capture-on gateway with py-spy "
                   "under the high-concurrency load; writes gil.txt and wall.txt (collapsed stacks), "
                   "gil.svg (flame graph) and summary.json to DIR.")
    p.add_argument("--profile-only", action="store_true", help="With --profile: skip the measurements.")
    p.add_argument("--profile-duration", type=float, default=10.0, help="Seconds py-spy records.")
    p.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second.")
    p.add_argument("--profile-top", type=int, default=20, help="Functions listed in the profile tables.")
    p.add_argument("--profile-nonblocking", action="store_true",
                   help="Sample without pausing the gateway: it runs at full speed, but stacks can come out "
                        "torn, which blurs the total-time figures (the default pauses it for each sample).")
    p.add_argument("--keep-tmp", action="store_true", help="Keep the temp dir (configs, logs, databases).")
    args = p.parse_args(argv)
    if args.profile_only and not args.profile:
        p.error("--profile-only needs --profile DIR")
    if args.duration < 1:
        p.error("--duration must be at least 1 s (wrk counts whole seconds)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("wrk", "nginx"):
        if not shutil.which(tool):
            console.print(f"[red]error:[/] {tool} not found; install it with: "
                          "apt-get update && apt-get install wrk nginx-light")
            return 2
    targets = [] if args.profile_only else [t for t in TARGETS if t not in args.skip]
    venv = Path(args.litellm_venv).resolve()
    try:
        if "litellm" in targets:
            ensure_litellm(venv, install=not args.no_install_litellm)
    except (BenchError, subprocess.CalledProcessError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2

    loads = [Load(1, 1), Load(args.concurrency, min(args.threads, args.concurrency))]
    levels = [f"c{x.concurrency}" for x in loads]
    high = levels[-1]
    signal.signal(signal.SIGTERM, _on_sigterm)
    services = Services()
    tmp = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    results: dict[str, dict[str, Any]] = {}
    checks: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    pg: BenchPostgres | None = None
    profile = None
    started = time.time()
    try:
        upstream_port = free_port()
        conf = nginx_conf(tmp, upstream_port)
        nginx = services.start("nginx", ["nginx", "-e", str(tmp / "nginx" / "error.log"), "-p",
                                         str(tmp / "nginx"), "-c", str(conf)], tmp / "nginx.log")
        direct_url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        deadline = time.monotonic() + 15
        while True:
            if nginx.proc.poll() is not None:
                raise BenchError(f"nginx exited:\n{nginx.log_tail()}\n" +
                                 (tmp / "nginx" / "error.log").read_text(errors="replace"))
            try:
                check_chat("nginx", direct_url, {})
                break
            except (OSError, BenchError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if targets:
            console.print(f"[bold]Gateway overhead[/]: {args.rounds} interleaved round(s) of {args.warmup:g} s warm-up "
                          f"+ {args.duration:g} s per measurement, concurrency {' and '.join(c[1:] for c in levels)}"
                          f"; temp dir {tmp}")

        if any(t in targets for t in PG_TARGETS):
            try:
                pg = BenchPostgres()
                console.print(f"PostgreSQL: {pg.version} on 127.0.0.1:{pg.server.port} "
                              f"(postmaster pid {pg.postmaster_pid()}), " +
                              ", ".join(f"{k}={v}" for k, v in sorted(pg.settings.items())))
            except TargetUnavailable as exc:
                for t in PG_TARGETS:
                    if t in targets:
                        skipped[t] = str(exc)
                console.print(f"[yellow]skipping the PostgreSQL targets:[/] {escape(str(exc))}")

        # Each target's session: a fixed server (direct, LiteLLM: started once, for every round) or a fresh gateway
        # per measurement. Rounds measure every target in turn, so slow drifts of the machine touch all alike.
        sessions: dict[str, tuple[Any, list[Load]]] = {}
        if "direct" in targets:
            sessions["direct"] = (fixed_session(Target(direct_url, wrk_script(tmp, "direct", {}), nginx)), loads)
        for mode in GATEWAY_MODES:
            if mode in targets and mode not in skipped:
                sessions[mode] = (gateway_session(services, tmp, mode, upstream_port, args.prefill, checks, pg), loads)
        if "litellm" in targets:
            sessions["litellm"] = (litellm_session(services, tmp, "litellm", venv, upstream_port), loads)
        if any(t in targets for t in STREAM_TARGETS):
            stream_port = free_port()
            streamer = services.start("stream_upstream", [sys.executable, str(REPO / "bench" / "stream_upstream.py"),
                                                          "--port", str(stream_port)], tmp / "stream_upstream.log")
            stream_url = f"http://127.0.0.1:{stream_port}/v1/chat/completions"
            wait_listening(streamer, stream_port)
            if "stream_direct" in targets:
                sessions["stream_direct"] = (fixed_session(Target(
                    stream_url, wrk_script(tmp, "stream_direct", {}, STREAM_REQUEST_BODY), streamer,
                    probe_headers={})), loads[-1:])  # the upstream is the server here: its CPU is the server's
            if "stream_capture_on" in targets:
                sessions["stream_capture_on"] = (gateway_session(services, tmp, "capture_on", stream_port, args.prefill,
                                                                 checks, stream=True, upstream_pid=streamer.proc.pid),
                                                 loads[-1:])
            if "stream_litellm" in targets:
                sessions["stream_litellm"] = (litellm_session(services, tmp, "stream_litellm", venv, stream_port,
                                                              stream=True, upstream_pid=streamer.proc.pid), loads[-1:])

        rounds: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            if args.rounds > 1:
                console.print(f"[bold]Round {rnd + 1} of {args.rounds}[/]")
            for name, (session, its_loads) in sessions.items():
                if name in skipped:
                    continue
                try:
                    rounds.setdefault(name, []).append(measure(name, session, its_loads, args))
                except TargetUnavailable as exc:
                    skipped[name] = str(exc)
                    console.print(f"[yellow]skipping {LABELS[name]}:[/] {escape(str(exc))}")
        results = {name: median_of(measured) for name, measured in rounds.items() if name not in skipped}

        if args.profile:
            profile = profile_gateway(services, tmp, upstream_port, args, loads[-1])
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]")
        return 130
    except BenchError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    finally:
        services.stop_all()
        if pg is not None:
            pg.stop()
        if args.keep_tmp:
            console.print(f"temp dir kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    if results:
        derived = derive(results, levels, high)
        print_report(results, derived, levels, skipped)
        report = {
            "benchmark": "gateway_overhead",
            "started_at": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
            "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "prefill": args.prefill,
                         "loads": [{"concurrency": x.concurrency, "wrk_threads": x.threads} for x in loads],
                         "request": REQUEST_BODY, "stream_request": STREAM_REQUEST_BODY, "rounds": args.rounds},
            "environment": {
                "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                "loadavg_at_end": os.getloadavg(),
                "wrk": tool_version(["wrk", "-v"]), "nginx": tool_version(["nginx", "-v"]),
                "litellm": tool_version([str(litellm_python(venv)), "-c",
                                         "import importlib.metadata as m; print(m.version('litellm'))"])
                if "litellm" in results else None,
                "postgresql": {"version": pg.version, "settings": pg.settings} if pg is not None else None,
            },
            "skipped": skipped,
            "results": {name: {c: {k: v for k, v in r.items() if k != "wrk_output"} for c, r in res.items()}
                        for name, res in results.items()},
            "derived": derived,
            "checks": checks,
            "wrk_output": {name: {c: r["wrk_output"] for c, r in res.items()}
                           for name, res in results.items()},
        }
        if profile:
            report["profile"] = profile
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"figures written to {out}")
    if profile:
        print_profile(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
