"""Every console route, mounted at ``/ui``: the pages with the access each needs, sign-in, and the static files."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.console import adapters, approvals, live, signin, training, trajectories
from gateway.console.app import Console
from gateway.console.auth import PATH


async def _home(request: Request) -> Response:
    return RedirectResponse(f"{PATH}/trajectories", status_code=303)


def console_routes(console: Console) -> list[BaseRoute]:
    page = console.route
    return [
        Route(PATH, _home, methods=["GET"]),
        Mount(PATH, routes=[
            Route("/", _home, methods=["GET"]),
            *signin.routes(console),
            page("/trajectories", trajectories.list_page),
            page("/trajectories/{trajectory_id}", trajectories.show_page),
            page("/trajectories/{trajectory_id}/feedback", trajectories.give_feedback, methods=("POST",)),
            page("/trajectories/{trajectory_id}/live", live.follow),
            page("/groups/{group_id:path}", trajectories.group_page),
            page("/approvals", approvals.list_page, access="approver"),
            page("/approvals/{approval_id}/{action}", approvals.decide, methods=("POST",), access="approver"),
            page("/adapters", adapters.list_page, access="admin"),
            page("/adapters/{name}/{action}", adapters.act, methods=("POST",), access="admin"),
            page("/training", training.list_page, access="admin"),
            page("/training/{run_id}", training.show_page, access="admin"),
            Mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="console_static"),
        ]),
    ]
