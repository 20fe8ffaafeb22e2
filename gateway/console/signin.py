"""Signing in and out. The sign-in form carries a token of its own (a cookie and a hidden field that must agree),
as there is no session yet to hold one."""

from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from gateway.console.app import SECURITY_HEADERS, Console, read_form
from gateway.console.auth import COOKIE, LOGIN_COOKIE, PATH, check_csrf, check_origin
from gateway.errors import APIError


def _next(target: str | None) -> str:
    """Where to go after signing in: a console page, never another site."""
    if target and target.startswith(PATH + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return f"{PATH}/trajectories"


def _form(console: Console, request: Request, *, error: str | None = None, status: int = 200) -> Response:
    token = secrets.token_urlsafe(24)
    response = console.render(request, "login.html", viewer=None, status=status, csrf=token, error=error,
                              next=_next(request.query_params.get("next")))
    response.set_cookie(LOGIN_COOKIE, token, max_age=3600, path=PATH, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    response.headers.update(SECURITY_HEADERS)
    return response


def routes(console: Console) -> list[Route]:
    async def login_form(request: Request) -> Response:
        return _form(console, request)

    async def login(request: Request) -> Response:
        try:
            check_origin(request)
            form = await read_form(request)
            check_csrf(request.cookies.get(LOGIN_COOKIE) or "", form.get("csrf"))
        except APIError as exc:
            return _form(console, request, error=exc.message, status=exc.status_code)
        opened = await console.auth.sign_in(form.get("key", "").strip())
        if opened is None:
            return _form(console, request, error="That key is not valid (or was revoked).", status=401)
        token, _ = opened
        response = RedirectResponse(_next(form.get("next")), status_code=303)
        console.auth.set_cookie(request, response, token)
        response.delete_cookie(LOGIN_COOKIE, path=PATH)
        return response

    async def logout(request: Request) -> Response:
        viewer = await console.auth.viewer(request)
        if viewer is not None:
            try:
                check_origin(request)
                check_csrf(viewer.csrf, (await read_form(request)).get("csrf"))
            except APIError as exc:
                return console.error_page(request, viewer, exc)
            await console.auth.sign_out(request)
        response = RedirectResponse(f"{PATH}/login", status_code=303)
        response.delete_cookie(COOKIE, path=PATH)
        return response

    return [Route("/login", login_form, methods=["GET"]), Route("/login", login, methods=["POST"]),
            Route("/logout", logout, methods=["POST"])]
