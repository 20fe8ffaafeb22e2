"""The adapter registry: every name with its versions (status, lineage, the gate's decision and its numbers) and
the lifecycle's forms (promote, roll back, retire), which change the registry as ``/admin/adapters`` does."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any
from urllib.parse import quote

from starlette.responses import RedirectResponse, Response

from gateway.api.adapters import _api_error
from gateway.console.app import PATH, Page
from gateway.console.gate import Gate, gate_of
from gateway.errors import APIError
from replay.adapters import AdapterVersion, RegistryError

ACTIONS = ("promote", "rollback", "retire")


@dataclass(frozen=True)
class Card:
    """One version as the page shows it."""

    version: AdapterVersion
    gate: Gate | None
    test_success: float | None  # the candidate's success rate on the gate tasks
    reference: dict[str, Any] | None  # what it was judged against: its model and success rate


def _rate(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def card(version: AdapterVersion) -> Card:
    metrics = version.metrics or {}
    test, reference = metrics.get("test"), metrics.get("reference")
    return Card(version=version, gate=gate_of(metrics),
                test_success=_rate(test.get("success_rate")) if isinstance(test, dict) else None,
                reference={"model": reference.get("model"), "success_rate": _rate(reference.get("success_rate"))}
                if isinstance(reference, dict) else None)


async def list_page(page: Page) -> Response:
    try:
        versions = await page.gateway.adapters.list()
    except RegistryError as exc:
        raise _api_error(exc) from None
    ordered = sorted(versions, key=lambda v: (v.name, -v.version))
    adapters = [(name, [card(v) for v in group]) for name, group in groupby(ordered, key=lambda v: v.name)]
    return page.render("adapters.html", adapters=adapters)


def _version(page: Page) -> int:
    raw = page.form.get("version", "").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise APIError(400, "Give the version: a positive whole number.", param="version")
    return int(raw)


async def act(page: Page) -> Response:
    """``POST /ui/adapters/{name}/promote|rollback|retire``; promote and retire name a ``version``."""
    name, action = page.request.path_params["name"], page.request.path_params["action"]
    if action not in ACTIONS:
        raise APIError(404, f"Unknown adapter action '{action}'; use {', '.join(ACTIONS)}.", code="not_found")
    service = page.gateway.adapters
    try:
        if action == "promote":
            await service.promote(name, _version(page))
        elif action == "rollback":
            await service.rollback(name)
        else:
            await service.retire(name, _version(page))
    except RegistryError as exc:
        raise _api_error(exc) from None
    return RedirectResponse(f"{PATH}/adapters#adapter-{quote(name, safe='')}", status_code=303)
