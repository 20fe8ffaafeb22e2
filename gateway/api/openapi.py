"""``GET /openapi.json``: the gateway's routes and the bodies they take, as OpenAPI 3.1.

The request bodies of chat completions, responses and agent runs are the JSON Schemas of the very models that
check them (``gateway/protocol``), so the document cannot drift from what is accepted; the smaller bodies are
described here beside their routes. Every error is OpenAI's envelope. Accurate enough to generate requests from.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.agent.service import LIMIT_KEYS
from gateway.bot.signing import NONCE, SIGNATURE, TIMESTAMP
from gateway.context import RequestContext
from gateway.protocol.agent_runs import AgentRunRequest
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completions import CompletionRequest
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.protocol.responses.validation import ResponsesRequest

_STRING = {"type": "string"}
_ID = {"type": "string", "minLength": 1, "maxLength": 256}
_OBJECT = {"type": "object"}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": _STRING, "type": _STRING, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}

_FEEDBACK = {"type": "object", "additionalProperties": False, "properties": {
    "rating": {"enum": ["up", "down"]}, "score": {"type": "number", "minimum": 0, "maximum": 1},
    "label": {"type": "string", "minLength": 1, "maxLength": 4000},
    "comment": {"type": "string", "minLength": 1, "maxLength": 4000},
    "model_call_seq": {"type": "integer", "minimum": 0}}}
_ADAPTER = {"type": "object", "required": ["name", "base", "path"], "properties": {
    "name": _ID, "base": _ID, "path": _ID, "metrics": _OBJECT, "parent_version": {"type": "integer", "minimum": 1}}}
_VERSION = {"type": "object", "properties": {"version": {"type": "integer", "minimum": 1}}}
_DECISION = {"type": "object", "additionalProperties": False, "properties": {
    "reason": {"type": "string", "maxLength": 2000}, "by": {"type": "string", "maxLength": 2000}}}
# The Messages API's body as this gateway checks it; other fields and block types pass (to an Anthropic upstream).
_MESSAGE_BLOCKS = {"anyOf": [_STRING, {"type": "array", "items": {"type": "object", "required": ["type"],
                                                                   "properties": {"type": _STRING}}}]}
_MESSAGES = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
    "model": {"type": "string", "minLength": 1}, "max_tokens": {"type": "integer", "minimum": 1},
    "system": _MESSAGE_BLOCKS, "stream": {"type": "boolean"}, "metadata": _OBJECT,
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                          "properties": {"role": {"enum": ["user", "assistant",
                                                                                           "system"]},
                                                                         "content": _MESSAGE_BLOCKS}}},
    "tools": {"type": "array", "items": _OBJECT}, "tool_choice": _OBJECT,
    "stop_sequences": {"type": "array", "items": _STRING},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "top_k": {"type": "integer", "minimum": 0}}}
_COUNT = {**_MESSAGES, "required": ["model", "messages"]}
_BOT_MESSAGE = {"type": "object", "required": ["conversation_id", "user_id", "text"], "additionalProperties": False,
                "properties": {"conversation_id": _ID, "user_id": _ID, "text": {"type": "string", "minLength": 1},
                               "callback_url": {"type": "string", "format": "uri"}}}
_BOT_REACTION = {"type": "object", "required": ["message_id"], "properties": {
    "message_id": _ID, **_FEEDBACK["properties"]}}  # type: ignore[dict-item]


def _query(name: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema}


_LIST = [_query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}), _query("before", _STRING)]
_SIGNED = [{"name": header, "in": "header", "required": True, "schema": _STRING}
           for header in (TIMESTAMP, NONCE, SIGNATURE)]

# route name -> (summary, request body schema or a component's name, success status, extra parameters)
_OPERATIONS: dict[str, tuple[str, Any, int, list[dict[str, Any]]]] = {
    "chat": ("Create a chat completion (plain, streamed, or an agent run with model agent:<profile>)",
             "ChatCompletionRequest", 200, []),
    "completions": ("Create a text completion (OpenAI's legacy completions: a raw prompt, plain or streamed)",
                    "CompletionRequest", 200, []),
    "embeddings": ("Create embeddings", "EmbeddingRequest", 200, []),
    "responses": ("Create a response (the Responses API)", "ResponsesRequest", 200, []),
    "responses_compact": ("Compact a conversation (the Responses API: its user messages and one compaction item)",
                          "ResponsesRequest", 200, []),
    "response": ("Fetch a stored response", None, 200, []),
    "messages": ("Create a message (the Anthropic Messages API; errors in Anthropic's shape)", _MESSAGES, 200, []),
    "messages_count_tokens": ("Count a message's input tokens (the Anthropic Messages API)", _COUNT, 200, []),
    "agent_runs": ("Start a server-side agent run", "AgentRunRequest", 201, []),
    "agent_run": ("Fetch an agent run", None, 200, []),
    "models": ("List the models", None, 200, []),
    "model": ("Fetch a model", None, 200, []),
    "trajectories": ("List the caller's trajectories", None, 200, _LIST),
    "trajectory": ("Fetch one of the caller's trajectories", None, 200, []),
    "trajectory_feedback": ("Rate a trajectory or one of its steps", _FEEDBACK, 201, []),
    "admin_adapters": ("List the adapter versions (admin)", None, 200, []),
    "admin_adapters_register": ("Register an adapter version (admin)", _ADAPTER, 201, []),
    "admin_adapter_action": ("Publish, promote, roll back or retire an adapter (admin)", _VERSION, 200, []),
    "admin_trajectories": ("List every tenant's trajectories (admin)", None, 200, _LIST),
    "admin_trajectory": ("Fetch any trajectory (admin)", None, 200, []),
    "admin_approvals": ("List approvals of write actions (admin)", None, 200, [
        _query("status", {"enum": ["pending", "approved", "denied", "expired", "all"]}),
        _query("trajectory_id", _STRING)]),
    "admin_approval": ("Fetch an approval (admin)", None, 200, []),
    "admin_usage": ("Requests, tokens and cost of the recorded calls (admin)", None, 200, [
        _query("group", {"enum": ["key", "tenant", "model"]}), _query("since", _STRING), _query("until", _STRING),
        _query("by", {"enum": ["day"]}), _query("tenant", _STRING)]),
    "admin_approval_decide": ("Approve or deny a write action (admin)", _DECISION, 200, []),
    "bot_messages": ("Post a chat message to the bot (signed)", _BOT_MESSAGE, 200, _SIGNED),
    "bot_message": ("Poll a bot message (signed)", None, 200, _SIGNED),
    "bot_reactions": ("React to a bot reply (signed)", _BOT_REACTION, 200, _SIGNED),
    "wecom_verify": ("WeCom's callback URL check", None, 200, [
        _query(name, _STRING, required=True) for name in ("msg_signature", "timestamp", "nonce", "echostr")]),
    "wecom_callback": ("WeCom's message callback (encrypted XML)", None, 200, [
        _query(name, _STRING, required=True) for name in ("msg_signature", "timestamp", "nonce")]),
    "openapi": ("This document", None, 200, []),
    "healthz": ("Liveness", None, 200, []),
    "metrics": ("Prometheus metrics", None, 200, []),
}
_PATH_ENUMS = {("admin_adapter_action", "action"): ["publish", "promote", "rollback", "retire"],
               ("admin_approval_decide", "action"): ["approve", "deny"]}
_STREAMS = {"chat", "completions", "responses", "messages"}
_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, ResponsesRequest, AgentRunRequest, CompletionRequest,
                                        EmbeddingRequest)


def _components() -> dict[str, Any]:
    refs, top = models_json_schema([(m, "validation") for m in _MODELS], ref_template="#/components/schemas/{model}")
    schemas = dict(top.get("$defs", {}))
    limits = schemas["AgentRunRequest"]["properties"]["limits"]
    limits["anyOf"][0].update(properties={k: {"type": "number", "minimum": 0} for k in LIMIT_KEYS},
                              additionalProperties=False)
    schemas["Error"] = _ERROR
    return schemas


def _operation(route: Route, method: str) -> dict[str, Any]:
    summary, body, status, extra = _OPERATIONS[route.name]
    params = [{"name": name, "in": "path", "required": True,
               "schema": {"enum": _PATH_ENUMS[(route.name, name)]} if (route.name, name) in _PATH_ENUMS
               else {"type": "string", "minLength": 1}}
              for name in route.param_convertors]
    content: dict[str, Any] = {"application/json": {"schema": {}}}
    if route.name in _STREAMS:
        content["text/event-stream"] = {"schema": _STRING}
    error = {"description": "An error in OpenAI's envelope",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op: dict[str, Any] = {"operationId": route.name, "summary": summary, "parameters": params + extra,
                          "responses": {str(status): {"description": "Success", "content": content},
                                        "4XX": error, "5XX": error}}
    if body is not None:
        schema = {"$ref": f"#/components/schemas/{body}"} if isinstance(body, str) else body
        op["requestBody"] = {"required": route.name not in ("admin_adapter_action", "admin_approval_decide"),
                             "content": {"application/json": {"schema": schema}}}
    if route.name in ("openapi", "healthz", "wecom_verify"):
        op["security"] = []
    return op


def document(routes: list[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (the app's, ``/openapi.json`` itself among them)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or route.name not in _OPERATIONS:
            continue
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(route, method)
    return {"openapi": "3.1.0",
            "info": {"title": "agent-harness gateway", "version": version("agent-harness")},
            "paths": paths,
            "components": {"schemas": _components(), "securitySchemes": {"bearer": {"type": "http",
                                                                                    "scheme": "bearer"}}},
            # a loopback gateway without keys is open: a key is optional there
            "security": [{"bearer": []}, {}]}


async def openapi_json(ctx: RequestContext) -> Response:
    state = ctx.request.app.state
    if getattr(state, "openapi", None) is None:  # the routes are fixed once the app is built
        state.openapi = orjson.dumps(document(ctx.request.app.routes))
    return Response(state.openapi, media_type="application/json")
