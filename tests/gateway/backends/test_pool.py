"""Several backends for one model: the choice of member (in memory), then a real gateway spreading requests over
stand-in upstreams on loopback ports, moving on from one that fails, ejecting it and taking it back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.backends import build_backend
from gateway.backends.base import BackendError, BackendUnavailable, ChatRequest, ChatResult
from gateway.backends.breaker import Breaker
from gateway.backends.pool import BackendPool, Member, build_pools, choose
from gateway.config import BackendSettings, RoutingSettings, Settings, load_settings
from tests.gateway.adapters.test_lifecycle import adapter_folder
from tests.standin import ServerThread, StandIn, free_port
from tests.standins.sglang import SGLangStandIn
from tools.settings import ConfigError

MODEL = "stand-in-model"
SERVER_ERROR = (500, {"error": {"message": "the stand-in is broken", "type": "server_error", "code": None}})


# -- choosing a member, in memory -------------------------------------------------------------------------------

class Named:
    """A backend that answers with its own name, or raises ``error``."""

    def __init__(self, name: str, error: BackendError | None = None, apis: tuple[str, ...] = ()) -> None:
        self.name, self.models, self.error, self.calls, self.apis = name, [MODEL], error, 0, frozenset(apis)

    async def chat(self, request: ChatRequest) -> ChatResult:
        return ChatResult(response=await self.embeddings(request))

    async def embeddings(self, request: ChatRequest) -> dict[str, Any]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return {"choices": [], "served_by": self.name}


def member(name: str, weight: float = 1.0, in_flight: int = 0, failures: int = 3,
           error: BackendError | None = None, apis: tuple[str, ...] = ()) -> Member:
    return Member(Named(name, error, apis), weight, Breaker(failures, 30.0),  # type: ignore[arg-type]
                  in_flight=in_flight)


def picks(members: list[Member], n: int) -> list[str]:
    return [choose(members).name for _ in range(n)]  # type: ignore[union-attr]


def test_the_member_with_the_fewest_requests_in_flight_per_weight_is_chosen() -> None:
    busy, idle = member("busy", in_flight=2), member("idle", in_flight=1)
    assert picks([busy, idle], 3) == ["idle"] * 3
    heavy = member("heavy", weight=4, in_flight=3)  # 0.75 per unit of weight, below idle's 1
    assert choose([busy, idle, heavy]) is heavy


def test_tied_members_take_turns_in_proportion_to_their_weights() -> None:
    a, b, c = member("a", weight=3), member("b"), member("c", weight=2)
    chosen = picks([a, b, c], 60)
    assert (chosen.count("a"), chosen.count("b"), chosen.count("c")) == (30, 10, 20)
    assert chosen[:6].count("a") == 3, "a heavier member's turns are spread out, not bunched"


def test_an_ejected_member_gets_nothing_while_another_admits_traffic_and_all_of_it_when_none_does() -> None:
    down, up = member("down", failures=1), member("up", in_flight=5)
    down.breaker.failed()
    assert picks([down, up], 4) == ["up"] * 4
    up.breaker = Breaker(1, 30.0)
    up.breaker.failed()
    assert choose([down, up]) is down, "with every member ejected, the request is tried anyway"


def test_tried_members_are_excluded_until_none_is_left() -> None:
    a, b = member("a"), member("b")
    assert choose([a, b], exclude=[a]) is b
    assert choose([a, b], exclude=[a, b]) is None


async def test_a_pool_moves_on_from_a_failing_member_and_names_the_one_that_answered() -> None:
    failing = member("failing", weight=10, error=BackendUnavailable("down"))
    good = member("good")
    pool = BackendPool(MODEL, [(failing, failing.backend), (good, good.backend)])
    result = await pool.chat(ChatRequest(body={}, model=MODEL))
    assert (result.backend, result.response["served_by"]) == ("good", "good")
    assert (failing.backend.calls, failing.breaker.consecutive_failures) == (1, 1)  # type: ignore[attr-defined]
    assert failing.in_flight == good.in_flight == 0


async def test_a_pool_does_not_retry_what_the_request_caused_and_raises_the_last_failure_named() -> None:
    refused = member("refused", weight=10, error=BackendError("bad request", status_code=400))
    other = member("other")
    pool = BackendPool(MODEL, [(refused, refused.backend), (other, other.backend)])
    with pytest.raises(BackendError) as raised:
        await pool.chat(ChatRequest(body={}, model=MODEL))
    assert (raised.value.status_code, raised.value.backend) == (400, "refused")
    assert other.backend.calls == 0  # type: ignore[attr-defined]
    assert refused.breaker.consecutive_failures == 0, "a 400 is the request's fault, not the backend's"

    both = [member("x", error=BackendUnavailable("x down")), member("y", error=BackendUnavailable("y down"))]
    with pytest.raises(BackendUnavailable) as raised:
        await BackendPool(MODEL, [(m, m.backend) for m in both]).chat(ChatRequest(body={}, model=MODEL))
    assert raised.value.backend in ("x", "y") and [m.backend.calls for m in both] == [1, 1]  # type: ignore[attr-defined]


async def test_a_pool_serves_the_other_apis_every_member_serves_with_the_same_retries() -> None:
    failing = member("failing", weight=10, error=BackendUnavailable("down"), apis=("embeddings", "completions"))
    good = member("good", apis=("embeddings",))
    pool = BackendPool(MODEL, [(failing, failing.backend), (good, good.backend)])
    assert pool.apis == {"embeddings"}
    assert (await pool.embeddings(ChatRequest(body={}, model=MODEL)))["served_by"] == "good"
    assert failing.in_flight == good.in_flight == 0


# -- a real gateway over stand-in upstreams ---------------------------------------------------------------------

def backend_block(name: str, url: str, weight: float = 1.0) -> str:
    return f"""
[[backends]]
name = "{name}"
kind = "openai"
base_url = "{url}/v1"
models = ["{MODEL}"]
weight = {weight}
read_timeout = 2.0
connect_timeout = 1.0
max_retries = 2
"""


@contextmanager
def pooled(tmp_path: Path, upstreams: dict[str, tuple[str, float]], routing: str = "") -> Iterator[str]:
    """A gateway on a loopback port whose model is served by each of ``upstreams`` (name: url, weight)."""
    config = tmp_path / "h.toml"
    config.write_text(f'[store]\npath = "{tmp_path / "h.db"}"\n'
                      + "".join(backend_block(n, url, w) for n, (url, w) in upstreams.items())
                      + "\n[routing]\n" + (routing if "health_check_seconds" in routing else
                                             f"health_check_seconds = 0\n{routing}") + "\n")
    with ServerThread(build_app(load_settings(config, environ={})), lifespan="on") as server:
        yield server.url


@contextmanager
def standins(n: int) -> Iterator[list[tuple[StandIn, str]]]:
    with ExitStack() as stack:
        started = []
        for _ in range(n):
            standin = StandIn()
            started.append((standin, stack.enter_context(ServerThread(standin.app)).url))
        yield started


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


def ask(url: str, text: str = "hello", **kw: Any) -> Any:
    return client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/healthz", timeout=5).json()["backends"]


@pytest.mark.integration
def test_requests_are_spread_by_weight_and_away_from_a_slow_member(tmp_path: Path) -> None:
    with standins(2) as [(heavy, heavy_url), (light, light_url)]:
        with pooled(tmp_path, {"heavy": (heavy_url, 3), "light": (light_url, 1)}) as url:
            for _ in range(40):
                ask(url)
            assert (len(heavy.calls), len(light.calls)) == (30, 10)
            metrics = httpx.get(url + "/metrics", timeout=5).text
            for name, count in (("heavy", 30), ("light", 10)):  # the member that answered, not the pool
                assert (f'harness_requests_total{{backend="{name}",model="{MODEL}",route="chat",status="200"}} '
                        f"{count}.0") in metrics

            # The heavy member turns slow: once it holds a request, new ones go to the member with none in flight.
            heavy.calls.clear()
            light.calls.clear()
            heavy.delay = 1.5

            def one(i: int) -> str:
                time.sleep(i * 0.05)
                return ask(url, f"request {i}").choices[0].message.content

            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(one, range(16)))
            assert answers == [f"echo: request {i}" for i in range(16)]
            assert len(heavy.calls) <= 2 and len(light.calls) >= 14, (len(heavy.calls), len(light.calls))


def streamed(url: str, text: str) -> str:
    chunks = list(ask(url, text, stream=True))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


@pytest.mark.integration
def test_a_failure_before_the_first_byte_is_retried_on_another_member(tmp_path: Path) -> None:
    with standins(2) as [(failing, failing_url), (good, good_url)]:
        failing.failure = SERVER_ERROR
        # Never ejected here, and ten times the weight: the failing member is tried first nearly every time.
        with pooled(tmp_path, {"failing": (failing_url, 10), "good": (good_url, 1)},
                    "eject_after_failures = 100") as url:
            for i in range(4):
                assert ask(url, f"n {i}").choices[0].message.content == f"echo: n {i}", "a failure reached the client"
                assert streamed(url, f"s {i}") == f"echo: s {i}"
            # Each request tried the failing member at most once (member_retries = 0: no retries of its own).
            assert 4 <= len(failing.calls) <= 8 and len(good.calls) == 8
            assert health(url)["failing"]["consecutive_failures"] == len(failing.calls)


@pytest.mark.integration
def test_a_member_failing_after_some_requests_is_ejected_then_taken_back_after_a_probe(tmp_path: Path) -> None:
    with standins(2) as [(failing, failing_url), (good, good_url)]:
        failing.failure, failing.fail_after = SERVER_ERROR, 2  # its first two requests (and probes meanwhile) pass
        routing = "eject_after_failures = 3\neject_seconds = 1.0\nhealth_check_seconds = 0.1"
        with pooled(tmp_path, {"failing": (failing_url, 1), "good": (good_url, 1)}, routing) as url:
            for i in range(12):
                assert ask(url, f"n {i}").choices[0].message.content == f"echo: n {i}", "a failure reached the client"
            deadline = time.monotonic() + 5
            while health(url)["failing"]["state"] == "healthy":  # probes count too, with no traffic at all
                assert time.monotonic() < deadline, health(url)
                time.sleep(0.05)
            state = health(url)["failing"]
            assert state["state"] in ("ejected", "half_open") and state["consecutive_failures"] >= 3
            # Two answered, then at most one failure per request until the breaker opened.
            assert len(failing.calls) <= 2 + 3, len(failing.calls)
            assert health(url)["good"]["state"] == "healthy"
            during, served = len(failing.calls), len(good.calls)
            for i in range(4):
                ask(url, f"ejected {i}")
            assert len(failing.calls) == during, "an ejected member got traffic while another was healthy"
            assert len(good.calls) == served + 4

            failing.failure = None  # it heals: the first probe after the cooldown brings it back
            deadline = time.monotonic() + 5
            while health(url)["failing"]["state"] != "healthy":
                assert time.monotonic() < deadline, health(url)
                time.sleep(0.05)
            before = len(failing.calls)
            for i in range(6):
                ask(url, f"back {i}")
            assert len(failing.calls) - before == 3, "a recovered member gets its share again"


@pytest.mark.integration
def test_a_member_on_a_closed_port_is_ejected_by_its_probes_and_never_fails_a_request(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    with standins(1) as [(good, good_url)]:
        routing = "eject_after_failures = 2\neject_seconds = 30\nhealth_check_seconds = 0.1"
        with pooled(tmp_path, {"down": (closed, 5), "up": (good_url, 1)}, routing) as url:
            deadline = time.monotonic() + 5
            while health(url)["down"]["state"] != "ejected":
                assert time.monotonic() < deadline, health(url)
                time.sleep(0.05)
            for i in range(5):
                assert ask(url, f"q {i}").choices[0].message.content == f"echo: q {i}"
            assert len(good.calls) == 5
            assert health(url)["up"] == {"state": "healthy", "in_flight": 0, "consecutive_failures": 0, "weight": 1.0}


@pytest.mark.integration
def test_a_stream_that_fails_mid_way_is_not_retried(tmp_path: Path) -> None:
    with standins(2) as [(a, a_url), (b, b_url)]:
        with pooled(tmp_path, {"a": (a_url, 1), "b": (b_url, 1)}) as url:
            stream = ask(url, "stall", stream=True)
            with pytest.raises(openai.APIError, match="stalled"):
                list(stream)
            assert len(a.calls) + len(b.calls) == 1, "a stream was retried after its first chunk"


@pytest.mark.integration
def test_an_adapter_is_loaded_into_each_member_that_loads_adapters_and_served_by_those_alone(tmp_path: Path) -> None:
    base = "qwen-test"
    first, second, plain = SGLangStandIn(served_model_name=base), SGLangStandIn(served_model_name=base), StandIn()
    with ServerThread(first.app) as a, ServerThread(second.app) as b, ServerThread(plain.app) as c:
        settings = Settings.model_validate({
            "store": {"path": str(tmp_path / "h.db")},
            "backends": [{"name": "sg-a", "kind": "sglang", "base_url": f"{a.url}/v1", "models": [base]},
                         {"name": "sg-b", "kind": "sglang", "base_url": f"{b.url}/v1", "models": [base]},
                         {"name": "plain", "kind": "openai", "base_url": f"{c.url}/v1", "models": [base]}],
            "routing": {"adapters_dir": str(tmp_path / "adapters"), "refresh_seconds": 3600,
                        "health_check_seconds": 0}})
        settings.server.admin_key = "admin-secret"
        with ServerThread(build_app(settings), lifespan="on") as gateway, httpx.Client(
                base_url=gateway.url, headers={"Authorization": "Bearer admin-secret"}, timeout=30) as admin:
            path = str(adapter_folder(tmp_path / "sql"))
            assert admin.post("/admin/adapters", json={"name": "sql", "base": base, "path": path}).status_code == 201
            promoted = admin.post("/admin/adapters/sql/promote", json={"version": 1})
            assert promoted.status_code == 200, promoted.text
            assert first.loaded == second.loaded == {"sql@1": path}

            openai_client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)
            answers = [openai_client.chat.completions.create(
                model=f"{base}:sql", messages=[{"role": "user", "content": f"q {i}"}]).choices[0].message.content
                for i in range(6)]
            assert answers == ["served by sql@1"] * 6
            chats = [len([p for p, _ in s.calls if p.endswith("/chat/completions")]) for s in (first, second)]
            assert chats == [3, 3] and plain.calls == [], "adapter requests went to a member that cannot load it"
            for i in range(3):
                openai_client.chat.completions.create(model=base, messages=[{"role": "user", "content": f"b {i}"}])
            assert len(plain.calls) == 1, "the base model is served by every member"


def test_an_anthropic_backend_cannot_share_a_model() -> None:
    settings = [BackendSettings(name="claude", kind="anthropic", base_url="http://127.0.0.1:9", models=[MODEL]),
                BackendSettings(name="chat", base_url="http://127.0.0.1:9/v1", models=[MODEL])]
    with pytest.raises(ConfigError, match="'claude'.*cannot share a model"):
        build_pools([build_backend(s) for s in settings], settings, RoutingSettings())
