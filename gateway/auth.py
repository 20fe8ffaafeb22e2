"""API keys (stored hashed, each with a tenant) and the admin key."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass, field

from starlette.datastructures import Headers

from gateway.errors import APIError
from gateway.quotas.settings import Limits
from gateway.routing import Caller
from replay import keys
from replay.store import TrajectoryStore

KEY_PREFIX = "sk-harness-"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling. ``tenant`` scopes what they may read; ``capture`` whether they are recorded."""

    key_id: str | None
    tenant: str | None
    capture: bool = True
    admin: bool = False
    default_model: str | None = None  # for requests that name no model
    allow_model_override: bool = False  # may replace the model with the override header
    limits: Limits | None = field(default=None, compare=False)  # the key's own, over [limits.key]

    def caller(self) -> Caller:
        """As routing sees it: an open gateway and the admin key may always use the override header."""
        return Caller(tenant=self.tenant, default_model=self.default_model,
                      may_override=self.allow_model_override or self.admin or self.key_id is None)


OPEN = Principal(key_id=None, tenant=None)
CAPTURE_HEADER = "X-Harness-Capture"  # "off": the admin key's requests are not recorded


def _bearer(headers: Headers) -> str | None:
    value = headers.get("authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip() or None
    return headers.get("x-api-key") or headers.get("api-key")


class Authenticator:
    """Open (no key needed) only while no API key was ever created in the store and the gateway is bound to
    loopback; once a key exists, even revoked, a valid key is required.

    Lookups are cached for ``cache_seconds`` (``[server] auth_cache_seconds``) so a key made or revoked from the
    CLI takes effect within that time without a database read on every request: a revoked key keeps working
    for at most that long, and so does the open mode after the first key is created.
    """

    def __init__(self, store: TrajectoryStore, admin_key: str | None, *, loopback: bool,
                 cache_seconds: float = 5.0) -> None:
        self.store = store
        self.admin_key = admin_key
        self.cache_seconds = cache_seconds
        self._keys: dict[str, tuple[float, Principal | None]] = {}
        # Never open beyond loopback; and once closed, closed for good (the store never forgets a key).
        self._closed = not loopback
        self._open_until = 0.0

    async def is_open(self) -> bool:
        if self._closed:
            return False
        now = time.monotonic()
        if now >= self._open_until:
            if await keys.ever_created(self.store):
                self._closed = True
                return False
            self._open_until = now + self.cache_seconds
        return True

    def is_admin(self, secret: str | None) -> bool:
        return bool(self.admin_key and secret and hmac.compare_digest(secret, self.admin_key))

    async def authenticate(self, headers: Headers) -> Principal:
        secret = _bearer(headers)
        if self.is_admin(secret):
            # A trainer running its episodes here records them itself, as rollouts: the admin may say so.
            return Principal(key_id="admin", tenant=None, admin=True,
                             capture=headers.get(CAPTURE_HEADER, "").strip().lower() != "off")
        if secret is None:
            if await self.is_open():
                return OPEN
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           code="missing_api_key")
        digest = hash_secret(secret)
        now = time.monotonic()
        cached = self._keys.get(digest)
        if cached is None or now >= cached[0]:
            row = await keys.find(self.store, digest)
            principal = None if row is None else Principal(
                key_id=row["id"], tenant=row["tenant"], capture=bool(row["capture"]),
                default_model=row["default_model"], allow_model_override=bool(row["allow_model_override"]),
                limits=Limits.model_validate_json(row["limits"]) if row["limits"] else None)
            if len(self._keys) > 10_000:
                self._keys.clear()
            self._keys[digest] = cached = (now + self.cache_seconds, principal)
        if cached[1] is None:
            if await self.is_open():
                return OPEN  # open gateways ignore whatever key an SDK insists on sending
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return cached[1]

    async def require_admin(self, headers: Headers) -> Principal:
        if not self.is_admin(_bearer(headers)):
            raise APIError(401 if self.admin_key else 403,
                           "This route needs the admin key." if self.admin_key
                           else "No admin key is configured on this gateway.",
                           error_type="invalid_request_error", code="admin_key_required")
        return Principal(key_id="admin", tenant=None, admin=True)
