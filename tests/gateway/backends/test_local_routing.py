"""Adapters on the embedded backend through a real gateway: published, promoted and requested as
``base:adapter``, with concurrent requests for two adapters and the base each getting their own output."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.config import Settings
from tests.standin import ServerThread

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"
MODEL = "tiny"


@pytest.fixture
def gateway(tmp_path: Path, tiny_model_dir: Path) -> Iterator[str]:
    settings = Settings.model_validate({
        "store": {"path": str(tmp_path / "harness.db")},
        "backends": [{"name": "local", "kind": "local", "model_path": str(tiny_model_dir), "models": [MODEL],
                      "batch_wait_ms": 50}],
        "routing": {"adapters_dir": str(tmp_path / "adapters")},
    })
    settings.server.admin_key = ADMIN
    with ServerThread(build_app(settings), lifespan="on") as server:
        yield server.url


def test_adapters_published_to_the_local_backend_answer_differently_and_never_mix(
        gateway: str, lora_adapters: dict[str, Path]) -> None:
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as admin:
        for name, folder in lora_adapters.items():
            assert admin.post("/admin/adapters", json={"name": name, "base": MODEL, "path": str(folder)}).status_code \
                == 201
            response = admin.post(f"/admin/adapters/{name}/promote", json={"version": 1})
            assert response.status_code == 200, response.text
        assert admin.get("/healthz").json()["adapters"] == {"local": ["a@1", "b@1"]}

    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)

    def ask(model: str) -> str:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                               temperature=0, max_tokens=8)
        return reply.choices[0].message.content

    solo = {model: ask(model) for model in (MODEL, f"{MODEL}:a", f"{MODEL}:b")}
    assert len(set(solo.values())) == 3, solo
    models = [MODEL, f"{MODEL}:a", f"{MODEL}:b"] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        together = list(pool.map(ask, models))
    assert together == [solo[m] for m in models]
