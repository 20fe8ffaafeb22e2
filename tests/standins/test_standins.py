"""The SGLang and vLLM stand-ins answer as the real servers do (see each module's docstring for the sources)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.standin import ServerThread, free_port
from tests.standins.sglang import SGLangStandIn
from tests.standins.vllm import VLLMStandIn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"


def adapter(folder: Path, rank: int = 8) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16,
                                                            "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def ask(model: str, text: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def content(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture
def sglang() -> Iterator[tuple[SGLangStandIn, httpx.Client]]:
    standin = SGLangStandIn("Qwen/Qwen2.5-7B-Instruct", "qwen")
    with ServerThread(standin.app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        yield standin, client


@pytest.fixture
def vllm() -> Iterator[tuple[VLLMStandIn, httpx.Client]]:
    standin = VLLMStandIn("Qwen/Qwen2.5-7B-Instruct", "qwen")
    with ServerThread(standin.app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        yield standin, client


# -- SGLang --------------------------------------------------------------------------------------------------


def test_sglang_load_and_its_failures(sglang: tuple[SGLangStandIn, httpx.Client], tmp_path: Path) -> None:
    standin, client = sglang
    path = adapter(tmp_path / "sql3")
    r = client.post("/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": path, "pinned": False})
    assert r.status_code == 200
    assert r.json() == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                        "loaded_adapters": {"sql@3": path}}
    r = client.post("/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": path})
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["error_message"] == "Failed to load LoRA adapter sql@3 because it is already loaded"
    r = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400
    assert r.json()["error_message"] == f"[Errno 2] No such file or directory: '{tmp_path}/adapter_config.json'"
    r = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "absent")})
    assert r.status_code == 400 and "Repo id must be in the form" in r.json()["error_message"]
    assert standin.loaded == {"sql@3": path}
    assert [p for p, _ in standin.calls] == ["/load_lora_adapter"] * 4

    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [("qwen", "qwen", None), ("sql@3", path, "qwen")]
    info = client.get("/get_model_info").json()
    assert info["served_model_name"] == "qwen" and info["model_path"] == "Qwen/Qwen2.5-7B-Instruct"
    assert client.get("/health").status_code == 200


def test_sglang_chat_routes_by_base_colon_adapter(sglang: tuple[SGLangStandIn, httpx.Client],
                                                  tmp_path: Path) -> None:
    standin, client = sglang
    client.post("/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": adapter(tmp_path / "a")})
    assert content(client.post(CHAT, json=ask("qwen"))) == "served by base"
    r = client.post(CHAT, json=ask("qwen:sql@3"))
    assert content(r) == "served by sql@3" and r.json()["model"] == "qwen:sql@3"
    r = client.post(CHAT, json=ask("qwen:nope"))
    assert r.status_code == 400
    assert r.json() == {"object": "error", "message": "Got LoRA adapter that has never been loaded: nope\n"
                        "All loaded adapters: dict_keys(['sql@3']).", "type": "BadRequestError", "param": None,
                        "code": 400}
    assert client.post(CHAT, json=ask("qwen:nope", stream=True)).status_code == 400

    r = client.post(CHAT, json=ask("qwen:sql@3", stream=True, stream_options={"include_usage": True}))
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "served by sql@3"
    assert chunks[-1]["usage"]["total_tokens"] == 13
    deadline = time.monotonic() + 5  # the server counts a stream out just after its last bytes went
    while standin.in_flight != {"base": 0, "sql@3": 0}:
        assert time.monotonic() < deadline, standin.in_flight
        time.sleep(0.01)


async def test_sglang_unload_waits_for_running_requests(tmp_path: Path) -> None:
    standin = SGLangStandIn("m", "qwen")
    with ServerThread(standin.app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            await client.post("/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": adapter(tmp_path / "a")})
            slow = asyncio.create_task(client.post(CHAT, json=ask("qwen:sql@3", "slow:0.5")))
            while not standin.in_flight.get("sql@3"):
                await asyncio.sleep(0.01)
            started = time.monotonic()
            r = await client.post("/unload_lora_adapter", json={"lora_name": "sql@3"})
            assert time.monotonic() - started > 0.2, "the unload answered before its request finished"
            assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
            assert content(await slow) == "served by sql@3"
            assert standin.unload_in_flight == [("sql@3", 1)]

            r = await client.post("/unload_lora_adapter", json={"lora_name": "sql@3"})
            assert r.status_code == 400
            assert r.json()["error_message"] == "LoRA with name sql@3 does not exist. Loaded LoRAs: odict_keys([])"
            assert r.json()["loaded_adapters"] is None
            # loaded once since the start: a request naming it loads it again
            assert content(await client.post(CHAT, json=ask("qwen:sql@3"))) == "served by sql@3"
            assert standin.implicit_loads == ["sql@3"] and "sql@3" in standin.loaded


def test_sglang_restart_forgets_runtime_adapters(tmp_path: Path) -> None:
    standin = SGLangStandIn("m", "qwen", lora_paths={"boot": adapter(tmp_path / "boot")})
    with ServerThread(standin.app) as server, httpx.Client(base_url=server.url) as client:
        client.post("/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": adapter(tmp_path / "a")})
        assert client.post("/_standin/restart").json() == {"restarted": True}
        assert list(standin.loaded) == ["boot"]
        r = client.post(CHAT, json=ask("qwen:sql@3"))
        assert r.status_code == 400 and "never been loaded: sql@3" in r.json()["message"]
        assert content(client.post(CHAT, json=ask("qwen:boot"))) == "served by boot"


def test_sglang_evicts_the_least_recently_used(tmp_path: Path) -> None:
    standin = SGLangStandIn("m", "qwen", max_loaded_loras=2)
    with ServerThread(standin.app) as server, httpx.Client(base_url=server.url) as client:
        for name in ("a", "b"):
            client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": adapter(tmp_path / name)})
        client.post(CHAT, json=ask("qwen:a"))  # b is now the least recently used
        r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": adapter(tmp_path / "c")})
        assert r.json()["loaded_adapters"] == {"a": str(tmp_path / "a"), "c": str(tmp_path / "c")}
        assert standin.evicted == ["b"]


def test_sglang_rank_and_lora_disabled(tmp_path: Path) -> None:
    standin = SGLangStandIn("m", max_lora_rank=16, enable_lora=False)
    with ServerThread(standin.app) as server, httpx.Client(base_url=server.url) as client:
        r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter(tmp_path / "a", 32)})
        assert r.status_code == 400 and r.json()["error_message"].startswith("LoRA is not enabled")
        standin.enable_lora = True
        r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")})
        assert "with rank 32 is incompatible" in r.json()["error_message"]


# -- vLLM ----------------------------------------------------------------------------------------------------


def test_vllm_load_unload_and_errors(vllm: tuple[VLLMStandIn, httpx.Client], tmp_path: Path) -> None:
    standin, client = vllm
    path = adapter(tmp_path / "a")
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": path})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql@3' added successfully.")
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": path})
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in r.json()["error"]["message"]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql@3", "lora_path": path, "load_inplace": True})
    assert r.status_code == 200
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": f"Loading lora x failed: No adapter found for {tmp_path}", "type": "NotFoundError", "param": None,
        "code": 404}
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["owned_by"]) for c in cards] == [("qwen", None, "vllm"), ("sql@3", "qwen", "vllm")]

    r = client.post(CHAT, json=ask("sql@3"))
    assert content(r) == "served by sql@3" and r.json()["model"] == "sql@3"
    assert client.post(CHAT, json=ask("qwen")).json()["model"] == "qwen"
    r = client.post(CHAT, json=ask("qwen:sql@3"))
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `qwen:sql@3` does not exist. Valid aliases: qwen.", "type": "NotFoundError",
        "param": "model", "code": 404}

    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql@3"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql@3' removed successfully.")
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql@3"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'sql@3' cannot be found."
    assert standin.unload_in_flight == [("sql@3", 0), ("sql@3", 0)]


def test_vllm_without_runtime_updating_has_no_load_route() -> None:
    standin = VLLMStandIn("m", allow_runtime_lora_updating=False)
    with ServerThread(standin.app) as server, httpx.Client(base_url=server.url) as client:
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"}).status_code == 404
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"


async def test_vllm_unload_does_not_wait(tmp_path: Path) -> None:
    standin = VLLMStandIn("m", "qwen")
    with ServerThread(standin.app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter(tmp_path / "a")})
            slow = asyncio.create_task(client.post(CHAT, json=ask("a", "slow:0.5", stream=True)))
            while not standin.in_flight.get("a"):
                await asyncio.sleep(0.01)
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status_code == 200 and standin.in_flight["a"] == 1
            assert (await slow).status_code == 200
            # The server counts the stream finished just after its last byte leaves: give it that moment.
            for _ in range(500):
                if standin.in_flight["a"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert standin.unload_in_flight == [("a", 1)] and standin.in_flight["a"] == 0


# -- as processes --------------------------------------------------------------------------------------------


def _serve(module: str, args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port", str(port)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{module} did not start")


@pytest.mark.integration
def test_sglang_process_takes_real_flags(tmp_path: Path) -> None:
    proc, url = _serve("tests.standins.sglang", [
        "--model-path", "Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--enable-lora",
        "--lora-target-modules", "all", "--mem-fraction-static", "0.8", "--max-loaded-loras", "8",
        "--lora-paths", f"boot={adapter(tmp_path / 'boot')}"])
    try:
        assert httpx.get(url + "/get_model_info").json()["served_model_name"] == "qwen"
        assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == ["qwen", "boot"]
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.integration
def test_vllm_process_needs_the_runtime_updating_variable(tmp_path: Path) -> None:
    proc, url = _serve("tests.standins.vllm", ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen",
                                               "--enable-lora", "--max-loras", "4"],
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter(tmp_path / "a")})
        assert r.status_code == 200
        assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == ["qwen", "a"]
    finally:
        proc.terminate()
        proc.wait(10)
