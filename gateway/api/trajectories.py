"""Reading captured trajectories: a key sees its own tenant's; the admin key sees all."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.common import json_response
from gateway.errors import APIError


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "50")
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise APIError(400, "'limit' must be an integer from 1 to 1000.", param="limit")
    return int(raw)


async def list_own(request: Request) -> Response:
    gateway = request.app.state.gateway
    principal = await gateway.auth.authenticate(request.headers)
    rows = await gateway.store.list_trajectories(
        tenant=principal.tenant, all_tenants=principal.admin, limit=_limit(request),
        before=request.query_params.get("before"))
    return json_response({"object": "list", "data": rows})


async def show_own(request: Request) -> Response:
    gateway = request.app.state.gateway
    principal = await gateway.auth.authenticate(request.headers)
    return await _show(request, tenant=principal.tenant, all_tenants=principal.admin)


async def list_all(request: Request) -> Response:
    gateway = request.app.state.gateway
    await gateway.auth.require_admin(request.headers)
    rows = await gateway.store.list_trajectories(all_tenants=True, limit=_limit(request),
                                                 before=request.query_params.get("before"))
    return json_response({"object": "list", "data": rows})


async def show_any(request: Request) -> Response:
    gateway = request.app.state.gateway
    await gateway.auth.require_admin(request.headers)
    return await _show(request, tenant=None, all_tenants=True)


async def _show(request: Request, *, tenant: str | None, all_tenants: bool) -> Response:
    tid = request.path_params["trajectory_id"]
    found = await request.app.state.gateway.store.get_trajectory(tid, tenant=tenant, all_tenants=all_tenants)
    if found is None:
        raise APIError(404, f"No trajectory '{tid}'.", code="not_found")
    return json_response(found)
