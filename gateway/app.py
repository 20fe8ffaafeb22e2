"""Builds the ASGI application: routes, the runtime state they share, and start-up/shut-down."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.adapters.manager import AdapterManager
from gateway.adapters.service import AdapterService
from gateway.agent.service import AgentService
from gateway.api import (
    adapters,
    agent,
    approvals,
    chat,
    completions,
    embeddings,
    health,
    messages,
    models,
    openapi,
    responses,
    trajectories,
    usage,
)
from gateway.auth import Authenticator, is_loopback
from gateway.backends import build_backend
from gateway.backends.base import Backend
from gateway.backends.health import HealthMonitor
from gateway.backends.pool import build_pools, member_settings
from gateway.bot.service import BotService
from gateway.bot.webhook import WebhookPlatform
from gateway.bot.wecom import WeComPlatform
from gateway.config import Settings
from gateway.console.app import Console
from gateway.console.routes import console_routes
from gateway.context import Handler, access_line, endpoint, open_line
from gateway.errors import APIError, error_response, store_unavailable
from gateway.metrics import Metrics
from gateway.quotas.admission import Quotas
from gateway.quotas.counters import open_counters
from gateway.quotas.pricing import Pricing
from gateway.routing import Caller, Router
from replay.adapters import AdapterRegistry
from replay.database import StoreUnavailable, redact_url
from replay.store import TrajectoryStore
from tools.context import ToolContext
from tools.registry import default_registry

log = structlog.get_logger()

RETENTION_SWEEP_SECONDS = 3600.0


class Gateway:
    """Everything the routes share: settings, store, backends, auth and metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        s = settings.store
        self.metrics = Metrics(queue_depth=lambda: self.store.queue_depth)
        self.pricing = Pricing(settings.prices)
        self.store = TrajectoryStore(s.location, s, on_commit=self.metrics.observe_commit,
                                     cost_of=self.pricing.price_record)
        self.quotas = Quotas(settings.limits, open_counters(settings.limits.storage), self.pricing)
        self.auth = Authenticator(self.store, settings.server.admin_key, loopback=is_loopback(settings.server.host),
                                  cache_seconds=settings.server.auth_cache_seconds)
        built = member_settings(settings.backends, settings.routing.member_retries)
        self.backends: list[Backend] = [build_backend(b) for b in built]
        self.metrics.watch_prefix_caches(self.backends)
        # Each model's backend: the one serving it, or a pool of all that do (gateway/backends/pool.py).
        self.members, self.model_map = build_pools(self.backends, built, settings.routing)
        self.background: set[asyncio.Task[Any]] = set()
        self.cancel_on_stop: set[asyncio.Task[Any]] = set()
        registry = AdapterRegistry(s.location)
        self.router: Router[Backend] = Router(settings.routing, self.model_map,
                                              snapshot=lambda: self.adapter_manager.snapshot,
                                              lease=lambda target: self.adapter_manager.lease(target))
        self.adapter_manager = AdapterManager(self.backends, registry, self.spawn,
                                              also_wanted=self.router.canary_versions)
        self.adapters = AdapterService(registry, settings.routing.adapters_dir, settings.routing.max_upload_bytes,
                                       self.adapter_manager)
        own = ((settings.server.host, settings.server.port),)  # where this gateway listens: off limits to tools
        self.tool_context = ToolContext(settings.tools, own=own)
        self.agents = AgentService(profiles=settings.profiles, store=self.store,
                                   registry=default_registry(settings.tools), tool_context=self.tool_context,
                                   backend_for=self.backend_for, on_usage=self.metrics.count_tokens,
                                   meter_for=lambda key_id, own, tenant, model: self.quotas.meter(
                                       key_id, own, tenant, self.base_of(model)),
                                   spawn=lambda coro: self.spawn(coro, cancel_on_stop=True))
        self.bot = BotService(settings.bot, self.agents, self.store, self.spawn)
        self.bot.add(WebhookPlatform(settings.bot, self.bot, own=own))
        wecom = WeComPlatform(settings.bot.wecom, self.bot, settings.bot.profile)
        self.bot.add(wecom)
        if wecom.enabled:
            self.tool_context.messenger = wecom.message

    def spawn(self, coro: Any, *, cancel_on_stop: bool = False) -> asyncio.Task[Any]:
        """Run work that outlives its request: a disconnected stream's record (finished before shutdown),
        or a background agent run (cancelled at shutdown, and so recorded as interrupted)."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        if cancel_on_stop:
            self.cancel_on_stop.add(task)
            task.add_done_callback(self.cancel_on_stop.discard)
        return task

    def backend_for(self, model: str) -> Backend:
        """For agent profiles: the whole pipeline on a configured name; one draw per run, so a run is sticky."""
        return self.router.route(self.router.name_for(model, Caller())).backend

    def base_of(self, model: str) -> str | None:
        """The base model a configured name stands for (an alias's, an adapter's): what it is priced as."""
        try:
            return self.router.target_for(self.router.name_for(model, Caller())).base
        except APIError:
            return None

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # release what did start: the store's threads would keep the process alive
            raise

    async def _start(self) -> None:
        await self.store.start()
        for backend in self.backends:
            await backend.start()
        await self.bot.recover()
        await self.adapter_manager.refresh(force=True)
        await self.adapter_manager.reconcile()
        self.spawn(self.adapter_manager.run(self.settings.routing.refresh_seconds), cancel_on_stop=True)
        if self.settings.routing.health_check_seconds:
            monitor = HealthMonitor(self.members, self.settings.routing.health_check_seconds)
            self.spawn(monitor.run(), cancel_on_stop=True)
        # Expired approvals, decisions made elsewhere and runs whose process died; and this process's run leases,
        # renewed three times a lease so one missed renewal never lets a live run be taken over.
        self.spawn(self._every(self.settings.tools.approval_poll_seconds, self.agents.sweep, "approvals.sweep_failed"),
                   cancel_on_stop=True)
        self.spawn(self._every(self.settings.tools.run_lease_seconds / 3, self.agents.renew_leases,
                               "agent.lease_renewal_failed", first_wait=True), cancel_on_stop=True)
        if self.settings.store.retention_days:
            self.spawn(self._retention_loop(self.settings.store.retention_days), cancel_on_stop=True)
        log.info("gateway.started", models=sorted(self.model_map), store=redact_url(self.settings.store.location))

    async def stop(self) -> None:
        for task in list(self.cancel_on_stop):
            task.cancel()
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
        for backend in self.backends:
            await backend.aclose()
        await self.tool_context.aclose()
        await self.bot.aclose()
        await self.quotas.counters.aclose()
        await self.store.close()

    @staticmethod
    async def _every(seconds: float, work: Callable[[], Awaitable[Any]], failed: str, *,
                     first_wait: bool = False) -> None:
        """``work`` every ``seconds`` until cancelled; a failed round is logged as ``failed``, and the next goes on."""
        if first_wait:
            await asyncio.sleep(seconds)
        while True:
            try:
                await work()
            except Exception:  # noqa: BLE001 - one failed round must not end the loop
                log.exception(failed)
            await asyncio.sleep(seconds)

    async def _retention_loop(self, days: float) -> None:
        while True:
            removed = await self.store.delete(before=time.time() - days * 86400)
            if removed:
                log.info("store.retention", deleted=removed, older_than_days=days)
            await asyncio.sleep(RETENTION_SWEEP_SECONDS)


class AccessLog:
    """Pure ASGI middleware: one structured line and the metrics for every request.

    Handlers fill in the request's typed ``AccessLine`` (gateway/context.py): where it was routed, its trajectory,
    its tokens.
    """

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        line = open_line(scope)
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route_name") or _route_name(scope)
            self.gateway.metrics.observe_request(route, status, line.model or "", line.backend or "", elapsed)
            if route not in ("metrics", "healthz"):
                log.info("request", method=scope["method"], path=scope["path"], status=status,
                         latency_ms=round(elapsed * 1000, 2), **line.fields())


def _route_name(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "name", None) or "unmatched"


async def _not_found(request: Request, exc: Exception) -> Response:
    return _render(request, APIError(404, f"Unknown route {request.method} {request.url.path}.", code="not_found"))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return _render(request, APIError(405, f"Method {request.method} is not allowed on {request.url.path}.",
                                     code="method_not_allowed"))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    access_line(request.scope).error = exc.code or exc.error_type
    request.app.state.gateway.metrics.errors.labels(exc.error_type).inc()
    return _render(request, exc)


def _render(request: Request, exc: APIError) -> Response:
    """OpenAI's error envelope, or Anthropic's on the Messages API, whose clients read only that."""
    return messages.anthropic_error(exc) if messages.is_messages_path(request.url.path) else error_response(exc)


async def _client_gone(request: Request, exc: Exception) -> Response:
    # Nobody reads it: the status is for the access log (499, "client closed request", as nginx logs it).
    return Response(status_code=499)


async def _store_unavailable(request: Request, exc: Exception) -> Response:
    log.warning("store.unavailable", path=request.url.path, error=str(exc))
    return await _api_error(request, store_unavailable())


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled", path=request.url.path)
    request.app.state.gateway.metrics.errors.labels("server_error").inc()
    return _render(request, APIError(500, "The gateway failed to handle this request.", error_type="server_error"))


def build_app(settings: Settings) -> Starlette:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    def route(path: str, handler: Handler, method: str, name: str) -> Route:
        return Route(path, endpoint(gateway, handler), methods=[method], name=name)

    routes = [
        route("/v1/chat/completions", chat.chat_completions, "POST", "chat"),
        route("/v1/completions", completions.create_completion, "POST", "completions"),
        route("/v1/embeddings", embeddings.create_embeddings, "POST", "embeddings"),
        route("/v1/responses", responses.create_response, "POST", "responses"),
        route("/v1/responses/compact", responses.compact_response, "POST", "responses_compact"),
        route("/v1/responses/{response_id}", responses.get_response, "GET", "response"),
        route("/v1/messages", messages.create_message, "POST", "messages"),
        route("/v1/messages/count_tokens", messages.count_tokens, "POST", "messages_count_tokens"),
        route("/v1/agent/runs", agent.create_run, "POST", "agent_runs"),
        route("/v1/agent/runs/{run_id}", agent.get_run, "GET", "agent_run"),
        route("/v1/models", models.list_models, "GET", "models"),
        route("/v1/models/{model:path}", models.get_model, "GET", "model"),
        route("/v1/trajectories", trajectories.list_own, "GET", "trajectories"),
        route("/v1/trajectories/{trajectory_id}", trajectories.show_own, "GET", "trajectory"),
        route("/v1/trajectories/{trajectory_id}/feedback", trajectories.feedback, "POST", "trajectory_feedback"),
        route("/admin/adapters", adapters.list_adapters, "GET", "admin_adapters"),
        route("/admin/adapters", adapters.register, "POST", "admin_adapters_register"),
        route("/admin/adapters/{name}/{action}", adapters.lifecycle, "POST", "admin_adapter_action"),
        route("/admin/trajectories", trajectories.list_all, "GET", "admin_trajectories"),
        route("/admin/trajectories/{trajectory_id}", trajectories.show_any, "GET", "admin_trajectory"),
        route("/admin/usage", usage.usage, "GET", "admin_usage"),
        route("/admin/approvals", approvals.list_approvals, "GET", "admin_approvals"),
        route("/admin/approvals/{approval_id}", approvals.show, "GET", "admin_approval"),
        route("/admin/approvals/{approval_id}/{action}", approvals.decide, "POST", "admin_approval_decide"),
        *[bot_route for platform in gateway.bot.platforms.values() for bot_route in platform.routes()],
        route("/openapi.json", openapi.openapi_json, "GET", "openapi"),
        route("/healthz", health.healthz, "GET", "healthz"),
        route("/metrics", health.metrics, "GET", "metrics"),
        *(console_routes(Console(gateway)) if settings.server.console else []),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed, APIError: _api_error,
                            ClientDisconnect: _client_gone, StoreUnavailable: _store_unavailable,
                            Exception: _internal_error},
    )
    app.state.gateway = gateway
    app.add_middleware(AccessLog, gateway=gateway)
    return app
