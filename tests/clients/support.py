"""Helpers for the tests that drive the real Codex and Cline CLIs against a real gateway process.

The CLIs are installed by ``scripts/install-clients.sh`` into ``.clients/`` at the repository root. A
test whose CLI is missing is skipped, unless ``HARNESS_REQUIRE_CLIENTS=1`` (CI sets it) makes that a
failure.

Each CLI runs with a bare environment: a temporary ``HOME``, no inherited API keys, and every
HTTP(S) proxy variable pointed at a local proxy that refuses everything (``DenyProxy``), with
``NO_PROXY`` for loopback. Whatever a CLI tries to reach beyond 127.0.0.1 (telemetry, update
checks, plugin catalogs) fails at once on this machine instead of leaving it, and is listed in
``DenyProxy.attempts``.
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_BIN = ROOT / ".clients" / "node_modules" / ".bin"
REQUIRE_ENV = "HARNESS_REQUIRE_CLIENTS"


def require_cli(name: str) -> Path:
    """The installed CLI's launcher, or a skip (a failure under ``HARNESS_REQUIRE_CLIENTS=1``)."""
    path = CLIENTS_BIN / name
    if path.exists() and os.access(path, os.X_OK):
        return path
    reason = f"{name} CLI not installed at {path}; run scripts/install-clients.sh"
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(reason)
    pytest.skip(reason)


class _DenyHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(5)
        try:
            first = self.rfile.readline(4096).decode("latin-1").strip()
            while self.rfile.readline(4096) not in (b"\r\n", b"\n", b""):
                pass
        except OSError:
            return
        self.server.attempts.append(first)  # type: ignore[attr-defined]
        try:
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass


class _DenyServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class DenyProxy:
    """An HTTP proxy on a loopback port that answers every request (CONNECT included) with 403."""

    def __init__(self) -> None:
        self.server = _DenyServer(("127.0.0.1", 0), _DenyHandler)
        self.server.attempts = []  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def attempts(self) -> list[str]:
        return list(self.server.attempts)  # type: ignore[attr-defined]

    def __enter__(self) -> DenyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def client_env(home: Path, proxy: DenyProxy, **extra: str) -> dict[str, str]:
    """A bare environment for a CLI: its own HOME, no keys from the caller, no way off this machine."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        env[var] = proxy.url
    env.update(extra)
    return env


@dataclass
class Completed:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode} after {self.seconds:.1f}s\n"
                f"--- stdout (tail) ---\n{self.stdout[-6000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}")


def run_cli(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> Completed:
    """Run a CLI to completion in its own process group; on timeout, or afterwards, nothing of it is left."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate(timeout=10)
        done = Completed(argv, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                         time.monotonic() - started)
        pytest.fail(f"{argv[0]} did not finish within {timeout:.0f}s\n{done.describe()}")
    finally:
        # Anything the CLI left behind in its group (a helper, a daemon that did not detach) goes too.
        _kill_group(proc.pid)
    return Completed(argv, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                     time.monotonic() - started)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among a CLI's output lines (other lines are ignored)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(value, dict):
                out.append(value)
    return out


# --- configuring the CLIs ------------------------------------------------------------------------

# Codex: everything that would reach beyond the gateway is off: update checks, analytics, feedback, OTel
# export, web search, the plugin/app catalogs (which run `git ls-remote https://github.com/openai/plugins.git`)
# and the background daemon. Run it with `--strict-config`, so a key this version does not know is an
# error rather than silently ignored.
CODEX_CONFIG = """\
model = "{model}"
model_provider = "harness"
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.harness]
name = "{provider_name}"
base_url = "{base_url}"
wire_api = "responses"
env_key = "HARNESS_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 60000

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
remote_plugin = false
apps = false
in_app_updates = false
daemon_auto_start = false
shell_snapshot = false
"""


def codex_home(path: Path, base_url: str, model: str, catalog: Path | None = None,
               provider_name: str = "agent-harness gateway") -> Path:
    """A ``CODEX_HOME`` whose config.toml points Codex at ``base_url`` (the gateway's ``/v1``); with ``catalog``, a
    model catalog (``model_catalog_json``) in place of Codex's own. A provider named "OpenAI" makes Codex compact
    with a ``compaction_trigger`` request; any other name, with a summary request of its own."""
    path.mkdir(parents=True, exist_ok=True)
    config = CODEX_CONFIG.format(model=model, base_url=base_url, provider_name=provider_name)
    if catalog is not None:
        config = f"model_catalog_json = {json.dumps(str(catalog))}\n" + config
    (path / "config.toml").write_text(config)
    return path


DOCUMENTED_CATALOG = Path(__file__).resolve().parents[2] / "docs" / "codex" / "model_catalog.json"


def documented_catalog(folder: Path, model: str) -> tuple[Path, dict[str, Any]]:
    """docs/codex/model_catalog.json with its model renamed to ``model`` (context 8,192, compaction at 6,144), written
    in ``folder``; and its entry."""
    entry = {**json.loads(DOCUMENTED_CATALOG.read_text())["models"][0], "slug": model}
    path = folder / "catalog.json"
    path.write_text(json.dumps({"models": [entry]}))
    return path, entry


def codex_exec_argv(codex: Path, workdir: Path, prompt: str) -> list[str]:
    return [str(codex), "exec", "--json", "--strict-config", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", "-C", str(workdir), prompt]


def configure_cline(cline: Path, data: Path, base_url: str, model: str, env: dict[str, str], cwd: Path) -> None:
    """Cline's provider through ``cline auth`` (the "openai-compatible" provider), and global settings
    that opt out of telemetry and auto-update. Cline 3.0.65 still tries its OTel endpoint
    (otel.cline.bot) at start; the deny proxy in ``client_env`` refuses it."""
    settings = data / "settings"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "global-settings.json").write_text(json.dumps({"telemetryOptOut": True,
                                                               "autoUpdateEnabled": False}))
    done = run_cli([str(cline), "auth", "-p", "openai", "-b", base_url, "-k", "sk-test", "-m", model,
                    "--data-dir", str(data)], cwd=cwd, env=env, timeout=60)
    assert done.returncode == 0, done.describe()
    providers = json.loads((settings / "providers.json").read_text())
    assert providers["providers"]["openai-compatible"]["settings"]["baseUrl"] == base_url, providers


def cline_run_argv(cline: Path, data: Path, workdir: Path, prompt: str) -> list[str]:
    return [str(cline), "--data-dir", str(data), "--json", "-c", str(workdir), "--timeout", "120", prompt]


# --- the gateway's store -------------------------------------------------------------------------

def read_store(db: Path) -> list[dict[str, Any]]:
    """Every trajectory in a gateway's SQLite store with its model calls (request messages resolved)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        blobs = {row["hash"]: orjson.loads(row["body"]) for row in conn.execute("SELECT hash, body FROM blobs")}
        out = []
        for t in conn.execute("SELECT * FROM trajectories ORDER BY created_at, id"):
            calls = []
            for c in conn.execute("SELECT * FROM model_calls WHERE trajectory_id = ? ORDER BY seq", (t["id"],)):
                calls.append({
                    "seq": c["seq"], "status": c["status"], "stream": bool(c["stream"]),
                    "messages": [blobs.get(k) for k in orjson.loads(c["request_messages"])],
                    "response_messages": [blobs.get(k) for k in orjson.loads(c["response_messages"] or "[]")],
                    "tools": blobs.get(c["tools_hash"]) if c["tools_hash"] else None,
                    "error": c["error"],
                })
            out.append({**dict(t), "calls": calls})
        return out
    finally:
        conn.close()


def wait_for_calls(db: Path, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The store once it holds ``count`` model calls in all (records commit just before a reply ends)."""
    deadline = time.monotonic() + timeout
    while True:
        store = read_store(db) if db.exists() else []
        if sum(len(t["calls"]) for t in store) >= count or time.monotonic() > deadline:
            return store
        time.sleep(0.1)


def assert_one_stitched_trajectory(store: list[dict[str, Any]], upstream_calls: int, tool_call_id: str,
                                   prompt: str) -> dict[str, Any]:
    """The whole client session is ONE trajectory holding every model call, each call's history
    extending the previous one, and the last holding the command's tool result exactly once."""
    summary = [(t["id"], t["session_key"], t["n_calls"], len(t["calls"])) for t in store]
    assert len(store) == 1, f"expected one trajectory for the session, got {summary}"
    traj = store[0]
    calls = traj["calls"]
    assert len(calls) == upstream_calls, (
        f"trajectory holds {len(calls)} model calls, the upstream answered {upstream_calls}: {summary}")
    assert [c["seq"] for c in calls] == list(range(len(calls))), [c["seq"] for c in calls]
    assert all(c["status"] == "ok" for c in calls), [(c["seq"], c["status"], c["error"]) for c in calls]
    for prev, nxt in zip(calls, calls[1:], strict=False):
        assert nxt["messages"][:len(prev["messages"])] == prev["messages"], (
            f"call {nxt['seq']}'s history does not extend call {prev['seq']}'s:\n"
            f"{_diff(prev['messages'], nxt['messages'])}")
    last = calls[-1]["messages"]
    results = [m for m in last if m.get("role") == "tool"]
    assert [m.get("tool_call_id") for m in results] == [tool_call_id], (
        f"the last call should carry exactly one tool result, for {tool_call_id}: {results}")
    asked = [m for m in last if m.get("role") == "assistant" and any(
        tc.get("id") == tool_call_id for tc in m.get("tool_calls") or [])]
    assert len(asked) == 1, f"the assistant's tool call should appear once in the last history: {asked}"
    prompts = [m for m in last if m.get("role") == "user" and prompt in _text(m.get("content"))]
    assert len(prompts) == 1, f"the user's prompt should appear once in the last history, found {len(prompts)}"
    keys = [orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in last]
    dupes = {k for k in keys if keys.count(k) > 1}
    assert not dupes, f"duplicated messages in the last history: {[orjson.loads(k) for k in dupes]}"
    return traj


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _diff(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at message {i}:\n  before: {str(x)[:800]}\n  after:  {str(y)[:800]}"
    return f"lengths {len(a)} vs {len(b)}"


# --- the whole stack: scripted model ← gateway ← CLI -----------------------------------------------

@dataclass
class Stack:
    upstream: Any          # ScriptedUpstream
    upstream_url: str
    gateway: Any           # tests.processes.GatewayProcess
    proxy: DenyProxy

    def gateway_log(self) -> str:
        try:
            return self.gateway.log.read_text(errors="replace")[-8000:]
        except OSError:
            return "(no gateway log)"

    def explain(self, done: Completed | None = None) -> str:
        parts = [done.describe()] if done else []
        parts.append(f"--- upstream: {len(self.upstream.calls)} calls, errors {self.upstream.errors}")
        parts.append(f"--- blocked off-machine attempts: {self.proxy.attempts}")
        parts.append(f"--- gateway log ({self.gateway.log}) tail ---\n{self.gateway_log()}")
        return "\n".join(parts)


class stack:  # noqa: N801 - used as a context manager, like open()
    """Start the scripted model, a real gateway process in front of it, and the deny-all proxy."""

    def __init__(self, upstream: Any, workdir: Path, extra_config: str = "", kind: str = "openai") -> None:
        from tests.processes import GatewayProcess, upstream_config
        from tests.standin import ServerThread

        self._server = ServerThread(upstream.app)
        self._proxy = DenyProxy()
        self._upstream = upstream
        self._workdir = workdir
        self._gateway_cls = GatewayProcess
        self._config = upstream_config
        self._extra = extra_config
        self._kind = kind
        self._gateway: Any = None

    def __enter__(self) -> Stack:
        self._server.__enter__()
        self._proxy.__enter__()
        try:
            self._workdir.mkdir(parents=True, exist_ok=True)
            config = self._config(self._server.url, extra=self._extra, kind=self._kind)
            self._gateway = self._gateway_cls(config, self._workdir).start()
        except BaseException:
            self._proxy.__exit__(None, None, None)
            self._server.__exit__(None, None, None)
            raise
        return Stack(self._upstream, self._server.url, self._gateway, self._proxy)

    def __exit__(self, *exc: object) -> None:
        try:
            if self._gateway is not None:
                self._gateway.stop()
        finally:
            self._proxy.__exit__(None, None, None)
            self._server.__exit__(None, None, None)


def assert_marker(work: Path, marker: str, explain: str) -> None:
    """The command really ran, in the task's working folder."""
    path = work / "marker.txt"
    assert path.exists(), f"marker.txt was not created\n{explain}"
    assert path.read_text().strip() == marker, explain


def recorded_session(db: Path, upstream_calls: int, tool_call_id: str, prompt: str, final_text: str) -> dict[str, Any]:
    """The gateway recorded the session as one trajectory holding every call, ending in the final answer."""
    store = wait_for_calls(db, upstream_calls)
    traj = assert_one_stitched_trajectory(store, upstream_calls, tool_call_id, prompt)
    assert traj["n_calls"] == upstream_calls, traj
    assert traj["calls"][-1]["response_messages"][0].get("content") == final_text, traj["calls"][-1]
    return traj
