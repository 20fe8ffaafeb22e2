"""The gateway fuzzed from its own ``/openapi.json``: no 5xx, no hang, every error in OpenAI's envelope.

A real gateway process in front of the stand-in upstream, with an API key, the admin key, the bot webhook and an
agent profile configured; schemathesis generates requests from the published document (a fixed seed, at most
50 examples an operation). The ``before_call`` hook gives each request what a real caller has: the admin key on
``/admin`` routes, an API key elsewhere, and a valid signature on the webhook's, so the fuzzing reaches the
handlers instead of stopping at the 401. Edge cases it generated are kept as fixed cases below.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.api import openapi
from gateway.app import build_app
from gateway.bot.signing import signed_headers
from gateway.config import load_settings
from tests.processes import ROOT, GatewayProcess, upstream_config
from tests.standin import StandIn

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the skip: schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "fuzz-admin-key"
SECRET = "fuzz-bot-secret"
PROFILE = """
[[profiles]]
name = "echo"
model = "stand-in-model"
system_prompt = "You answer."
tools = ["calculator"]
max_steps = 2
[bot]
profile = "echo"
sync_timeout_seconds = 2
"""
REQUEST_TIMEOUT = 15.0


class Fuzzed:
    def __init__(self, proc: GatewayProcess, key: str) -> None:
        self.proc, self.key = proc, key


@pytest.fixture(scope="module")
def fuzzed(standin: tuple[StandIn, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    workdir = tmp_path_factory.mktemp("fuzz")
    env = {"HARNESS_ADMIN_KEY": ADMIN, "HARNESS_BOT_SECRET": SECRET}
    proc = GatewayProcess(upstream_config(standin[1], extra=PROFILE), workdir, env=env)
    created = subprocess.run([sys.executable, "-m", "harness.main", "keys", "create", "--tenant", "fuzz",
                              "--config", str(proc.config)], cwd=workdir, env={**proc.env, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, check=True)
    key = next(line.split()[-1] for line in created.stdout.splitlines() if line.startswith("key:"))
    proc.start()
    yield Fuzzed(proc, key)
    proc.stop()


@pytest.fixture(scope="module")
def operations(fuzzed: Fuzzed) -> dict[str, Any]:
    """The live gateway's operations, by operationId, as schemathesis reads its ``/openapi.json``."""
    document = httpx.get(fuzzed.proc.url + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=fuzzed.proc.url)
    found = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        found[operation.definition.raw["operationId"]] = operation
    return found


def _operation_ids() -> list[str]:
    """The operations the document publishes, read from an app built in-process (collection needs no server)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "harness.toml"
        # a remote backend: building the app must not load torch (the core environment has none)
        config.write_text(upstream_config("http://127.0.0.1:9").replace('"harness.db"', f'"{Path(tmp) / "h.db"}"'))
        document = openapi.document(build_app(load_settings(config, environ={})).routes)
    return sorted(op["operationId"] for path in document["paths"].values() for op in path.values())


def send(case: Any, fuzzed: Fuzzed) -> httpx.Response:
    """A generated request as a real caller sends it: the admin key on ``/admin`` routes, a valid signature over
    the exact body bytes on the webhook's, an API key elsewhere; what ``requests`` would send, sent by httpx."""
    kwargs = case.as_transport_kwargs(base_url=fuzzed.proc.url)
    body = kwargs.get("json")
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        body["model"] = "stand-in-model"  # a model the gateway serves: generated names would all be 404s
    if isinstance(body, dict) and isinstance(body.get("profile"), str):
        body["profile"] = "echo"
    # the standard library's encoder, as requests would: orjson refuses integers beyond 64 bits, which are a case
    raw = json.dumps(kwargs["json"]).encode() if "json" in kwargs else kwargs.get("data") or b""
    headers = {k: v for k, v in kwargs["headers"].items() if str(v).isascii()}
    if "json" in kwargs:
        headers["Content-Type"] = "application/json"
    path = case.operation.path
    if path.startswith("/bot/v1/"):
        headers.update(signed_headers(SECRET.encode(), raw, time.time()))
    elif path.startswith("/admin/"):
        headers["Authorization"] = f"Bearer {ADMIN}"
    else:
        headers["Authorization"] = f"Bearer {fuzzed.key}"
    params = {k: v if isinstance(v, str | int | float) else json.dumps(v)
              for k, v in (kwargs.get("params") or {}).items()}
    return httpx.request(kwargs["method"], kwargs["url"], headers=headers, params=params, content=raw,
                         timeout=REQUEST_TIMEOUT)


@schemathesis.check
def error_in_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx is OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``; on the Messages
    API, Anthropic's: ``{"type": "error", "error": {"type", "message"}}``."""
    if response.status_code < 400:
        return None
    body = orjson.loads(response.content)
    error = body.get("error") if isinstance(body, dict) else None
    anthropic = case.path.startswith("/v1/messages")
    fields = {"message", "type"} if anthropic else {"message", "type", "param", "code"}
    assert isinstance(error, dict) and fields <= set(error), \
        f"{response.status_code} without the error envelope: {response.content[:300]!r}"
    if anthropic:
        assert body.get("type") == "error", body
    assert isinstance(error["message"], str) and error["message"]
    return True


@pytest.mark.parametrize("operation_id", _operation_ids())
def test_fuzzed_requests_get_no_server_error(operation_id: str, operations: dict[str, Any], fuzzed: Fuzzed) -> None:
    operation = operations[operation_id]
    cases = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE)

    statuses: Counter[int] = Counter()

    @given(case=cases)
    @settings(max_examples=50, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        response = send(case, fuzzed)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error, error_in_envelope])

    fuzz()
    print(operation_id, dict(statuses))
    # The credentials let the requests through to the handlers: not every answer is the gate's 401.
    assert set(statuses) - {401, 403}, dict(statuses)


# Inputs the fuzzing generated, kept as fixed cases: each must stay a 4xx in the envelope.
@pytest.mark.parametrize("method, path, content, params", [
    ("POST", "/v1/chat/completions", b'{"model": "stand-in-model", "messages": [], "max_tokens": 18446744073709551616}',
     None),
    ("POST", "/v1/chat/completions", b'{"model": "\\ud800", "messages": "\xed\xa0\x80"}', None),
    ("POST", "/v1/responses", b'{"model": "stand-in-model", "input": [{"type": "function_call_output", '
                              b'"call_id": "c", "output": "x"}]}', None),
    ("GET", "/v1/trajectories", None, {"limit": '{"if": 257}'}),
    ("POST", "/admin/adapters/x/publish", b'{"version": 1e400}', None),
])
def test_generated_edge_cases_stay_4xx(fuzzed: Fuzzed, method: str, path: str, content: bytes | None,
                                       params: dict | None) -> None:
    headers = {"Authorization": f"Bearer {ADMIN if path.startswith('/admin/') else fuzzed.key}",
               "Content-Type": "application/json"}
    r = httpx.request(method, fuzzed.proc.url + path, content=content, params=params, headers=headers,
                      timeout=REQUEST_TIMEOUT)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
