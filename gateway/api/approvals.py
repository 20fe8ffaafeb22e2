"""``/admin/approvals``: tool calls held for a person's approval, and the decisions on them (admin key)."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.api.common import json_response, parse_json, read_body
from gateway.context import RequestContext
from gateway.errors import APIError
from replay import approvals

STATUSES = ("pending", "approved", "denied", "expired")
_DECISION_LIMIT = 16 * 1024


async def list_approvals(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    status = request.query_params.get("status", "pending")
    if status not in (*STATUSES, "all"):
        raise APIError(400, f"'status' must be one of {', '.join(STATUSES)} or all.", param="status")
    rows = await approvals.list_approvals(gateway.store, status=None if status == "all" else status,
                                          trajectory_id=request.query_params.get("trajectory_id"))
    return json_response({"object": "list", "data": rows})


async def show(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    row = await approvals.get_approval(gateway.store, request.path_params["approval_id"])
    if row is None:
        raise APIError(404, f"No approval '{request.path_params['approval_id']}'.", code="not_found")
    return json_response(row)


async def decide(ctx: RequestContext) -> Response:
    """``POST /admin/approvals/{id}/approve|deny`` with an optional ``{"reason", "by"}``."""
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    action = request.path_params["action"]
    if action not in ("approve", "deny"):
        raise APIError(404, f"Unknown approval action '{action}'; expected approve or deny.", code="not_found")
    raw = await read_body(request, _DECISION_LIMIT)
    body: Any = parse_json(raw) if raw.strip() else {}
    if not isinstance(body, dict) or set(body) - {"reason", "by"}:
        raise APIError(400, "The body may hold only 'reason' and 'by'.")
    for name in ("reason", "by"):
        if body.get(name) is not None and (not isinstance(body[name], str) or len(body[name]) > 2000):
            raise APIError(400, f"'{name}' must be a string of at most 2000 characters.", param=name)
    row = await gateway.agents.decide(request.path_params["approval_id"], approve=action == "approve",
                                      reason=body.get("reason"), by=body.get("by") or "admin")
    return json_response(row)
