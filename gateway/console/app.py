"""The console's routes under ``/ui``: each page is a handler taking a ``Page`` (the request, who is looking, and
the console), wrapped once with the checks every page shares (see ``ConsoleAuth``) and the response headers that
keep untrusted trajectory content inert (a Content-Security-Policy allowing only the console's own script).

Pages are Jinja2 templates with autoescaping on; the console's only script is ``static/console.js``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, quote, urlencode

import orjson
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway.api.common import read_body
from gateway.console.auth import PATH, ConsoleAuth, Viewer, check_csrf, check_origin, loopback_host
from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.app import Gateway

FORM_LIMIT = 64 * 1024
SECURITY_HEADERS = {
    # Trajectory content is untrusted: even markup that escaped escaping could run no script, load nothing
    # from elsewhere, and the console cannot be framed.
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
Access = Literal["viewer", "approver", "admin"]


@dataclass
class Page:
    """One request to a console page."""

    console: Console
    request: Request
    viewer: Viewer
    form: dict[str, str]  # a POST's fields (its CSRF token checked); empty on GET

    @property
    def gateway(self) -> Gateway:
        return self.console.gateway

    def render(self, template: str, *, status: int = 200, **context: Any) -> HTMLResponse:
        return self.console.render(self.request, template, viewer=self.viewer, status=status, **context)

    def query(self, name: str) -> str | None:
        """A query parameter, None when absent or blank."""
        value = self.request.query_params.get(name)
        return value if value is not None and value.strip() else None


PageHandler = Callable[[Page], Awaitable[Response]]


def _when(value: float | None) -> str:
    if value is None:
        return ""
    return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _pretty_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2, default=str).decode()


class Console:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.auth = ConsoleAuth(gateway.store, gateway.auth, gateway.settings.console)
        self.live_streams = 0  # pages following a run now (gateway/console/live.py)
        self.templates = Environment(loader=PackageLoader("gateway.console", "templates"),
                                     autoescape=select_autoescape(default=True, default_for_string=True),
                                     trim_blocks=True, lstrip_blocks=True)
        self.templates.filters.update(when=_when, pretty_json=_pretty_json, urlquote=lambda v: quote(str(v), safe=""))
        self.templates.globals.update(urlencode=urlencode)

    def render(self, request: Request, template: str, *, viewer: Viewer | None, status: int = 200,
               **context: Any) -> HTMLResponse:
        html = self.templates.get_template(template).render(request=request, viewer=viewer, **context)
        return HTMLResponse(html, status_code=status)

    def error_page(self, request: Request, viewer: Viewer | None, exc: APIError) -> HTMLResponse:
        return self.render(request, "error.html", viewer=viewer, status=exc.status_code, error=exc)

    def route(self, path: str, handler: PageHandler, *, methods: tuple[str, ...] = ("GET",),
              access: Access = "viewer") -> Route:
        """``handler`` at ``/ui{path}``, behind the sign-in and the checks its ``access`` needs."""

        async def serve(request: Request) -> Response:
            try:
                response = await self._serve(request, handler, access)
            except APIError as exc:
                # an error once the session is known (a page not found, a form refused) keeps the viewer's header
                response = self.error_page(request, getattr(request.state, "console_viewer", None), exc)
            response.headers.update(SECURITY_HEADERS)
            return response

        return Route(path, serve, methods=list(methods), name=f"console{path}")

    async def _serve(self, request: Request, handler: PageHandler, access: Access) -> Response:
        viewer = await self.auth.viewer(request)
        new_session: str | None = None
        if viewer is not None and viewer.open and not loopback_host(request):
            viewer = None
        if viewer is None:
            if await self.gateway.auth.is_open() and loopback_host(request):
                new_session, viewer = await self.auth.open_session()
            elif request.method == "GET":
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse(f"{PATH}/login?{urlencode({'next': target})}", status_code=303)
            else:
                raise APIError(401, "Your session has ended; sign in again.", code="signed_out")
        request.state.console_viewer = viewer
        if access == "admin" and not viewer.admin:
            raise APIError(403, "This page needs the admin key.", code="admin_key_required")
        if access == "approver" and not viewer.approver:
            raise APIError(403, "Only the admin key and the approvers the gateway names may decide held calls.",
                           code="not_an_approver")
        form: dict[str, str] = {}
        if request.method == "POST":
            check_origin(request)
            form = await read_form(request)
            check_csrf(viewer.csrf, form.get("csrf") or request.headers.get("x-csrf-token"))
        response = await handler(Page(self, request, viewer, form))
        if new_session is not None:
            self.auth.set_cookie(request, response, new_session)
        return response


async def read_form(request: Request) -> dict[str, str]:
    """An URL-encoded form's fields (a repeated field keeps its last value)."""
    raw = await read_body(request, FORM_LIMIT)
    try:
        return dict(parse_qsl(raw.decode(), keep_blank_values=True, max_num_fields=200))
    except (UnicodeDecodeError, ValueError):
        raise APIError(400, "The form could not be read.", code="invalid_form") from None

