"""``/healthz`` and the Prometheus ``/metrics``."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def healthz(request: Request) -> Response:
    gateway = request.app.state.gateway
    return JSONResponse({"status": "ok", "models": sorted(gateway.model_map),
                         "store_queue_depth": gateway.store.queue_depth,
                         "adapters": gateway.adapter_manager.loaded(),
                         "backends": gateway.adapter_manager.health})


async def metrics(request: Request) -> Response:
    gateway = request.app.state.gateway
    # [server] metrics_auth: "open" (scrapers on a private network), "key" (any API key), "admin" (the admin key).
    mode = gateway.settings.server.metrics_auth
    if mode == "admin":
        await gateway.auth.require_admin(request.headers)
    elif mode == "key":
        await gateway.auth.authenticate(request.headers)
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)
