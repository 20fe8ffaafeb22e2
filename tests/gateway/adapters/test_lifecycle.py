"""The adapter lifecycle through a real gateway on loopback, against the SGLang and vLLM stand-ins: publish,
versioned names, promote during in-flight requests, unload after drain, reload after a backend restart,
rollback, retire, uploads, canaries, key defaults and the admin key."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.auth import hash_secret
from gateway.config import Settings
from replay import keys
from replay.store import TrajectoryStore
from tests.standin import ServerThread
from tests.standins.common import LoRAServerStandIn
from tests.standins.sglang import SGLangStandIn
from tests.standins.vllm import VLLMStandIn

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"
BASE = "qwen-test"


ADAPTER_CONFIG = json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                             "target_modules": ["q_proj", "v_proj"]}).encode()


def adapter_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_bytes(ADAPTER_CONFIG)
    (root / "adapter_model.safetensors").write_bytes(b"")
    return root


@dataclass
class Setup:
    kind: str
    standin: LoRAServerStandIn
    url: str
    tmp: Path
    admin: httpx.Client

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def ask(self, model: str, text: str = "hi", **kwargs: Any) -> str:
        reply = self.client().chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                      **kwargs)
        return reply.choices[0].message.content

    def register(self, name: str = "sql", folder: str | None = None) -> dict[str, Any]:
        path = folder or str(adapter_folder(self.tmp / f"{name}-{time.monotonic_ns()}"))
        response = self.admin.post("/admin/adapters", json={"name": name, "base": BASE, "path": path})
        assert response.status_code == 201, response.text
        return response.json()

    def act(self, action: str, name: str = "sql", **body: Any) -> httpx.Response:
        return self.admin.post(f"/admin/adapters/{name}/{action}", json=body or None)

    def calls(self, route: str) -> list[Any]:
        return [body for path, body in self.standin.calls if path.endswith(route)]

    def upstream_models(self) -> list[str]:
        return [body["model"] for body in self.calls("/chat/completions")]


@contextmanager
def serve(kind: str, tmp: Path, *, routing: dict[str, Any] | None = None) -> Iterator[Setup]:
    standin = SGLangStandIn(served_model_name=BASE) if kind == "sglang" else VLLMStandIn(served_model_name=BASE)
    with ServerThread(standin.app) as upstream:
        settings = Settings.model_validate({
            "store": {"path": str(tmp / "harness.db")},
            "backends": [{"name": kind, "kind": kind, "base_url": f"{upstream.url}/v1", "models": [BASE],
                          "max_retries": 0}],
            "routing": {"adapters_dir": str(tmp / "adapters"), "refresh_seconds": 3600, **(routing or {})},
        })
        settings.server.admin_key = ADMIN
        with ServerThread(build_app(settings), lifespan="on") as gateway, httpx.Client(
                base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as admin:
            yield Setup(kind, standin, gateway.url, tmp, admin)


@pytest.fixture(params=["sglang", "vllm"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    with serve(request.param, tmp_path) as s:
        yield s


def test_publish_loads_the_version_under_its_own_name(setup: Setup) -> None:
    card = setup.register()
    assert (card["version"], card["status"], card["backend_name"]) == (1, "candidate", "sql@1")
    response = setup.act("publish")
    assert response.status_code == 200, response.text
    assert response.json()["loaded"] == [{"backend": setup.kind, "adapter": "sql@1", "ok": True, "error": None}]
    (load,) = setup.calls("load_lora_adapter")
    assert load["lora_name"] == "sql@1" and load["lora_path"] == card["path"]
    if setup.kind == "sglang":
        assert load["pinned"] is False
    assert setup.standin.loaded == {"sql@1": card["path"]}


def test_requests_name_adapters_the_way_each_backend_expects(setup: Setup) -> None:
    setup.register()
    assert setup.act("promote", version=1).status_code == 200
    assert setup.ask(f"{BASE}:sql") == "served by sql@1"
    assert setup.ask(f"{BASE}:sql@1") == "served by sql@1"
    assert setup.ask(BASE) == "served by base"
    stream = setup.client().chat.completions.create(model=f"{BASE}:sql", stream=True,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "served by sql@1"
    adapter_name = f"{BASE}:sql@1" if setup.kind == "sglang" else "sql@1"
    assert setup.upstream_models() == [adapter_name, adapter_name, BASE, adapter_name]


def test_models_lists_adapters_with_their_parent(setup: Setup) -> None:
    setup.register()
    setup.register()
    setup.act("promote", version=1)
    cards = {c.id: c for c in setup.client().models.list().data}
    assert {f"{BASE}:sql", f"{BASE}:sql@1", f"{BASE}:sql@2", BASE} <= set(cards)
    assert cards[f"{BASE}:sql"].parent == BASE  # type: ignore[attr-defined]
    assert setup.client().models.retrieve(f"{BASE}:sql@2").id == f"{BASE}:sql@2"


def test_a_swap_leaves_in_flight_requests_on_their_version_and_unloads_it_after_they_finish(setup: Setup) -> None:
    setup.register()
    setup.act("promote", version=1)
    setup.ask(f"{BASE}:sql")
    setup.register()
    slow: dict[str, Any] = {}

    def slow_request() -> None:
        slow["answer"] = setup.ask(f"{BASE}:sql", "slow:1.5")
        slow["finished"] = time.monotonic()

    thread = threading.Thread(target=slow_request)
    thread.start()
    deadline = time.monotonic() + 5
    while setup.standin.in_flight.get("sql@1", 0) == 0:
        assert time.monotonic() < deadline, "the slow request never reached the backend"
        time.sleep(0.01)
    assert setup.act("promote", version=2).status_code == 200
    assert setup.ask(f"{BASE}:sql") == "served by sql@2"  # new requests go to the new version at once
    assert not [b for b in setup.calls("unload_lora_adapter") if b["lora_name"] == "sql@1"]
    thread.join()
    assert slow["answer"] == "served by sql@1"
    deadline = time.monotonic() + 5
    while not setup.calls("unload_lora_adapter"):
        assert time.monotonic() < deadline, "the old version was never unloaded"
        time.sleep(0.01)
    assert setup.standin.unload_in_flight == [("sql@1", 0)]
    assert set(setup.standin.loaded) == {"sql@2"}


def test_a_backend_restart_is_healed_by_the_next_request(setup: Setup) -> None:
    setup.register()
    setup.act("promote", version=1)
    assert setup.ask(f"{BASE}:sql") == "served by sql@1"
    setup.standin.restart()
    assert setup.ask(f"{BASE}:sql") == "served by sql@1"
    assert [b["lora_name"] for b in setup.calls("load_lora_adapter")] == ["sql@1", "sql@1"]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_backend_restart_is_noticed_by_the_refresh_and_reloaded_before_any_request(kind: str,
                                                                                    tmp_path: Path) -> None:
    with serve(kind, tmp_path, routing={"refresh_seconds": 0.1}) as s:
        s.register()
        s.act("promote", version=1)
        s.standin.restart()
        deadline = time.monotonic() + 5
        while len(s.calls("load_lora_adapter")) < 2:
            assert time.monotonic() < deadline, "the lost adapter was not reloaded"
            time.sleep(0.02)
        assert s.standin.loaded.keys() == {"sql@1"}
        health = s.admin.get("/healthz").json()
        assert health["adapters"] == {kind: ["sql@1"]} and health["backends"][kind]["healthy"] is True


def test_rollback_and_retire(setup: Setup) -> None:
    setup.register()
    setup.register()
    setup.act("promote", version=1)
    setup.act("promote", version=2)
    assert setup.ask(f"{BASE}:sql") == "served by sql@2"
    response = setup.act("rollback")
    assert response.status_code == 200 and response.json()["version"] == 1 and response.json()["replaced"] == 2
    assert setup.ask(f"{BASE}:sql") == "served by sql@1"
    assert setup.act("retire", version=2).status_code == 200
    with pytest.raises(openai.NotFoundError, match="retired"):
        setup.ask(f"{BASE}:sql@2")
    response = setup.act("rollback")
    assert response.status_code == 409 and response.json()["error"]["code"] == "nothing_to_roll_back"


def test_a_failed_load_changes_nothing(setup: Setup) -> None:
    setup.register(folder="/nonexistent/adapter")  # the gateway cannot check it; the backend refuses it
    response = setup.act("publish")
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "adapter_load_failed"
    assert "sql@1" in response.json()["error"]["message"]
    response = setup.act("promote", version=1)
    assert response.status_code == 502
    (card,) = setup.admin.get("/admin/adapters").json()["data"]
    assert (card["status"], card["published"]) == ("candidate", False)


def tar_gz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_an_uploaded_archive_is_stored_under_the_adapters_directory_and_served(setup: Setup) -> None:
    data = tar_gz({"adapter_config.json": ADAPTER_CONFIG, "adapter_model.safetensors": b"\0" * 16})
    response = setup.admin.post("/admin/adapters", params={"name": "sql", "base": BASE}, content=data,
                                headers={"Content-Type": "application/gzip"})
    assert response.status_code == 201, response.text
    path = Path(response.json()["path"])
    assert path == (setup.tmp / "adapters" / "sql" / "1").resolve()
    assert (path / "adapter_config.json").read_bytes() == ADAPTER_CONFIG
    assert setup.act("promote", version=1).status_code == 200
    assert setup.ask(f"{BASE}:sql") == "served by sql@1"
    assert setup.standin.loaded == {"sql@1": str(path)}


@pytest.mark.parametrize("kind", ["sglang"])
def test_unsafe_and_oversized_uploads_are_refused(kind: str, tmp_path: Path) -> None:
    with serve(kind, tmp_path, routing={"max_upload_bytes": 4096}) as s:
        evil = tar_gz({"../../escape.json": b"{}", "adapter_config.json": b"{}"})
        response = s.admin.post("/admin/adapters?name=sql&base=" + BASE, content=evil,
                                headers={"Content-Type": "application/gzip"})
        assert response.status_code == 400 and "outside" in response.json()["error"]["message"]
        assert not (tmp_path / "escape.json").exists() and not (tmp_path / "adapters" / "escape.json").exists()
        big = bytes(range(256)) * 64
        response = s.admin.post("/admin/adapters?name=sql&base=" + BASE, content=big,
                                headers={"Content-Type": "application/x-tar"})
        assert response.status_code == 413
        response = s.admin.post("/admin/adapters", json={"name": "sql", "base": BASE, "path": "relative/dir"})
        assert response.status_code == 400 and "absolute" in response.json()["error"]["message"]
        assert s.admin.get("/admin/adapters").json()["data"] == []


def test_admin_routes_need_the_admin_key(setup: Setup) -> None:
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=setup.url, headers=headers) as client:
            for method, path in (("GET", "/admin/adapters"), ("POST", "/admin/adapters"),
                                 ("POST", "/admin/adapters/sql/publish"), ("POST", "/admin/adapters/sql/rollback")):
                response = client.request(method, path, json={"name": "sql", "base": BASE, "path": "/x"})
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"]["code"] == "admin_key_required"
    assert setup.calls("load_lora_adapter") == []


@pytest.mark.parametrize("kind", ["sglang"])
def test_a_canary_splits_sessions_within_tolerance_and_keeps_each_on_one_version(kind: str, tmp_path: Path) -> None:
    share, sessions = 0.3, 120
    routing = {"aliases": {"support": f"{BASE}:sql"},
               "canaries": [{"model": "support", "target": f"{BASE}:sql@2", "share": share}]}
    with serve(kind, tmp_path, routing=routing) as s:
        s.register()
        s.register()
        s.act("promote", version=1)
        s.act("publish", version=2)
        client = s.client()
        served: dict[int, set[str]] = {}
        for i in range(sessions):
            for turn in range(2):
                reply = client.chat.completions.create(
                    model="support", messages=[{"role": "user", "content": f"turn {turn}"}],
                    extra_headers={"X-Harness-Session": f"session-{i}"})
                served.setdefault(i, set()).add(reply.choices[0].message.content)
        assert all(len(v) == 1 for v in served.values()), "a session moved between versions"
        hits = sum(v == {"served by sql@2"} for v in served.values())
        sigma = math.sqrt(sessions * share * (1 - share))
        assert abs(hits - sessions * share) < 4 * sigma, hits


@pytest.mark.parametrize("kind", ["vllm"])
def test_key_defaults_and_the_override_header(kind: str, tmp_path: Path) -> None:
    async def make_keys() -> None:
        store = TrajectoryStore(str(tmp_path / "harness.db"))
        await store.start()
        await keys.create(store, tenant="t", name="plain", capture=True, secret_hash=hash_secret("sk-plain"),
                               default_model=f"{BASE}:sql")
        await keys.create(store, tenant="t", name="override", capture=True, secret_hash=hash_secret("sk-override"),
                               allow_model_override=True)
        await store.close()

    asyncio.run(make_keys())
    with serve(kind, tmp_path, routing={"default_model": BASE}) as s:
        s.register()
        s.act("promote", version=1)

        def ask(key: str, model: str | None, header: str | None = None) -> httpx.Response:
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
            if model:
                body["model"] = model
            headers = {"Authorization": f"Bearer {key}", **({"X-Harness-Model": header} if header else {})}
            return httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=headers)

        assert ask("sk-plain", None).json()["choices"][0]["message"]["content"] == "served by sql@1"
        assert ask("sk-override", None).json()["choices"][0]["message"]["content"] == "served by base"
        assert ask("sk-plain", BASE, header=f"{BASE}:sql").json()["choices"][0]["message"]["content"] == \
            "served by base"  # this key may not override
        assert ask("sk-override", BASE, header=f"{BASE}:sql").json()["choices"][0]["message"]["content"] == \
            "served by sql@1"



def test_adapter_versions_do_not_multiply_request_series(setup: Setup) -> None:
    setup.register()
    setup.register()
    setup.act("promote", version=1)
    setup.act("promote", version=2)
    for model in (f"{BASE}:sql", f"{BASE}:sql@1", f"{BASE}:sql@2", BASE):
        setup.ask(model)
    deadline = time.monotonic() + 5
    while True:  # a request is counted once its last byte is out
        lines = [line for line in setup.admin.get("/metrics").text.splitlines()
                 if line.startswith('harness_requests_total{') and 'route="chat"' in line]
        if sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    models = sorted(re.search(r'model="([^"]*)"', line).group(1) for line in lines)
    assert models == [BASE, f"{BASE}:sql"], lines
