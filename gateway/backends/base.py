"""The one protocol every model backend implements, and the errors they raise."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ChatRequest:
    """A chat completion as the backend should run it.

    ``body`` is an OpenAI chat-completions body (messages, tools, sampling parameters) whose ``model`` is
    already the name the backend knows; ``adapter`` names a LoRA adapter to apply, if any; ``tenant`` is whose
    request it is: a backend that keeps state across requests (the embedded model's prefix cache) keeps each
    tenant's apart. With ``max_tokens_ceiling`` the body's ``max_tokens`` is an upper bound, not a demand (the
    Anthropic API's, which clients set to the largest a model allows): a backend lowers it to what it can give
    instead of refusing the request. With ``tokens`` the caller wants the token ids and log-probabilities the
    answer was sampled with (``CallExtras``): a backend that can ask its server for them does.
    """

    body: dict[str, Any]
    model: str
    adapter: str | None = None
    tenant: str | None = None
    max_tokens_ceiling: bool = False
    tokens: bool = False


@dataclass
class CallExtras:
    """What a backend knows beyond the wire response: exact token ids and log-probabilities."""

    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[list[int]] | None = None  # one list per choice
    completion_logprobs: list[list[float]] | None = None  # per choice, aligned with the ids: under the model itself
    # Per choice, under the distribution each token was drawn from (temperature, top-p, penalties, grammar mask).
    completion_sampled_logprobs: list[list[float]] | None = None


@dataclass
class ChatResult:
    response: dict[str, Any]  # an OpenAI ``chat.completion`` object
    extras: CallExtras = field(default_factory=CallExtras)
    backend: str | None = None  # set by a pool: the member that answered

    @property
    def message(self) -> dict[str, Any]:
        """The first choice's message; empty when the backend sent none."""
        return ((self.response.get("choices") or [{}])[0].get("message")) or {}


class ChunkStream(Protocol):
    """An async iterator of OpenAI ``chat.completion.chunk`` dicts.

    ``extras`` is complete once iteration has ended; ``aclose`` stops the generation early
    (a client went away) and releases what it holds. A pool's stream also names the member it comes from in
    ``backend`` (``gateway/backends/pool.py``).
    """

    extras: CallExtras

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    async def aclose(self) -> None: ...


class StreamView:
    """Another stream's chunks, as a subclass's ``_chunks`` passes them on; its extras, its end, and the member
    of a pool it came from (``backend``) are the wrapped stream's."""

    def __init__(self, stream: ChunkStream) -> None:
        self._stream = stream
        self.backend: str | None = getattr(stream, "backend", None)

    @property
    def extras(self) -> CallExtras:
        return self._stream.extras

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks()

    def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        await self._stream.aclose()


class Backend(Protocol):
    name: str
    models: list[str]

    async def start(self) -> None:
        """Acquire resources (connection pools, model weights). Called once before serving."""

    async def chat(self, request: ChatRequest) -> ChatResult: ...

    async def stream(self, request: ChatRequest) -> ChunkStream:
        """Start a streamed completion. Errors before the first chunk are raised here."""

    async def aclose(self) -> None: ...

    # Optional: ``count_tokens(messages, tools=None) -> int`` where the backend has a tokenizer (the local one does);
    # the agent's context budget is counted with it, else approximately.


class AdapterHost(Protocol):
    """A backend that serves LoRA adapters, loaded and unloaded at runtime.

    Adapters are known by their backend name (``name@version``), which ``ChatRequest.adapter`` carries.
    Loading a name already loaded and unloading one not loaded both succeed, so a gateway that lost
    track (a restart on either side) can always converge by repeating itself.
    """

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the adapter folder ``path`` (as the backend sees it) under ``name``; BackendError if it cannot."""

    async def unload_adapter(self, name: str) -> None: ...

    async def loaded_adapters(self) -> set[str] | None:
        """The adapter names the backend reports as loaded now; None when it cannot tell."""


def serves_adapters(backend: Backend) -> bool:
    return callable(getattr(backend, "load_adapter", None))


class CompletionsHost(Protocol):
    """A backend that serves OpenAI's legacy text completions (``apis`` lists ``completions``). The request's
    ``body`` is a ``/v1/completions`` body; the result's ``response`` a ``text_completion`` object, and a stream's
    chunks ``text_completion`` chunks (the last with ``usage``)."""

    apis: frozenset[str]  # from ``[[backends]] apis``: which of OpenAI's APIs besides chat it serves

    async def completions(self, request: ChatRequest) -> ChatResult: ...

    async def stream_completions(self, request: ChatRequest) -> ChunkStream: ...


class EmbeddingsHost(Protocol):
    """A backend that serves embeddings (``apis`` lists ``embeddings``): a ``/v1/embeddings`` body in, OpenAI's
    ``list`` of embeddings out."""

    apis: frozenset[str]

    async def embeddings(self, request: ChatRequest) -> dict[str, Any]: ...


def serves_api(backend: Backend, api: str) -> bool:
    """Whether ``backend`` serves ``api`` (``completions``, ``embeddings``) besides chat."""
    return api in getattr(backend, "apis", ())


class BackendError(Exception):
    """A backend could not produce a completion; carries the HTTP status and OpenAI error fields."""

    status_code = 502
    error_type = "backend_error"

    def __init__(self, message: str, *, status_code: int | None = None, code: str | None = None,
                 error_type: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        if error_type is not None:
            self.error_type = error_type
        self.code = code
        self.param = param
        self.backend: str | None = None  # set by a pool: the member that failed last


class BackendUnavailable(BackendError):
    status_code = 503
    error_type = "backend_unavailable"


class BackendTimeout(BackendError):
    status_code = 504
    error_type = "backend_timeout"


class BadGateway(BackendError):
    status_code = 502
    error_type = "bad_gateway"


class AdapterNotLoaded(BackendError):
    """The request named an adapter the backend does not hold (never loaded, or lost in a restart)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, adapter: str) -> None:
        super().__init__(message, code="adapter_not_loaded", param="model")
        self.adapter = adapter
