"""Captured trajectories: a key reads its own tenant's (the admin key all of them) and gives them feedback."""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.common import json_response, read_json_body
from gateway.context import RequestContext
from gateway.errors import APIError
from replay import feedback as feedback_log

FEEDBACK_FIELDS = {"rating", "score", "label", "comment", "model_call_seq"}
FEEDBACK_LIMIT = 64 * 1024


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "50")
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise APIError(400, "'limit' must be an integer from 1 to 1000.", param="limit")
    return int(raw)


async def list_own(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    rows = await gateway.store.list_trajectories(
        tenant=principal.tenant, all_tenants=principal.admin, limit=_limit(request),
        before=request.query_params.get("before"))
    return json_response({"object": "list", "data": [t.summary() for t in rows]})


async def show_own(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    return await _show(ctx, tenant=principal.tenant, all_tenants=principal.admin)


async def list_all(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    rows = await gateway.store.list_trajectories(all_tenants=True, limit=_limit(request),
                                                 before=request.query_params.get("before"))
    return json_response({"object": "list", "data": [t.summary() for t in rows]})


async def show_any(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.require_admin(request.headers)
    return await _show(ctx, tenant=None, all_tenants=True)


async def _show(ctx: RequestContext, *, tenant: str | None, all_tenants: bool) -> Response:
    tid = ctx.request.path_params["trajectory_id"]
    found = await ctx.gateway.store.get_trajectory(tid, tenant=tenant, all_tenants=all_tenants)
    if found is None:
        raise APIError(404, f"No trajectory '{tid}'.", code="not_found")
    return json_response(found.to_dict())


async def feedback(ctx: RequestContext) -> Response:
    """``POST /v1/trajectories/{id}/feedback``: a thumbs up or down (``rating``), or a ``score`` in [0, 1], with an
    optional ``label`` and ``comment``, for the whole trajectory or one step (``model_call_seq``). Stored as a
    feedback row of source ``user``: the reward engine's ``task_success`` where no verifier has spoken."""
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    body = await read_json_body(request, FEEDBACK_LIMIT)
    row = feedback_row(body)
    tid = request.path_params["trajectory_id"]
    # Another tenant's trajectory is as absent as one that never was.
    if await gateway.store.get_trajectory(tid, tenant=principal.tenant, all_tenants=principal.admin) is None:
        raise APIError(404, f"No trajectory '{tid}'.", code="not_found")
    await feedback_log.add(gateway.store, tid, source="user", **row)
    return json_response({"object": "trajectory.feedback", "trajectory_id": tid, "source": "user", **row}, 201)


def feedback_row(body: Any) -> dict[str, Any]:
    """The feedback row a request body asks for (name, value, label, comment, model_call_seq), or a 400."""
    if not isinstance(body, dict):
        raise APIError(400, "Feedback must be a JSON object.")
    unknown = sorted(set(body) - FEEDBACK_FIELDS)
    if unknown:
        raise APIError(400, f"Unknown feedback field '{unknown[0]}'; expected some of "
                            f"{', '.join(sorted(FEEDBACK_FIELDS))}.", param=unknown[0])
    rating, score = body.get("rating"), body.get("score")
    if rating is not None and score is not None:
        raise APIError(400, "Give a 'rating' or a 'score', not both.", param="score")
    row: dict[str, Any] = {"name": "label", "value": None, "label": None, "comment": None, "model_call_seq": None}
    if rating is not None:
        if rating not in ("up", "down"):
            raise APIError(400, "'rating' must be \"up\" or \"down\".", param="rating")
        row.update(name="thumbs", value=1.0 if rating == "up" else 0.0, label=rating)
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                or not 0 <= score <= 1:
            raise APIError(400, "'score' must be a number from 0 to 1.", param="score")
        row.update(name="score", value=float(score))
    for name in ("label", "comment"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > 4000):
            raise APIError(400, f"'{name}' must be a non-empty string of at most 4000 characters.", param=name)
    if body.get("label") is not None:
        row["label"] = body["label"]
    row["comment"] = body.get("comment")
    if row["name"] == "label" and row["label"] is None:
        row["name"] = "comment"
    seq = body.get("model_call_seq")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 0):
        raise APIError(400, "'model_call_seq' must be a non-negative integer (a step of the trajectory).",
                       param="model_call_seq")
    row["model_call_seq"] = seq
    if row["name"] == "comment" and row["comment"] is None:
        raise APIError(400, "Feedback needs a 'rating', a 'score', a 'label' or a 'comment'.")
    return row
