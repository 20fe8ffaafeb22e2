"""Who is looking at the console: sign-in with an API key or the admin key, the session cookie it sets, and the
checks every page and form makes (session live, CSRF token, same origin, loopback host on an open gateway).

The cookie holds a random token; the store keeps its hash (``replay.sessions``), so a stolen database holds no
usable session. Cookies are HttpOnly and SameSite=Strict; every form carries the session's CSRF token, and a form
posted from another origin is refused before its token is even read.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import Authenticator, hash_secret, is_loopback
from gateway.console.settings import ConsoleSettings
from gateway.errors import APIError
from replay import keys, sessions
from replay.store import TrajectoryStore

COOKIE = "harness_console"
LOGIN_COOKIE = "harness_console_login"  # the sign-in form's own CSRF token, before there is a session
PATH = "/ui"


@dataclass(frozen=True)
class Viewer:
    """A signed-in person, as the pages see them: what they may read (``tenant``, or everything when ``admin``)
    and do."""

    key_id: str | None  # "admin", an API key's id, or None on an open gateway
    tenant: str | None
    admin: bool
    approver: bool
    csrf: str
    label: str  # shown in the header

    @property
    def open(self) -> bool:
        return self.key_id is None


class ConsoleAuth:
    def __init__(self, store: TrajectoryStore, auth: Authenticator, settings: ConsoleSettings) -> None:
        self.store = store
        self.auth = auth
        self.settings = settings

    async def viewer(self, request: Request) -> Viewer | None:
        """The live session the request's cookie names, or None."""
        token = request.cookies.get(COOKIE)
        if not token:
            return None
        row = await sessions.find(self.store, hash_secret(token), time.time())
        if row is None:
            return None
        key_id = row["key_id"]
        if key_id == "admin":
            admin_key = self.auth.admin_key
            live = bool(admin_key) and hmac.compare_digest(hash_secret(admin_key or ""), row["key_hash"] or "")
            label = "admin"
        elif key_id is None:
            live = await self.auth.is_open()
            label = "open gateway"
        else:
            live = bool(row["key_live"])
            label = f"{row['key_name'] or key_id} ({row['tenant']})"
        if not live:
            return None
        admin = bool(row["admin"])
        return Viewer(key_id=key_id, tenant=row["tenant"], admin=admin,
                      approver=admin or key_id in self.settings.approvers, csrf=row["csrf"], label=label)

    async def sign_in(self, secret: str) -> tuple[str, Viewer] | None:
        """A new session for ``secret`` (the admin key or a live API key): its cookie token and viewer."""
        if self.auth.is_admin(secret):
            return await self._open_session(key_id="admin", key_hash=hash_secret(secret), tenant=None, admin=True,
                                            label="admin")
        row = await keys.find(self.store, hash_secret(secret))  # the lookup the API's authentication makes
        if row is None:
            return None
        return await self._open_session(key_id=row["id"], key_hash=hash_secret(secret), tenant=row["tenant"],
                                        admin=False, label=f"{row['name'] or row['id']} ({row['tenant']})")

    async def open_session(self) -> tuple[str, Viewer]:
        """A session on an open (loopback, keyless) gateway, which needs no sign-in: it may do everything."""
        return await self._open_session(key_id=None, key_hash=None, tenant=None, admin=True, label="open gateway")

    async def sign_out(self, request: Request) -> None:
        token = request.cookies.get(COOKIE)
        if token:
            await sessions.delete(self.store, hash_secret(token))

    async def _open_session(self, *, key_id: str | None, key_hash: str | None, tenant: str | None, admin: bool,
                            label: str) -> tuple[str, Viewer]:
        token, csrf, now = secrets.token_urlsafe(32), secrets.token_urlsafe(24), time.time()
        await sessions.create(self.store, session_hash=hash_secret(token), key_id=key_id, key_hash=key_hash,
                              tenant=tenant, admin=admin, csrf=csrf, now=now,
                              expires_at=now + self.settings.session_hours * 3600)
        approver = admin or key_id in self.settings.approvers
        return token, Viewer(key_id=key_id, tenant=tenant, admin=admin, approver=approver, csrf=csrf, label=label)

    def set_cookie(self, request: Request, response: Response, token: str) -> None:
        response.set_cookie(COOKIE, token, max_age=int(self.settings.session_hours * 3600), path=PATH,
                            httponly=True, samesite="strict", secure=request.url.scheme == "https")


def check_origin(request: Request) -> None:
    """A form must come from the console's own origin: a browser names it in ``Origin`` (or ``Referer``)."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:
        return  # not a browser, or one that hides it: the CSRF token still has to match
    if urlsplit(origin).netloc != request.headers.get("host", ""):
        raise APIError(403, "This form was posted from another site.", code="cross_origin")


def check_csrf(expected: str, given: str | None) -> None:
    if not given or not hmac.compare_digest(expected, given):
        raise APIError(403, "The form's security token is missing or stale; reload the page and try again.",
                       code="csrf_failed")


def loopback_host(request: Request) -> bool:
    """Whether the request names this gateway by a loopback address: an open gateway's console answers only those,
    so a web page that rebinds its own name to 127.0.0.1 cannot reach it."""
    host = urlsplit(f"//{request.headers.get('host', '')}").hostname or ""
    return is_loopback(host)
