"""``/healthz`` and the Prometheus ``/metrics``."""

from __future__ import annotations

from contextlib import suppress

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from gateway.context import RequestContext
from gateway.errors import APIError


async def healthz(ctx: RequestContext) -> Response:
    gateway = ctx.gateway
    return JSONResponse({"status": "ok", "models": sorted(gateway.model_map),
                         "store_queue_depth": gateway.store.queue_depth,
                         "adapters": gateway.adapter_manager.loaded(),
                         # Each backend's breaker and load, with an adapter server's last probe where it has one.
                         "backends": {m.name: {**gateway.adapter_manager.health.get(m.name, {}), **m.status()}
                                      for m in gateway.members}})


async def metrics(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    # [server] metrics_auth: "open" (scrapers on a private network), "key" (any API key), "admin" (the admin key).
    mode = gateway.settings.server.metrics_auth
    principal = None
    if mode == "admin":
        principal = await gateway.auth.require_admin(request.headers)
    elif mode == "key":
        principal = await gateway.auth.authenticate(request.headers)
    elif "authorization" in request.headers:
        with suppress(APIError):  # a scraper's key is not needed here, so a wrong one is no error
            principal = await gateway.auth.authenticate(request.headers)
    # Figures that move with single requests go only to readers who may see every tenant's: the admin key, or
    # anyone on an open gateway (loopback, no key: one user).
    private = (principal is not None and principal.admin) or await gateway.auth.is_open()
    return Response(gateway.metrics.render(private=private), media_type=CONTENT_TYPE_LATEST)
