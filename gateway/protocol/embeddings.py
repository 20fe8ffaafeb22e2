"""OpenAI's embeddings (``POST /v1/embeddings``): the request's checks, and what of an answer is kept.

Pure functions over dicts; the API layer does the I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.protocol.completions import Texts
from gateway.protocol.strict import Strict, validate


class EmbeddingRequest(Strict):
    """A ``POST /v1/embeddings`` body: what OpenAI checks, checked as strictly; other fields pass to the backend."""

    model: str = ""  # none: routing applies the key's, tenant's or configured default
    input: Texts
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def validate_embedding_request(body: Any) -> EmbeddingRequest:
    """Check a decoded body against the embeddings contract; raise a 400 that names the field."""
    parsed: EmbeddingRequest = validate(EmbeddingRequest, body)
    return parsed


def without_vectors(answer: dict[str, Any]) -> dict[str, Any]:
    """An embeddings answer as the store keeps it: each item's index and dimensions, never the vector (a store of
    every vector served would grow by kilobytes a text and teach nothing a trajectory needs)."""
    data = answer.get("data")
    if not isinstance(data, list):
        return answer
    return {**answer, "data": [_described(item) for item in data]}


def _described(item: Any) -> Any:
    if not isinstance(item, dict):
        return item
    kept = {k: v for k, v in item.items() if k != "embedding"}
    vector = item.get("embedding")
    if isinstance(vector, list):
        kept["dimensions"] = len(vector)
    elif isinstance(vector, str):  # base64 of little-endian float32s
        kept["dimensions"] = len(vector.rstrip("=")) * 3 // 4 // 4
    return kept
