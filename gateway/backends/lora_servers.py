"""SGLang and vLLM: OpenAI-compatible servers that load and unload LoRA adapters at runtime.

Both take ``{"lora_name", "lora_path"}`` to load and ``{"lora_name"}`` to unload; they differ in where those
routes live, in how a request names its adapter (SGLang: ``base:adapter``; vLLM: the adapter's own name), and
in their probes. vLLM accepts runtime loading only when started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from gateway.backends import token_capture
from gateway.backends.base import (
    AdapterNotLoaded,
    BackendError,
    BackendUnavailable,
    CallExtras,
    ChatRequest,
    ChatResult,
)
from gateway.backends.openai_compat import OpenAICompatBackend, UpstreamStream
from gateway.backends.upstream_http import Reply, Unreached

# An upstream's "no such adapter" answers; naming the adapter is what makes one about the adapter. SGLang:
# "Got LoRA adapter that has never been loaded: X" (chat), "LoRA with name X does not exist" (unload),
# "... because it is already loaded" (load). vLLM: "The model `X` does not exist" (chat), "The lora adapter
# 'X' cannot be found" (unload), "... has already been loaded" (load).
_MISSING = re.compile(r"never been loaded|not (be )?(found|loaded)|does not exist|cannot be found|unknown|no such",
                      re.IGNORECASE)
_ALREADY = re.compile(r"already (been )?(loaded|exists?)", re.IGNORECASE)


class _LoRAServer(OpenAICompatBackend):
    load_route = "/load_lora_adapter"
    unload_route = "/unload_lora_adapter"
    info_route = "/v1/models"
    # What a request adds to be answered with its token ids and log-probabilities, and what reads them back.
    token_fields: dict[str, Any] = {}
    read_tokens: Callable[..., CallExtras]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = re.sub(r"/v1/?$", "", str(self.settings.base_url).rstrip("/"))

    async def _admin(self, method: str, route: str, body: dict[str, Any] | None = None) -> Reply:
        try:
            response = await self.client.open(method, self.root + route, orjson.dumps(body) if body else None,
                                              {"Content-Type": "application/json"} if body else None)
            return await response.reply(self.settings.max_response_bytes)
        except Unreached as exc:
            raise BackendUnavailable(exc.error.message) from None

    async def load_adapter(self, name: str, path: str) -> None:
        response = await self._admin("POST", self.load_route, self._load_body(name, path))
        if response.status >= 400 and not _ALREADY.search(response.text):
            raise BackendError(f"backend {self.name!r} could not load adapter {name!r} from {path}: "
                               f"{_message(response)}", status_code=502, code="adapter_load_failed")

    def _load_body(self, name: str, path: str) -> dict[str, Any]:
        return {"lora_name": name, "lora_path": path}

    async def unload_adapter(self, name: str) -> None:
        response = await self._admin("POST", self.unload_route, {"lora_name": name})
        if response.status >= 400 and not _MISSING.search(response.text):
            raise BackendError(f"backend {self.name!r} could not unload adapter {name!r}: {_message(response)}",
                               status_code=502, code="adapter_unload_failed")

    async def loaded_adapters(self) -> set[str] | None:
        """The adapters ``/v1/models`` lists: the cards whose ``parent`` is a base model."""
        response = await self._admin("GET", "/v1/models")
        if response.status >= 400:
            raise BackendUnavailable(f"backend {self.name!r} answered {response.status} to /v1/models")
        try:
            cards = orjson.loads(response.body).get("data") or []
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return {self._adapter_of(card) for card in cards if card.get("parent") and card.get("id")} - {""}

    def _adapter_of(self, card: dict[str, Any]) -> str:
        return str(card["id"])

    async def probe(self) -> dict[str, Any]:
        """Health and what the server says it serves, for ``/healthz``."""
        try:
            health = await self._admin("GET", "/health")
            info = await self._admin("GET", self.info_route)
        except BackendUnavailable as exc:
            return {"healthy": False, "error": exc.message}
        detail: Any = None
        if info.status < 400:
            try:
                detail = orjson.loads(info.body)
            except orjson.JSONDecodeError:
                detail = None
        return {"healthy": health.status == 200, "info": detail}

    def _missing_adapter(self, request: ChatRequest, exc: BackendError) -> BackendError:
        if (request.adapter and exc.status_code in (400, 404) and request.adapter in exc.message
                and _MISSING.search(exc.message)):
            return AdapterNotLoaded(exc.message, adapter=request.adapter)
        return exc

    def _body(self, request: ChatRequest, stream: bool) -> dict[str, Any]:
        body = super()._body(request, stream)
        return {**body, **self.token_fields} if request.tokens and not stream else body

    async def chat(self, request: ChatRequest) -> ChatResult:
        try:
            result = await super().chat(request)
        except BackendError as exc:
            raise self._missing_adapter(request, exc) from None
        if request.tokens:
            result.extras = self.read_tokens(result.response, logprobs_asked=bool(request.body.get("logprobs")))
        return result

    async def stream(self, request: ChatRequest) -> UpstreamStream:
        try:
            return await super().stream(request)
        except BackendError as exc:
            raise self._missing_adapter(request, exc) from None


class SGLangBackend(_LoRAServer):
    """SGLang: ``model: "base:adapter"``; load and unload at the server root; ``pinned`` stays false so SGLang
    may evict an idle adapter under ``--max-loaded-loras`` (a request for it then reloads it)."""

    info_route = "/get_model_info"
    token_fields = token_capture.SGLANG_FIELDS
    read_tokens = staticmethod(token_capture.from_sglang)

    def upstream_model(self, request: ChatRequest) -> str:
        return f"{request.model}:{request.adapter}" if request.adapter else request.model

    def _load_body(self, name: str, path: str) -> dict[str, Any]:
        return {"lora_name": name, "lora_path": path, "pinned": False}


class VLLMBackend(_LoRAServer):
    """vLLM: an adapter is a model of its own name (``parent`` = the base); routes under ``/v1``."""

    load_route = "/v1/load_lora_adapter"
    unload_route = "/v1/unload_lora_adapter"
    token_fields = token_capture.VLLM_FIELDS
    read_tokens = staticmethod(token_capture.from_vllm)

    def upstream_model(self, request: ChatRequest) -> str:
        return request.adapter or request.model


def _message(response: Reply) -> str:
    text = response.text[:500]
    try:
        body = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return text or response.reason
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or text)
        for key in ("message", "error_message", "error", "detail"):
            if body.get(key):
                return str(body[key])
    return text
