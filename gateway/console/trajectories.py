"""The trajectory pages: the filtered, searchable list (paged by keyset), one trajectory's timeline, feedback from
the page, and a group's siblings side by side. A tenant's session sees its tenant's trajectories alone: another
tenant's is as absent as one that never was."""

from __future__ import annotations

import math

from starlette.responses import RedirectResponse, Response

from gateway.api.trajectories import feedback_row
from gateway.console import timeline
from gateway.console.app import PATH, Page
from gateway.errors import APIError
from replay import approvals
from replay import feedback as feedback_log
from replay.filters import Filters, parse_time
from replay.model import Trajectory
from replay.runs import UNFINISHED
from replay.vocabulary import AGENT, BOT, DEMO, IMPORT, PENDING_APPROVAL, PROXY, ROLLOUT, TRAJECTORY_STATUSES

SOURCES = (PROXY, AGENT, BOT, ROLLOUT, "eval", DEMO, IMPORT)
TEXT_FILTERS = ("source", "status", "reason", "model", "adapter", "task", "group")
FILTER_FIELDS = (*TEXT_FILTERS, "min_reward", "max_reward", "since", "until")


def filters_of(page: Page) -> Filters:
    """The list's filters from the query string; a bad number or date is a 400 naming the field."""
    values: dict[str, object] = {name: page.query(name) for name in TEXT_FILTERS}
    for name in ("min_reward", "max_reward"):
        raw = page.query(name)
        if raw is not None:
            try:
                number = float(raw)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                raise APIError(400, f"'{name}' must be a number.", param=name)
            values[name] = number
    for name in ("since", "until"):
        raw = page.query(name)
        if raw is not None:
            try:
                values[name] = parse_time(raw)
            except ValueError:
                raise APIError(400, f"'{name}' must be a date (2026-12-05, or with a time) or unix seconds.",
                               param=name) from None
    return Filters(**values)  # type: ignore[arg-type]


async def list_page(page: Page) -> Response:
    filters, text, before = filters_of(page), page.query("q"), page.query("before")
    viewer, store = page.viewer, page.gateway.store
    size = page.gateway.settings.console.page_size
    scope = {"tenant": viewer.tenant, "all_tenants": viewer.admin, "limit": size + 1, "before": before,
             "filters": filters}
    rows = await (store.search(text, **scope) if text else store.list_trajectories(**scope))
    more = len(rows) > size
    rows = rows[:size]
    query = {name: page.query(name) for name in (*FILTER_FIELDS, "q", "before") if page.query(name) is not None}
    return page.render("trajectories.html", rows=rows, query=query, more=more,
                       next_before=rows[-1].id if more else None, sources=SOURCES,
                       statuses=sorted(TRAJECTORY_STATUSES))


async def _visible(page: Page, trajectory_id: str) -> Trajectory:
    found = await page.gateway.store.get_trajectory(trajectory_id, tenant=page.viewer.tenant,
                                                    all_tenants=page.viewer.admin)
    if found is None:
        raise APIError(404, f"No trajectory '{trajectory_id}'.", code="not_found")
    return found


async def show_page(page: Page) -> Response:
    trajectory = await _visible(page, page.request.path_params["trajectory_id"])
    store, viewer = page.gateway.store, page.viewer
    forks = await store.list_trajectories(tenant=viewer.tenant, all_tenants=viewer.admin, limit=50,
                                          filters=Filters(parent=trajectory.id))
    siblings = await _group(page, trajectory.group_id) if trajectory.group_id else []
    parent = await store.get_trajectory(trajectory.parent_id, tenant=viewer.tenant, all_tenants=viewer.admin) \
        if trajectory.parent_id else None
    # The calls it waits on, with their forms, for whoever may decide them (the trajectory is theirs to see).
    held = await approvals.list_approvals(store, trajectory_id=trajectory.id) \
        if viewer.approver and trajectory.status == PENDING_APPROVAL else []
    context = {"t": trajectory, "steps": timeline.steps(trajectory), "loose_events": timeline.loose_events(trajectory),
               "whole_feedback": timeline.whole_feedback(trajectory), "forks": forks, "siblings": siblings,
               "parent": parent, "live": trajectory.status in UNFINISHED, "held": held}
    if page.query("fragment") == "timeline":
        return page.render("timeline.html", **context)
    return page.render("trajectory.html", **context)


async def _group(page: Page, group_id: str) -> list[Trajectory]:
    viewer = page.viewer
    rows = await page.gateway.store.list_trajectories(tenant=viewer.tenant, all_tenants=viewer.admin, limit=64,
                                                      filters=Filters(group=group_id))
    return sorted(rows, key=lambda t: t.id)


async def group_page(page: Page) -> Response:
    group_id = page.request.path_params["group_id"]
    members = [await _visible(page, t.id) for t in await _group(page, group_id)]
    if not members:
        raise APIError(404, f"No group '{group_id}'.", code="not_found")
    return page.render("group.html", group_id=group_id,
                       columns=[(t, timeline.steps(t)) for t in members])


async def give_feedback(page: Page) -> Response:
    """The page's feedback form, stored exactly as ``POST /v1/trajectories/{id}/feedback`` stores it."""
    trajectory = await _visible(page, page.request.path_params["trajectory_id"])
    form = page.form
    body: dict[str, object] = {}
    if form.get("rating"):
        body["rating"] = form["rating"]
    for name in ("label", "comment"):
        if form.get(name, "").strip():
            body[name] = form[name].strip()
    for name, cast in (("score", float), ("model_call_seq", int)):
        if form.get(name, "").strip():
            try:
                body[name] = cast(form[name])
            except ValueError:
                raise APIError(400, f"'{name}' must be a number.", param=name) from None
    row = feedback_row(body)
    await feedback_log.add(page.gateway.store, trajectory.id, source="user", **row)
    return RedirectResponse(f"{PATH}/trajectories/{trajectory.id}#feedback", status_code=303)
