"""``GET /v1/models``: what this gateway serves."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import model_not_found

_CREATED = 1_700_000_000


def _card(model: str, backend: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": _CREATED, "owned_by": backend}


async def list_models(request: Request) -> Response:
    gateway = request.app.state.gateway
    await gateway.auth.authenticate(request.headers)
    data = [_card(m, b.name) for m, b in sorted(gateway.model_map.items())]
    data += [_card(f"agent:{name}", "agent") for name in sorted(gateway.agents.profiles)]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    gateway = request.app.state.gateway
    await gateway.auth.authenticate(request.headers)
    model = request.path_params["model"]
    backend = gateway.model_map.get(model)
    if backend is None:
        raise model_not_found(f"The model '{model}' does not exist.")
    return JSONResponse(_card(model, backend.name))
