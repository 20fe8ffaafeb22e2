"""OpenAI's legacy text completions (``POST /v1/completions``): the request's checks, a stream's assembly into the
completion it describes, and chat replies written as text completions (for a backend that generates chat-shaped
output from a raw prompt).

Pure functions over dicts; the API layer does the I/O.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, WithJsonSchema

from gateway.errors import APIError
from gateway.protocol.chat import Unit, _StreamOptions  # one model of stream_options for both APIs
from gateway.protocol.strict import Fault, Strict, validate

_STRING = {"type": "string"}
_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
# A prompt (or an embedding's input): text, texts, token ids, or lists of token ids; never empty.
TEXTS_SCHEMA = {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _STRING}, _TOKENS,
                          {"type": "array", "minItems": 1, "items": _TOKENS}]}


def _texts(value: Any) -> Any:
    """A prompt or input as OpenAI takes it: a string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise Fault("expected a string or an array of strings or token ids.", code="invalid_type")
    if not value:
        raise Fault("Invalid value: an empty array. Expected at least one string or token.")
    if _is_int(value[0]):  # token ids
        _check_tokens(value)
        return value
    texts = isinstance(value[0], str)
    for i, item in enumerate(value):
        if texts and isinstance(item, str):
            continue
        if texts or not isinstance(item, list) or not item:
            raise Fault("expected a string, a token id or a non-empty array of token ids, of one kind in one array.",
                        (i,), code="invalid_type")
        _check_tokens(item, (i,))
    return value


def _check_tokens(ids: list[Any], at: tuple[int, ...] = ()) -> None:
    for i, v in enumerate(ids):
        if not _token(v):
            raise Fault("expected a token id (a non-negative integer).", (*at, i), code="invalid_type")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token(value: Any) -> bool:
    return _is_int(value) and value >= 0


Texts = Annotated[Any, AfterValidator(_texts), WithJsonSchema(TEXTS_SCHEMA)]


def prompts(value: str | list[Any]) -> list[str | list[int]]:
    """A checked prompt (or input) as its separate prompts: one string or token list each."""
    if isinstance(value, str) or all(isinstance(v, int) for v in value):
        return [value]
    return list(value)


class CompletionRequest(Strict):
    """A ``POST /v1/completions`` body: what OpenAI checks, checked as strictly; other fields pass to the backend."""

    model: str = ""  # none: routing applies the key's, tenant's or configured default
    prompt: Texts
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=20)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    stop: Annotated[str | list[str] | None, Field(max_length=4), WithJsonSchema({"anyOf": [
        _STRING, {"type": "array", "maxItems": 4, "items": _STRING}, {"type": "null"}]})] = None
    presence_penalty: Unit | None = None
    frequency_penalty: Unit | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None


def validate_completion_request(body: Any) -> CompletionRequest:
    """Check a decoded body against the completions contract; raise a 400 that names the field."""
    parsed: CompletionRequest = validate(CompletionRequest, body)
    if parsed.best_of is not None and parsed.best_of < parsed.n:
        raise APIError(400, f"Invalid value for 'best_of': {parsed.best_of} is less than n ({parsed.n}); best_of "
                            "must be at least n.", param="best_of", code="invalid_value")
    return parsed


# -- streams ---------------------------------------------------------------------------------------------------

def holds(chunk: dict[str, Any]) -> bool:
    """Whether a chunk waits for the call's record to be committed: one that finishes a choice, or carries usage.
    Every other chunk goes out as it comes."""
    return bool(chunk.get("usage")) or any(c.get("finish_reason") for c in chunk.get("choices") or ())


def without_usage(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """A chunk as a client that did not ask for usage gets it (the gateway always asks upstream, to record it);
    None when usage was all it held."""
    if "usage" not in chunk:
        return chunk
    rest = {k: v for k, v in chunk.items() if k != "usage"}
    return rest if rest.get("choices") else None


class CompletionAccumulator:
    """Folds a stream of ``text_completion`` chunks into the ``text_completion`` it describes."""

    def __init__(self) -> None:
        self.header: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self._choices: dict[int, dict[str, Any]] = {}
        self.chunks = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        for key in ("id", "created", "model", "system_fingerprint"):
            if chunk.get(key) is not None:
                self.header.setdefault(key, chunk[key])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for part in chunk.get("choices") or ():
            index = part.get("index", 0)
            choice = self._choices.setdefault(index, {"index": index, "text": "", "logprobs": None,
                                                      "finish_reason": None})
            choice["text"] += part.get("text") or ""
            if part.get("finish_reason"):
                choice["finish_reason"] = part["finish_reason"]
            if isinstance(part.get("logprobs"), dict):
                choice["logprobs"] = _joined(choice["logprobs"], part["logprobs"])

    def completion(self) -> dict[str, Any]:
        out = {**self.header, "object": "text_completion",
               "choices": [self._choices[i] for i in sorted(self._choices)]}
        if self.usage is not None:
            out["usage"] = self.usage
        return out


def _joined(whole: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Completions' log-probabilities come as parallel lists (tokens, token_logprobs, top_logprobs, text_offset):
    a stream's parts are their continuations."""
    if whole is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in part.items()}
    for key, value in part.items():
        if isinstance(value, list):
            whole.setdefault(key, []).extend(value)
    return whole


# -- chat-shaped output written as text completions ----------------------------------------------------------------

def _completion_id(chat_id: Any) -> str:
    return "cmpl-" + str(chat_id or "").removeprefix("chatcmpl-")


def text_completion(chat: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` (generated from a raw prompt, no chat template) as the ``text_completion`` it is."""
    choices = [{"index": c.get("index", i), "text": (c.get("message") or {}).get("content") or "",
                "logprobs": None, "finish_reason": c.get("finish_reason")}
               for i, c in enumerate(chat.get("choices") or ())]
    out = {"id": _completion_id(chat.get("id")), "object": "text_completion", "created": chat.get("created"),
           "model": chat.get("model"), "choices": choices}
    if chat.get("usage") is not None:
        out["usage"] = chat["usage"]
    return out


def text_completion_chunk(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """A ``chat.completion.chunk`` as a text completion's chunk; None for one that carries nothing a text completion
    has (a choice's opening role)."""
    choices = [{"index": c.get("index", 0), "text": (c.get("delta") or {}).get("content") or "", "logprobs": None,
                "finish_reason": c.get("finish_reason")}
               for c in chunk.get("choices") or ()
               if (c.get("delta") or {}).get("content") or c.get("finish_reason")]
    if not choices and not chunk.get("usage"):
        return None
    out = {"id": _completion_id(chunk.get("id")), "object": "text_completion", "created": chunk.get("created"),
           "model": chunk.get("model"), "choices": choices}
    if chunk.get("usage"):
        out["usage"] = chunk["usage"]
    return out
