"""``/admin/adapters``: the adapter registry and lifecycle over HTTP (admin key only).

Register with JSON ``{"name", "base", "path", "metrics"?}`` (a folder the backends can read), or upload the
folder as a tar archive (``Content-Type: application/x-tar`` or ``application/gzip``) with ``?name=N&base=B``
(and optionally ``&metrics=<JSON object>``).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.common import json_response, parse_json, read_body, read_json_body
from gateway.context import RequestContext
from gateway.errors import APIError
from replay.adapters import AdapterVersion, RegistryError

ARCHIVE_TYPES = ("application/x-tar", "application/gzip", "application/x-gzip", "application/octet-stream")
_JSON_LIMIT = 1 << 20


def _api_error(exc: RegistryError) -> APIError:
    return APIError(exc.status, exc.message, code=exc.code,
                    error_type="server_error" if exc.status >= 500 else "invalid_request_error")


async def _options(request: Request) -> dict[str, Any]:
    """An optional JSON object body (``{"version": 3}``); an empty body is no options."""
    raw = await read_body(request, _JSON_LIMIT)
    body = parse_json(raw) if raw.strip() else {}
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _version(options: dict[str, Any], *, required: bool) -> int | None:
    version = options.get("version")
    if version is None and required:
        raise APIError(400, "give the version: {\"version\": N}", param="version", code="missing_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise APIError(400, "version must be a positive integer", param="version")
    return version


def _card(version: AdapterVersion, **extra: Any) -> dict[str, Any]:
    return {"object": "adapter", **version.as_dict(), **extra}


async def list_adapters(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    try:
        versions = await gateway.adapters.list()
    except RegistryError as exc:
        raise _api_error(exc) from None
    return json_response({"object": "list", "data": [_card(v) for v in versions],
                          "loaded": gateway.adapter_manager.loaded()})


async def register(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    service = gateway.adapters
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if content_type in ARCHIVE_TYPES:
            query = request.query_params
            if not query.get("name") or not query.get("base"):
                raise APIError(400, "an uploaded archive needs ?name=N&base=B", param="name", code="missing_name")
            metrics = parse_json(query["metrics"].encode()) if query.get("metrics") else None
            if metrics is not None and not isinstance(metrics, dict):
                raise APIError(400, "'metrics' must be a JSON object", param="metrics")
            data = await read_body(request, service.max_upload_bytes)
            version = await service.register(query["name"], query["base"], upload=data, metrics=metrics)
        else:
            body = await read_json_body(request, _JSON_LIMIT)
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object", code="invalid_json")
            for field in ("name", "base", "path"):
                if not isinstance(body.get(field), str) or not body[field]:
                    raise APIError(400, f"'{field}' is required and must be a string", param=field)
            metrics = body.get("metrics")
            if metrics is not None and not isinstance(metrics, dict):
                raise APIError(400, "'metrics' must be an object", param="metrics")
            version = await service.register(body["name"], body["base"], path=body["path"], metrics=metrics,
                                             parent_version=_version({"version": body.get("parent_version")},
                                                                     required=False))
    except RegistryError as exc:
        raise _api_error(exc) from None
    return json_response(_card(version), status=201)


async def lifecycle(ctx: RequestContext) -> Response:
    """``POST /admin/adapters/{name}/{action}`` for publish, promote, rollback and retire."""
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    service = gateway.adapters
    name, action = request.path_params["name"], request.path_params["action"]
    options = await _options(request)
    try:
        if action == "publish":
            version, results = await service.publish(name, _version(options, required=False))
            body = _card(version, loaded=[r.as_dict() for r in results])
        elif action == "promote":
            version, replaced = await service.promote(name, _version(options, required=True))  # type: ignore[arg-type]
            body = _card(version, replaced=replaced.version if replaced else None)
        elif action == "rollback":
            restored, demoted = await service.rollback(name)
            body = _card(restored, replaced=demoted.version)
        elif action == "retire":
            body = _card(await service.retire(name, _version(options, required=True)))  # type: ignore[arg-type]
        else:
            raise APIError(404, f"Unknown adapter action {action!r}; use publish, promote, rollback or retire.",
                           code="not_found")
    except RegistryError as exc:
        raise _api_error(exc) from None
    return json_response(body)
