"""The generic signed JSON webhook: ``POST /bot/v1/messages``, ``GET /bot/v1/messages/{id}`` and
``POST /bot/v1/reactions``.

Every request is signed (``signing.py``) and its nonce is claimed in the store, so neither a replay nor a
restart reopens it. A message is answered in the response when the turn ends within ``sync_timeout_seconds``;
otherwise the answer is 202 with the message id, and the reply is polled or, with a ``callback_url``, posted
there signed the same way. A callback URL must pass the SSRF guard unless ``[bot] callback_allow_hosts`` or
``callback_allow_networks`` let it through.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.api.common import json_response, parse_json, read_body
from gateway.api.trajectories import feedback_row
from gateway.bot.platform import DeliveryError, Incoming
from gateway.bot.service import BotService
from gateway.bot.settings import BotSettings
from gateway.bot.signing import SignatureError, signed_headers, verify
from gateway.context import access_line
from gateway.errors import APIError
from replay import bot_messages, keys
from tools.net import guarded_client
from tools.spec import ToolError
from tools.ssrf import SSRFGuard

NAME = "webhook"
MAX_BODY = 256 * 1024
MAX_TEXT = 32_000
_ID_FIELDS = ("conversation_id", "user_id")


class WebhookPlatform:
    name = NAME

    def __init__(self, settings: BotSettings, bot: BotService, *, own: tuple[tuple[str, int], ...] = ()) -> None:
        """``own``: where the gateway listens (host, port), which no callback may reach."""
        self.settings = settings
        self.bot = bot
        self.profile = settings.profile or ""
        self.secret = settings.secret.encode() if settings.secret else None
        self.guard = SSRFGuard(settings.callback_allow_hosts, settings.callback_allow_networks, own=own)
        self._client: httpx.AsyncClient | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.secret and self.settings.profile)

    def routes(self) -> list[BaseRoute]:
        return [Route("/bot/v1/messages", self.post_message, methods=["POST"], name="bot_messages"),
                Route("/bot/v1/messages/{message_id}", self.get_message, methods=["GET"], name="bot_message"),
                Route("/bot/v1/reactions", self.react, methods=["POST"], name="bot_reactions")]

    # -- requests in ----------------------------------------------------------------------------------

    async def _signed(self, request: Request) -> bytes:
        """The raw body of a correctly signed request with a fresh nonce; 401 otherwise."""
        if not self.enabled or self.secret is None:
            raise APIError(404, "The bot webhook is not configured: set [bot] profile and the shared secret in the "
                                f"variable [bot] secret_env names ({self.settings.secret_env}).",
                           code="bot_not_configured")
        raw = await read_body(request, MAX_BODY)
        now = time.time()
        try:
            signed = verify(self.secret, request.headers, raw, now, self.settings.signature_window_seconds)
        except SignatureError as exc:
            raise APIError(401, str(exc), code="invalid_signature") from None
        # Kept twice the window: a timestamp accepted now cannot be accepted once its nonce is forgotten.
        if not await keys.claim_nonce(self.bot.store, signed.nonce, now=now,
                                                keep_seconds=2 * self.settings.signature_window_seconds):
            raise APIError(401, "This nonce was already used; every request needs a new one.", code="replayed_nonce")
        return raw

    async def post_message(self, request: Request) -> Response:
        body = parse_json(await self._signed(request))
        incoming = await self._incoming(body)
        limited = await self.bot.rate_limited(NAME, incoming.user_id)
        if limited:
            raise APIError(429, limited[0], error_type="rate_limit_error", code="rate_limited",
                           headers={"Retry-After": str(limited[1])})
        message = await self.bot.accept(incoming)
        assert message is not None  # the webhook sends no external ids
        line = access_line(request.scope)
        line.bot_message, line.conversation_id = message["id"], incoming.conversation_id
        turn = self.bot.answer(message)
        done, _ = await asyncio.wait({turn}, timeout=self.settings.sync_timeout_seconds)
        if turn in done and turn.result()["status"] == bot_messages.ANSWERED:
            return json_response(bot_messages.view(await self.bot.mark_delivered(turn.result())))
        self.bot.reply_later(turn)
        row = turn.result() if turn in done else await bot_messages.get(self.bot.store, message["id"]) or message
        view = bot_messages.view(row)
        # Waiting behind another turn: the run it will join is the conversation's (none yet for a new one).
        view["run_id"] = view["run_id"] or await bot_messages.conversation_run(self.bot.store, NAME,
                                                                           incoming.conversation_id)
        return json_response({**view, "poll": f"/bot/v1/messages/{message['id']}"}, status=202)

    async def _incoming(self, body: Any) -> Incoming:
        if not isinstance(body, dict):
            raise APIError(400, "The body must be a JSON object.")
        unknown = sorted(set(body) - {"conversation_id", "user_id", "text", "callback_url"})
        if unknown:
            raise APIError(400, f"Unknown field '{unknown[0]}'.", param=unknown[0])
        for name in _ID_FIELDS:
            value = body.get(name)
            if not isinstance(value, str) or not value.strip() or len(value) > 256:
                raise APIError(400, f"'{name}' must be a non-empty string of at most 256 characters.", param=name)
        text = body.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT:
            raise APIError(400, f"'text' must be a non-empty string of at most {MAX_TEXT} characters.", param="text")
        callback = body.get("callback_url")
        if callback is not None:
            if not isinstance(callback, str):
                raise APIError(400, "'callback_url' must be a URL.", param="callback_url")
            try:
                await self.guard.vet_url(callback)
            except ToolError as exc:
                raise APIError(400, f"'callback_url' is not allowed: {exc}.", param="callback_url") from None
        return Incoming(platform=NAME, conversation_id=body["conversation_id"], user_id=body["user_id"], text=text,
                        callback_url=callback)

    async def get_message(self, request: Request) -> Response:
        await self._signed(request)
        row = await bot_messages.get(self.bot.store, request.path_params["message_id"])
        if row is None or row["platform"] != NAME:
            raise APIError(404, f"No bot message '{request.path_params['message_id']}'.", code="not_found")
        if row["status"] == bot_messages.ANSWERED and not row["callback_url"]:
            row = await self.bot.mark_delivered(row)  # polling was its way out
        return json_response(bot_messages.view(row))

    async def react(self, request: Request) -> Response:
        """``{"message_id", "rating": "up"|"down"}`` (or a ``score``, ``label``, ``comment``) on a reply."""
        body = parse_json(await self._signed(request))
        if not isinstance(body, dict) or not isinstance(body.get("message_id"), str):
            raise APIError(400, "'message_id' must name the bot message the reaction is about.", param="message_id")
        message_id = body.pop("message_id")
        body.pop("user_id", None)
        return json_response(await self.bot.react(message_id, feedback_row(body)), status=201)

    # -- replies out ----------------------------------------------------------------------------------

    async def deliver(self, message: dict[str, Any]) -> bool:
        if not message["callback_url"] or self.secret is None:
            return False
        payload = orjson.dumps({**bot_messages.view(message), "status": bot_messages.DELIVERED})
        headers = {"Content-Type": "application/json", **signed_headers(self.secret, payload, time.time())}
        try:
            response = await self._http().post(message["callback_url"], content=payload, headers=headers)
        except ToolError as exc:  # the guard refused the address it resolved to now
            raise DeliveryError(f"callback refused: {exc}", retryable=False) from None
        except httpx.HTTPError as exc:
            raise DeliveryError(f"callback failed: {exc!r}") from None
        if response.status_code >= 300:
            permanent = 400 <= response.status_code < 500 and response.status_code not in (408, 425, 429)
            raise DeliveryError(f"callback answered {response.status_code}", retryable=not permanent)
        return True

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = guarded_client(self.guard, timeout=self.settings.callback_timeout_seconds,
                                          user_agent="agent-harness-bot/0.1")
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
