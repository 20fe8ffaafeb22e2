"""``GET /v1/models``: what this gateway serves: base models, adapters (``parent`` = their base), aliases
and agent profiles."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.api.common import json_response
from gateway.context import RequestContext
from gateway.errors import model_not_found
from gateway.routing import is_pattern

_CREATED = 1_700_000_000


def _card(model: str, owned_by: str, parent: str | None = None, created: float = _CREATED) -> dict[str, Any]:
    card = {"id": model, "object": "model", "created": int(created), "owned_by": owned_by}
    if parent is not None:
        card["parent"] = parent
    return card


def _cards(gateway: Any) -> list[dict[str, Any]]:
    cards = [_card(m, b.name) for m, b in sorted(gateway.model_map.items())]
    snapshot = gateway.adapter_manager.snapshot
    for (name, number), version in sorted(snapshot.versions.items()):
        backend = gateway.model_map.get(version.base_model)
        if backend is None or version.status == "retired":
            continue
        if snapshot.active.get(name) is version:
            cards.append(_card(f"{version.base_model}:{name}", backend.name, version.base_model, version.created_at))
        cards.append(_card(f"{version.base_model}:{name}@{number}", backend.name, version.base_model,
                           version.created_at))
    # A pattern alias (claude-*) names no one model a client could pick.
    cards += [_card(alias, "alias") for alias in sorted(gateway.settings.routing.aliases) if not is_pattern(alias)]
    cards += [_card(f"agent:{name}", "agent") for name in sorted(gateway.agents.profiles)]
    return cards


async def list_models(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.authenticate(request.headers)
    return json_response({"object": "list", "data": _cards(gateway)})


async def get_model(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    await gateway.auth.authenticate(request.headers)
    model = request.path_params["model"]
    for card in _cards(gateway):
        if card["id"] == model:
            return json_response(card)
    raise model_not_found(f"The model '{model}' does not exist.")
