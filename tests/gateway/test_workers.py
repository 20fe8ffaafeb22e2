"""``[server] workers = N``: N gateway processes on one socket, sharing a PostgreSQL store; refused where one process
must write alone (SQLite) or hold the model alone (the embedded backend)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import structlog

from gateway.logging import configure_logging
from tests.processes import ROOT, GatewayProcess, upstream_config

MODEL = "stand-in-model"
WORKERS = "[server]\nworkers = 2\n"


@pytest.fixture
def workers(standin, postgres, tmp_path: Path) -> Iterator[tuple[GatewayProcess, str]]:
    """Two workers in front of the stand-in upstream, on a fresh PostgreSQL database: (the gateway, its URL)."""
    url = postgres.database()
    gw = GatewayProcess(upstream_config(standin[1], store=f'url = "{url}"', extra=WORKERS), tmp_path).start()
    yield gw, url
    gw.stop()


def _log(gw: GatewayProcess) -> list[dict[str, Any]]:
    """The gateway's JSON log lines, every process's (each must be whole: processes write one stderr)."""
    text = gw.log.read_text()
    written = text[:text.rfind("\n") + 1]  # not a line still being written
    return [json.loads(line) for line in written.splitlines() if line.startswith("{")]


def _wait(what: str, found: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def _serving(gw: GatewayProcess, pids: set[int]) -> set[int]:
    """Waits until each of ``pids`` has started its gateway (its store open, its routes up); returns them."""
    return _wait(f"workers {sorted(pids)} started", lambda: pids <= {
        line["pid"] for line in _log(gw) if line.get("event") == "gateway.started"} and pids)


def _started_workers(gw: GatewayProcess) -> set[int]:
    started = _wait("the supervisor's list of workers",
                    lambda: [line for line in _log(gw) if line.get("event") == "server.workers_started"])
    return _serving(gw, set(started[-1]["workers"]))


def _chat_all(gw: GatewayProcess, n: int, text: str, tag: str) -> list[httpx.Response]:
    """``n`` concurrent chat requests saying ``text`` (a stand-in command such as ``slow:0.2``), each on its own
    connection and with its own system message (``tag`` and its number)."""

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "system", "content": f"{tag} {i}"}, {"role": "user", "content": text}]}) for i in range(n)))

    return asyncio.run(run())


def _served_by(gw: GatewayProcess) -> set[int]:
    return {line["pid"] for line in _log(gw)
            if line.get("event") == "request" and line["path"] == "/v1/chat/completions"}


def _recorded(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT COUNT(*) FROM model_calls WHERE status = 'ok'").fetchone()[0]


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # "pid (name) state ppid ...": the name may hold spaces and parentheses, so read after its last ")".
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2:].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"  # a zombie has exited; only its parent's wait is missing


def test_two_workers_share_the_load_and_the_store(workers: tuple[GatewayProcess, str]) -> None:
    gw, url = workers
    pids = _started_workers(gw)
    assert len(pids) == 2 and gw.proc is not None and gw.proc.pid not in pids

    responses = _chat_all(gw, 64, "slow:0.2", "shared load")

    assert [r.status_code for r in responses] == [200] * 64
    assert _recorded(url) == 64
    assert _served_by(gw) == pids


def test_sigterm_stops_every_worker_after_its_requests(workers: tuple[GatewayProcess, str], standin) -> None:
    gw, url = workers
    assert gw.proc is not None
    pids = _started_workers(gw)
    processes = _descendants(gw.proc.pid)
    assert pids <= processes
    upstream, before = standin[0], len(standin[0].calls)
    answers: list[httpx.Response] = []

    async def run() -> None:
        requests = asyncio.ensure_future(asyncio.to_thread(_chat_all, gw, 8, "slow:1.5", "in flight at shutdown"))
        while len(upstream.calls) < before + 8:  # every request has reached a worker and the upstream
            await asyncio.sleep(0.02)
        gw.proc.send_signal(signal.SIGTERM)
        answers.extend(await requests)

    asyncio.run(run())

    assert [r.status_code for r in answers] == [200] * 8
    assert _recorded(url) == 8
    gw.proc.wait(10)
    assert gw.proc.returncode == 0
    _wait("every worker gone", lambda: not any(_alive(pid) for pid in processes | pids), timeout=5)


def test_a_killed_worker_is_replaced_and_the_gateway_keeps_answering(workers: tuple[GatewayProcess, str]) -> None:
    gw, url = workers
    pids = _started_workers(gw)
    victim, survivor = sorted(pids)

    os.kill(victim, signal.SIGKILL)
    _wait("the killed worker gone", lambda: not _alive(victim), timeout=10)
    assert [r.status_code for r in _chat_all(gw, 16, "hello", "while one is down")] == [200] * 16

    replaced = _wait("the replacement", lambda: [line for line in _log(gw) if line.get("event") ==
                                                  "server.worker_replaced" and line["worker"] == victim])
    assert replaced[0]["exitcode"] == -signal.SIGKILL
    replacement = replaced[0]["replacement"]
    _serving(gw, {replacement})
    for round_ in range(20):  # until the replacement takes a share: the kernel does not deal connections evenly
        assert [r.status_code for r in _chat_all(gw, 32, "slow:0.2", f"after, round {round_}")] == [200] * 32
        if replacement in _served_by(gw):
            break
    served = _served_by(gw)
    assert replacement in served and served <= {survivor, replacement}  # the killed worker had served none
    assert _recorded(url) == 16 + 32 * (round_ + 1)


def test_a_log_line_is_one_write_and_names_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[str] = []

    class Stderr:
        def isatty(self) -> bool:
            return False

        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    configure_logging("json", "info")
    structlog.get_logger("workers-test").info("one.line", n=1)

    (line,) = writes  # a line written in parts could run into another process's between them
    assert line.endswith("\n") and json.loads(line)["pid"] == os.getpid()


def _serve(tmp_path: Path, config: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "harness.toml"
    path.write_text(config)
    return subprocess.run([sys.executable, "-m", "harness.main", "serve", "--config", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"]})


def test_workers_on_sqlite_are_refused(tmp_path: Path) -> None:
    out = _serve(tmp_path, upstream_config("http://127.0.0.1:9", extra=WORKERS))

    assert out.returncode == 2
    assert out.stderr.strip() == ("error: invalid configuration: [server] workers = 2 needs a PostgreSQL store "
                                  "([store] url): an SQLite file takes one writing process")
    assert not (tmp_path / "harness.db").exists()

    check = subprocess.run([sys.executable, "-m", "harness.main", "config", "check", str(tmp_path / "harness.toml")],
                           capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT),
                                                                            "PATH": os.environ["PATH"]})
    assert check.returncode == 1
    assert "workers = 2 needs a PostgreSQL store" in check.stderr


def test_workers_with_the_embedded_model_are_refused_before_it_loads(tmp_path: Path) -> None:
    # Nothing listens at the URL and no model is at the path: the refusal must come before either is touched.
    out = _serve(tmp_path, f"""{WORKERS}
[store]
url = "postgresql://nobody@127.0.0.1:9/none"

[[backends]]
name = "embedded"
kind = "local"
model_path = "{tmp_path / 'no-such-model.gguf'}"
""")

    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: invalid configuration: [server] workers = 2 cannot serve the embedded model "
                           "(backend 'embedded'): each worker would load its own copy of the model")
