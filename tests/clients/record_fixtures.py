"""Record what the real Codex and Cline CLIs send, as trimmed JSON fixtures for unit tests.

Runs each installed CLI (scripts/install-clients.sh) with the same configuration the end-to-end tests
use, against ``tests.clients.recorder`` instead of the gateway, for a task of one shell command: the
first request is answered with a call of the client's command tool, the second (carrying the tool's
result) with "ok". Writes ``fixtures/codex_responses.json`` and ``fixtures/cline_chat.json``: the client's
version, the endpoint, and both requests (selected headers and the body), with paths, ids and dates
replaced by fixed placeholders and long prompt texts cut short (tool schemas are kept whole).

    python -m tests.clients.record_fixtures          # after bumping a pinned version
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.clients.recorder import Recorder
from tests.clients.support import (
    CLIENTS_BIN,
    DenyProxy,
    client_env,
    cline_run_argv,
    codex_exec_argv,
    codex_home,
    configure_cline,
    run_cli,
)
from tests.standin import ServerThread

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL = "stand-in-model"
COMMAND = "echo was-here > marker.txt"
PROMPT = f"Create marker.txt by running this shell command: {COMMAND}"
KEEP_HEADERS = ("accept", "content-type", "authorization", "user-agent", "originator", "session-id", "thread-id",
                "x-client-request-id", "x-codex-window-id", "x-codex-turn-metadata", "x-codex-beta-features",
                "x-harness-session")
TEXT_LIMIT = 1200
DESCRIPTION_LIMIT = 600
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _trim(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"…[{len(text) - limit} more characters trimmed]"


def _trim_texts(value: Any, limit: int) -> Any:
    if isinstance(value, str):
        return _trim(value, limit)
    if isinstance(value, list):
        return [_trim_texts(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: _trim_texts(v, limit) for k, v in value.items()}
    return value


def _trim_descriptions(value: Any) -> Any:
    if isinstance(value, list):
        return [_trim_descriptions(v) for v in value]
    if isinstance(value, dict):
        return {k: _trim(v, DESCRIPTION_LIMIT) if k == "description" and isinstance(v, str) else
                _trim_descriptions(v) for k, v in value.items()}
    return value


def sanitize(entries: list[dict[str, Any]], paths: dict[str, str]) -> list[dict[str, Any]]:
    """Fixed placeholders for paths, ids and dates; long prompt texts cut; secrets and hosts dropped."""
    text = json.dumps(entries)
    for real, fake in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(real, fake)
    ids: dict[str, str] = {}
    text = UUID.sub(lambda m: ids.setdefault(m.group(0), f"00000000-0000-4000-8000-{len(ids) + 1:012d}"), text)
    text = re.sub(r"<current_date>[^<]*</current_date>", "<current_date>2026-01-01</current_date>", text)
    text = re.sub(r'(\\*"turn_started_at_unix_ms\\*":)\d+', r"\g<1>0", text)
    text = re.sub(r"\(([A-Za-z]+) [0-9.]+; (x86_64|aarch64|arm64)\)", r"(\1; \2)", text)
    out = []
    for entry in json.loads(text):
        headers = {k: v for k, v in entry["headers"].items() if k in KEEP_HEADERS}
        if "authorization" in headers:
            headers["authorization"] = "Bearer sk-test"
        body = dict(entry["body"])
        for key in ("input", "messages", "instructions"):
            if key in body:
                body[key] = _trim_texts(body[key], TEXT_LIMIT)
        if "tools" in body:
            body["tools"] = _trim_descriptions(body["tools"])
        out.append({"method": entry["method"], "path": entry["path"], "headers": headers, "body": body})
    return out


def _recorded(out: Path, suffix: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"*{suffix}.json"))]


def record_codex(tmp: Path) -> dict[str, Any]:
    codex = CLIENTS_BIN / "codex"
    out, work = tmp / "codex-recorded", tmp / "codex-work"
    work.mkdir()
    with ServerThread(Recorder(out, COMMAND).app) as server, DenyProxy() as proxy:
        home = codex_home(tmp / "codex-home", server.url + "/v1", MODEL)
        env = client_env(tmp / "home", proxy, CODEX_HOME=str(home), HARNESS_API_KEY="sk-test")
        version = run_cli([str(codex), "--version"], cwd=work, env=env, timeout=30).stdout.strip()
        done = run_cli(codex_exec_argv(codex, work, PROMPT), cwd=work, env=env, timeout=120)
        assert done.returncode == 0 and (work / "marker.txt").exists(), done.describe()
    requests = sanitize(_recorded(out, "_v1_responses"), {
        str(work): "/workspace", str(home): "/home/user/.codex", str(tmp / "home"): "/home/user"})
    return {"client": version, "endpoint": "POST /v1/responses", "prompt": PROMPT, "requests": requests}


def record_cline(tmp: Path) -> dict[str, Any]:
    cline = CLIENTS_BIN / "cline"
    out, work, data = tmp / "cline-recorded", tmp / "cline-work", tmp / "cline-data"
    work.mkdir()
    with ServerThread(Recorder(out, COMMAND).app) as server, DenyProxy() as proxy:
        env = client_env(tmp / "home", proxy)
        version = run_cli([str(cline), "--version"], cwd=work, env=env, timeout=30).stdout.strip()
        configure_cline(cline, data, server.url + "/v1", MODEL, env, work)
        done = run_cli(cline_run_argv(cline, data, work, PROMPT), cwd=work, env=env, timeout=120)
        assert done.returncode == 0 and (work / "marker.txt").exists(), done.describe()
    requests = sanitize(_recorded(out, "_v1_chat_completions"), {
        str(work): "/workspace", str(data): "/home/user/.cline/data", str(tmp / "home"): "/home/user"})
    return {"client": f"cline {version}", "endpoint": "POST /v1/chat/completions", "prompt": PROMPT,
            "requests": requests}


def main() -> int:
    FIXTURES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="record-fixtures-") as raw:
        tmp = Path(raw)
        for name, record in (("codex_responses.json", record_codex), ("cline_chat.json", record_cline)):
            where = tmp / name.removesuffix(".json")
            where.mkdir()
            fixture = record(where)
            (FIXTURES / name).write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
            print(f"{FIXTURES / name}: {fixture['client']}, {len(fixture['requests'])} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
