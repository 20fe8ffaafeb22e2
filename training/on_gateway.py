"""Episodes on a running gateway (``replay-train --gateway URL``): rollouts, validation and the gate run through
its backends (its balancing over SGLang or vLLM replicas) instead of the in-process engine.

The agent loop, the suite's tools (with their injected faults) and its verifier stay in the trainer, as they are
for the embedded engine; only the model calls go to the gateway. So an episode means the same on both.

- **Adapters.** Each adapter an evaluation or a rollout step runs is uploaded as a new version of one registry
  name (``rollouts-<run>``) and published: the gateway loads it into every backend serving the base before the
  call returns, so a step's rollouts start only once every replica holds it. Requests name the version
  (``base:name@N``). No replica is ever asked to reload new weights under a name it has served, so nothing it
  keeps per adapter name (a prefix cache) can answer for another version. A released version is retired, which
  unloads it.
- **Tokens.** Every call asks for ``return_token_ids``: the answer carries the token ids and log-probabilities of
  the replica that sampled it, and names it in ``X-Harness-Backend``; the trainer records both with the call.
- **Capture.** Calls are sent with ``X-Harness-Capture: off``: the trainer records its episodes itself (source
  ``rollout``, labelled with their task and group), so the gateway does not record them a second time.

The admin key (``[server] admin_key_env``, ``HARNESS_ADMIN_KEY``) authenticates both the adapter uploads and the
calls.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import structlog

from gateway.adapters import archive
from gateway.agent.context import TokenCounter
from gateway.auth import CAPTURE_HEADER
from gateway.backends import token_capture
from gateway.backends.base import Backend, BackendError, BackendUnavailable, ChatRequest, ChatResult
from gateway.backends.openai_compat import OpenAICompatBackend
from gateway.config import BackendSettings
from training.evaluate import Evaluator, WithAdapter
from training.settings import TrainingSettings

log = structlog.get_logger()


class GatewayRefused(Exception):
    """The gateway refused what the trainer asked (its key, the model, a parameter): no episode can run there."""


class GatewayBackend(OpenAICompatBackend):
    """A running gateway as the agent loop's backend (see the module doc)."""

    def client_headers(self) -> dict[str, str]:
        return {**super().client_headers(), CAPTURE_HEADER: "off"}

    def upstream_model(self, request: ChatRequest) -> str:
        return f"{request.model}:{request.adapter}" if request.adapter else request.model

    async def chat(self, request: ChatRequest) -> ChatResult:
        # The body goes as the loop made it (constrain_tool_calls included): the gateway decides what it serves.
        body = {**request.body, "model": self.upstream_model(request), "stream": False,
                token_capture.GATEWAY_FIELD: True}
        try:
            response, content = await self._send(body, stream=False)
        except BackendUnavailable as exc:  # not reached at all: every episode would fail alike
            raise GatewayRefused(f"the gateway at {self.settings.base_url} could not be reached: {exc.message}") \
                from None
        except BackendError as exc:
            if 400 <= exc.status_code < 500 and exc.status_code != 429:
                raise GatewayRefused(f"the gateway refused a call of model {body['model']!r}: {exc.message}") from None
            raise  # the gateway's own failure (its replicas down): this episode fails, as any backend error does
        answer = self._parsed(content, "choices")
        return ChatResult(response=answer, extras=token_capture.read(answer),
                          backend=response.headers.get(token_capture.BACKEND_HEADER.lower()))


class GatewayEvaluator(Evaluator):
    """``Evaluator`` whose episodes run on a gateway; adapters are published there as versions (module doc)."""

    def __init__(self, settings: TrainingSettings, url: str, admin_key: str | None, *, run: str,
                 key_env: str = "HARNESS_ADMIN_KEY") -> None:
        super().__init__(settings)
        if not admin_key:
            raise GatewayRefused(f"running episodes on a gateway needs its admin key in {key_env}")
        self.url = url.rstrip("/")
        self.name = f"rollouts-{run}"[:64]
        self.gateway = GatewayBackend(BackendSettings(
            name="gateway", kind="openai", base_url=f"{self.url}/v1", models=[settings.base_model],
            read_timeout=max(settings.episode_timeout_seconds, 600.0), max_retries=2, api_key=admin_key))
        self.admin = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {admin_key}"},
                                       timeout=600.0)
        self.spread = False  # the gateway balances the episodes; the other ranks have no gateway of their own
        self._versions: dict[str, int] = {}  # folder -> its version under self.name
        self._started = False

    async def __aexit__(self, *exc: object) -> None:
        try:
            for folder in list(self._versions):
                await self.release(folder)
        finally:
            await self.gateway.aclose()
            await self.admin.aclose()

    async def pause(self) -> None:
        """Nothing to give back here: the gateway's replicas hold the weights."""

    async def serving(self, adapter: str | Path | None) -> tuple[Backend, TokenCounter | None]:
        if not self._started:
            await self.gateway.start()
            self._started = True
        return WithAdapter(self.gateway, await self._publish(adapter)), None

    async def _publish(self, adapter: str | Path | None) -> str | None:
        """The version name an adapter folder runs under, uploaded and loaded on every replica first."""
        if adapter is None:
            return None
        folder = str(Path(adapter).resolve())
        if folder not in self._versions:
            packed = await asyncio.to_thread(archive.pack, Path(folder))
            card = await self._admin("/admin/adapters", content=packed, headers={"Content-Type": "application/gzip"},
                                     params={"name": self.name, "base": self.settings.base_model})
            version = int(card["version"])
            published = await self._admin(f"/admin/adapters/{self.name}/publish", json={"version": version})
            self._versions[folder] = version
            log.info("gateway.published", adapter=published["backend_name"],
                     replicas=[r["backend"] for r in published.get("loaded") or []])
        return f"{self.name}@{self._versions[folder]}"

    async def release(self, adapter: str | Path) -> None:
        """Retire the folder's version (every replica unloads it): the trainer may rewrite the folder now."""
        version = self._versions.pop(str(Path(adapter).resolve()), None)
        if version is not None:
            await self._admin(f"/admin/adapters/{self.name}/retire", json={"version": version})

    async def _admin(self, route: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = await self.admin.post(route, **kwargs)
        except httpx.HTTPError as exc:
            raise GatewayRefused(f"the gateway at {self.url} could not be reached: {exc}") from None
        if response.status_code >= 400:
            raise GatewayRefused(f"the gateway answered {response.status_code} to {route}: {error_message(response)}")
        body: dict[str, Any] = response.json()
        return body


def error_message(response: httpx.Response) -> str:
    """What a gateway's error answer says: its envelope's message, else the start of its body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
