"""WeCom (企业微信) application callbacks: ``GET|POST /bot/wecom/callback``.

WeCom checks the callback URL with a signed, encrypted ``echostr`` that must come back decrypted; then it posts
each user message as XML whose ``Encrypt`` field holds the encrypted message XML (``wecom_crypto.py``). It waits
about five seconds for an answer and sends the message again otherwise, so the adapter stores the message and
answers at once (empty, or ``ack_text`` as an encrypted passive reply), drops the retries by ``MsgId``, and
sends the agent's reply later through the send-message API (``{api_base}/cgi-bin/message/send``), with an access
token taken from ``{api_base}/cgi-bin/gettoken`` and kept until shortly before it expires.
"""

from __future__ import annotations

import secrets
import time
from typing import Any
from xml.etree.ElementTree import Element

import httpx
import structlog
from defusedxml import ElementTree
from defusedxml.common import DefusedXmlException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.api.common import read_body
from gateway.bot import wecom_crypto
from gateway.bot.platform import DeliveryError, Incoming
from gateway.bot.service import BotService
from gateway.bot.settings import WeComSettings
from gateway.config import ConfigError
from gateway.context import access_line
from gateway.errors import APIError
from replay import bot_messages
from tools.spec import ToolError

log = structlog.get_logger()

NAME = "wecom"
MAX_BODY = 1024 * 1024
TEXT_LIMIT = 2048  # bytes of one text message the send API accepts
TOKEN_ERRORS = frozenset({40014, 42001, 42009})  # invalid or expired access token: take a new one
BUSY = -1
ONLY_TEXT = "I can only read text messages."


def parse_xml(raw: bytes | str) -> dict[str, str]:
    """The child elements of a WeCom XML document, by tag (entities and DTDs refused)."""
    try:
        root: Element = ElementTree.fromstring(raw)
    except (ElementTree.ParseError, DefusedXmlException) as exc:
        raise ValueError(f"not a WeCom XML message ({exc})") from None
    return {child.tag: (child.text or "") for child in root}


def _cdata(text: str) -> str:
    return "<![CDATA[" + text.replace("]]>", "]]]]><![CDATA[>") + "]]>"


def text_reply(to_user: str, from_corp: str, text: str, created: int) -> str:
    """The plaintext of a passive text reply, before encryption."""
    return (f"<xml><ToUserName>{_cdata(to_user)}</ToUserName><FromUserName>{_cdata(from_corp)}</FromUserName>"
            f"<CreateTime>{created}</CreateTime><MsgType>{_cdata('text')}</MsgType>"
            f"<Content>{_cdata(text)}</Content></xml>")


def split_text(text: str, limit: int = TEXT_LIMIT) -> list[str]:
    """Pieces of at most ``limit`` UTF-8 bytes, cut between characters, preferring line ends."""
    pieces, rest = [], text
    while len(rest.encode()) > limit:
        cut = len(rest.encode()[:limit].decode(errors="ignore"))
        newline = rest.rfind("\n", 0, cut)
        cut = newline + 1 if newline > cut // 2 else cut
        pieces.append(rest[:cut])
        rest = rest[cut:]
    return [*pieces, rest] if rest or not pieces else pieces


class WeComPlatform:
    name = NAME

    def __init__(self, settings: WeComSettings, bot: BotService, default_profile: str | None) -> None:
        self.settings = settings
        self.bot = bot
        self.profile = settings.profile or default_profile or ""
        self.enabled = bool(settings.corp_id)
        self.corp_id = settings.corp_id or ""
        self._key = b""
        if self.enabled:
            missing = [env for env, value in ((settings.token_env, settings.token),
                                              (settings.aes_key_env, settings.aes_key),
                                              (settings.corp_secret_env, settings.corp_secret)) if not value]
            if missing:
                raise ConfigError(f"[bot.wecom] corp_id is set, so these variables are needed: {', '.join(missing)}")
            try:
                self._key = wecom_crypto.aes_key(settings.aes_key or "")
            except wecom_crypto.CryptoError as exc:
                raise ConfigError(f"[bot.wecom] {settings.aes_key_env}: {exc}") from None
        self._client: httpx.AsyncClient | None = None  # made on first use: most gateways never send to WeCom
        self._token: tuple[str, float] | None = None  # access token, monotonic time it is renewed at

    def routes(self) -> list[BaseRoute]:
        return [Route("/bot/wecom/callback", self.verify_url, methods=["GET"], name="wecom_verify"),
                Route("/bot/wecom/callback", self.callback, methods=["POST"], name="wecom_callback")]

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise APIError(404, "The WeCom adapter is not configured: set [bot.wecom] corp_id.",
                           code="bot_not_configured")

    # -- WeCom's requests ---------------------------------------------------------------------------

    async def verify_url(self, request: Request) -> Response:
        """The echo handshake WeCom does when the callback URL is saved."""
        self._check_enabled()
        q = request.query_params
        try:
            echo = wecom_crypto.verify_url(self.settings.token or "", self._key, self.corp_id,
                                           q.get("msg_signature", ""), q.get("timestamp", ""), q.get("nonce", ""),
                                           q.get("echostr", ""))
        except wecom_crypto.CryptoError as exc:
            raise APIError(401, f"WeCom URL verification failed: {exc}.", code="invalid_signature") from None
        return PlainTextResponse(echo)

    async def callback(self, request: Request) -> Response:
        self._check_enabled()
        q = request.query_params
        timestamp, nonce = q.get("timestamp", ""), q.get("nonce", "")
        try:
            encrypted = parse_xml(await read_body(request, MAX_BODY)).get("Encrypt", "")
            wecom_crypto.check_signature(self.settings.token or "", timestamp, nonce, encrypted,
                                         q.get("msg_signature", ""))
            message = parse_xml(wecom_crypto.decrypt(self._key, encrypted, self.corp_id))
        except wecom_crypto.CryptoError as exc:
            raise APIError(401, f"WeCom message refused: {exc}.", code="invalid_signature") from None
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_xml") from None
        user = message.get("FromUserName", "")
        kind = message.get("MsgType", "")
        if kind == "event" or not user:
            return Response(b"")  # joining, leaving, menu clicks: nothing to answer
        if kind != "text":
            return self._passive(user, ONLY_TEXT)
        if not message.get("Content", "").strip():
            return Response(b"")  # nothing to answer
        msg_id = message.get("MsgId")
        # A retry is dropped before the rate limit sees it: WeCom's resending is not the user's.
        if msg_id and await bot_messages.seen(self.bot.store, NAME, msg_id):
            log.info("wecom.retry_dropped", msg_id=msg_id)
            return Response(b"")
        limited = await self.bot.rate_limited(NAME, user)
        if limited:
            return self._passive(user, limited[0])
        stored = await self.bot.accept(Incoming(platform=NAME, conversation_id=user, user_id=user,
                                                text=message.get("Content", ""), external_id=msg_id))
        if stored is None:  # a retry that raced the original
            return Response(b"")
        line = access_line(request.scope)
        line.bot_message, line.conversation_id = stored["id"], user
        self.bot.reply_later(self.bot.answer(stored))
        return self._passive(user, self.settings.ack_text) if self.settings.ack_text else Response(b"")

    def _passive(self, user: str, text: str) -> Response:
        """An encrypted passive reply, shown to the user at once."""
        now = int(time.time())
        body = wecom_crypto.reply_envelope(self.settings.token or "", self._key, self.corp_id,
                                           text_reply(user, self.corp_id, text, now), str(now), secrets.token_hex(8))
        return Response(body.encode(), media_type="application/xml")

    # -- replies out ----------------------------------------------------------------------------------

    async def deliver(self, message: dict[str, Any]) -> bool:
        await self.send_text(message["user_id"], message["reply"] or "")
        return True

    async def send_text(self, user_id: str, text: str) -> None:
        """A text message to one user, in pieces the send API accepts; ``DeliveryError`` when it fails."""
        for piece in split_text(text):
            await self._send({"touser": user_id, "msgtype": "text", "agentid": self.settings.agent_id,
                              "text": {"content": piece}, "safe": 0})

    async def message(self, user_id: str, text: str) -> None:
        """``send_message``'s way out: a failure is the tool's error, told to the model."""
        try:
            await self.send_text(user_id, text)
        except DeliveryError as exc:
            raise ToolError(str(exc)) from None

    async def _send(self, payload: dict[str, Any]) -> None:
        for fresh in (False, True):
            token = await self._access_token(refresh=fresh)
            answer = await self._call("POST", "/cgi-bin/message/send", params={"access_token": token}, json=payload)
            code = answer.get("errcode", 0)
            if code == 0:
                return
            if code not in TOKEN_ERRORS:
                raise DeliveryError(f"WeCom send failed: {code} {answer.get('errmsg', '')}", retryable=code == BUSY)
        raise DeliveryError("WeCom refused a freshly taken access token")

    async def _access_token(self, *, refresh: bool) -> str:
        now = time.monotonic()
        if self._token is None or refresh or now >= self._token[1]:
            answer = await self._call("GET", "/cgi-bin/gettoken", params={"corpid": self.corp_id,
                                                                          "corpsecret": self.settings.corp_secret})
            token = answer.get("access_token")
            if answer.get("errcode", 0) != 0 or not isinstance(token, str):
                raise DeliveryError(f"WeCom gave no access token: {answer.get('errcode')} {answer.get('errmsg', '')}",
                                    retryable=answer.get("errcode") == BUSY)
            # Renewed five minutes early, so a token never expires between taking it and using it.
            self._token = (token, now + max(60, int(answer.get("expires_in", 7200)) - 300))
        return self._token[0]

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.settings.api_base.rstrip("/"), timeout=10.0,
                                             trust_env=False)
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"WeCom API unreachable: {exc!r}") from None
        if response.status_code >= 400:
            raise DeliveryError(f"WeCom API answered {response.status_code}", retryable=response.status_code >= 500)
        try:
            answer = response.json()
        except ValueError:
            raise DeliveryError("WeCom API answered something that is not JSON") from None
        if not isinstance(answer, dict):
            raise DeliveryError("WeCom API answered something that is not a JSON object")
        return answer

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
