"""What the tests of the APIs besides chat (completions, embeddings) share: a backend that serves chat alone, the
client, and a call read back from the store as it is kept."""

from __future__ import annotations

import sqlite3
from typing import Any

import openai
import orjson

from tests.processes import GatewayProcess

MODEL = "stand-in-model"
CHAT_ONLY = "chat-only-model"


def chat_only_backend(url: str) -> str:
    """A second backend on the same upstream that serves chat alone."""
    return f"""
[[backends]]
name = "chat-only"
kind = "openai"
base_url = "{url}/v1"
models = ["{CHAT_ONLY}"]
apis = []
"""


def client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def rows(gw: GatewayProcess, sql: str, args: tuple = ()) -> list[tuple]:
    db = sqlite3.connect(gw.db)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def stored_call(gw: GatewayProcess, trajectory_id: str) -> dict[str, Any]:
    """The trajectory's one call as the store holds it, with its native request and response decoded."""
    [(api, bodies, messages, replies, prompt, completion, backend, model, stream, status, latency)] = rows(
        gw, "SELECT native_api, native_bodies, request_messages, response_messages, prompt_tokens, "
            "completion_tokens, backend, model, stream, status, latency_ms FROM model_calls WHERE trajectory_id = ?",
        (trajectory_id,))
    native = [orjson.loads(rows(gw, "SELECT body FROM blobs WHERE hash = ?", (key,))[0][0])
              for key in orjson.loads(bodies)]
    return {"api": api, "request": native[0], "response": native[1] if len(native) > 1 else None,
            "messages": orjson.loads(messages), "replies": orjson.loads(replies), "prompt_tokens": prompt,
            "completion_tokens": completion, "backend": backend, "model": model, "stream": bool(stream),
            "status": status, "latency_ms": latency}


