"""Held tool calls: the list an approver works through (each call with the turn that made it) and the approve and
deny forms. A tenant's approver sees and decides its tenant's calls alone: another tenant's is as absent as one
that never was. A decision records who made it, and the page goes on to the run, which resumes on its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.responses import RedirectResponse, Response

from gateway.api.approvals import STATUSES
from gateway.console import timeline
from gateway.console.app import PATH, Page
from gateway.errors import APIError
from replay import approvals
from replay.model import Trajectory

CONTEXT_MESSAGES = 4  # at most this many of the request's last messages, from its last user message on
REASON_CHARS = 2000  # as the admin API allows


@dataclass
class Held:
    """One approval as the list shows it: its row (tool, arguments, profile, times, decision) and the messages
    that led to the call."""

    row: dict[str, Any]
    context: list[timeline.Message]


def context(trajectory: Trajectory | None, step: int) -> list[timeline.Message]:
    """What an approver needs to judge the call: the last user message before it (and what came after it, the last
    few) and the assistant turn that made the call."""
    call = next((c for c in trajectory.calls if c.seq == step), None) if trajectory is not None else None
    if call is None:
        return []
    sent = [m for m in call.messages if not (isinstance(m, dict) and m.get("role") == "system")]
    last_user = max((i for i, m in enumerate(sent) if isinstance(m, dict) and m.get("role") == "user"), default=0)
    shown = sent[last_user:][-CONTEXT_MESSAGES:]
    replies = [c.get("message") for c in (call.response or {}).get("choices") or [] if isinstance(c, dict)]
    return [timeline.message(m) for m in [*shown, *replies]]


async def list_page(page: Page) -> Response:
    status = page.query("status") or approvals.PENDING
    if status not in (*STATUSES, "all"):
        raise APIError(400, f"'status' must be one of {', '.join(STATUSES)} or all.", param="status")
    viewer, store = page.viewer, page.gateway.store
    rows = await approvals.list_approvals(store, status=None if status == "all" else status, tenant=viewer.tenant,
                                          all_tenants=viewer.admin)
    if status != approvals.PENDING:
        rows.reverse()  # pending calls are a queue, oldest first; decided ones are history, newest first
    total, rows = len(rows), rows[:page.gateway.settings.console.page_size]
    runs: dict[str, Trajectory | None] = {}
    for row in rows:
        if row["trajectory_id"] not in runs:
            runs[row["trajectory_id"]] = await store.get_trajectory(row["trajectory_id"], tenant=viewer.tenant,
                                                                    all_tenants=viewer.admin)
    held = [Held(row, context(runs[row["trajectory_id"]], row["step"])) for row in rows]
    return page.render("approvals.html", held=held, total=total, showing=status, statuses=(*STATUSES, "all"))


async def decide(page: Page) -> Response:
    """``POST /ui/approvals/{id}/approve|deny``: decided as the admin API decides, by whoever is signed in."""
    approval_id, action = page.request.path_params["approval_id"], page.request.path_params["action"]
    if action not in ("approve", "deny"):
        raise APIError(404, f"Unknown approval action '{action}'; expected approve or deny.", code="not_found")
    row = await approvals.get_approval(page.gateway.store, approval_id)
    if row is None or (not page.viewer.admin and row["tenant"] != page.viewer.tenant):
        raise APIError(404, f"No approval '{approval_id}'.", code="not_found")
    reason = page.form.get("reason", "").strip() or None
    if reason is not None and len(reason) > REASON_CHARS:
        raise APIError(400, f"The reason may have at most {REASON_CHARS} characters.", param="reason")
    await page.gateway.agents.decide(approval_id, approve=action == "approve", reason=reason, by=page.viewer.label)
    return RedirectResponse(f"{PATH}/trajectories/{row['trajectory_id']}", status_code=303)
