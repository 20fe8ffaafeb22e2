"""``GET /admin/usage``: requests, tokens and cost of the recorded calls, by key, tenant or model and by day
(admin key)."""

from __future__ import annotations

import time

from starlette.responses import Response

from gateway.api.common import json_response
from gateway.context import RequestContext
from gateway.errors import APIError
from replay.usage import parse_since, report

GROUPS = ("key", "tenant", "model")


async def usage(ctx: RequestContext) -> Response:
    """Query: ``group`` (key, tenant or model), ``since`` and ``until`` (a UTC date or time, or a span back such as
    ``7d``), ``by=day``, ``tenant`` (one tenant's calls only)."""
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    query = request.query_params
    group = query.get("group")
    if group is not None and group not in GROUPS:
        raise APIError(400, f"'group' must be one of {', '.join(GROUPS)}.", param="group")
    if query.get("by") not in (None, "day"):
        raise APIError(400, "'by' takes 'day'.", param="by")
    bounds = {}
    for name in ("since", "until"):
        if query.get(name):
            try:
                bounds[name] = parse_since(query[name], time.time())
            except ValueError as exc:
                raise APIError(400, f"'{name}': {exc}", param=name) from None
    rows = await report(gateway.store, group=group, by_day=query.get("by") == "day",  # type: ignore[arg-type]
                        tenant=query.get("tenant"), **bounds)
    return json_response({"object": "list", "data": rows})
