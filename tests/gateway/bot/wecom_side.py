"""WeCom's side of every exchange, for the WeCom tests and bench/bot.py: its enterprise crypto played by wechatpy
(an independent implementation), its send-message API by a loopback stand-in, and the messages it sends."""

from __future__ import annotations

import re
import time

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from wechatpy.enterprise.crypto import WeChatCrypto

from gateway.bot.wecom import parse_xml

TOKEN = "QDG6eK"
AES_KEY = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C"
CORP_ID = "wx5823bf96d3bd56c7"
SECRET = "app-secret"
CRYPTO = WeChatCrypto(TOKEN, AES_KEY, CORP_ID)


class SendAPI:
    """WeCom's gettoken and message/send: the first send says the token expired, so the adapter must renew it."""

    def __init__(self) -> None:
        self.tokens = 0
        self.sent: list[dict] = []
        self.refused = 0
        self.app = Starlette(routes=[Route("/cgi-bin/gettoken", self.gettoken),
                                     Route("/cgi-bin/message/send", self.send, methods=["POST"])])

    async def gettoken(self, request: Request) -> Response:
        assert (request.query_params["corpid"], request.query_params["corpsecret"]) == (CORP_ID, SECRET)
        self.tokens += 1
        return Response(orjson.dumps({"errcode": 0, "errmsg": "ok", "access_token": f"token-{self.tokens}",
                                      "expires_in": 7200}), media_type="application/json")

    async def send(self, request: Request) -> Response:
        if request.query_params["access_token"] == "token-1" and not self.refused:
            self.refused += 1
            return Response(orjson.dumps({"errcode": 42001, "errmsg": "access_token expired"}))
        self.sent.append({"token": request.query_params["access_token"], **orjson.loads(await request.body())})
        return Response(orjson.dumps({"errcode": 0, "errmsg": "ok", "msgid": f"m{len(self.sent)}"}))

    def wait(self, count: int) -> None:
        deadline = time.monotonic() + 20
        while len(self.sent) < count:
            assert time.monotonic() < deadline, self.sent
            time.sleep(0.02)


def wecom_config(api_url: str, ack: str = "") -> dict:
    extra = f"""[bot.wecom]
corp_id = "{CORP_ID}"
agent_id = 1000002
api_base = "{api_url}"
ack_text = "{ack}"
"""
    return {"extra": extra, "env": {"HARNESS_WECOM_TOKEN": TOKEN, "HARNESS_WECOM_AES_KEY": AES_KEY,
                                    "HARNESS_WECOM_SECRET": SECRET}}


def wecom_message(text: str, msg_id: str, user: str = "zhangsan", kind: str = "text") -> str:
    return (f"<xml><ToUserName><![CDATA[{CORP_ID}]]></ToUserName><FromUserName><![CDATA[{user}]]></FromUserName>"
            f"<CreateTime>1409659813</CreateTime><MsgType><![CDATA[{kind}]]></MsgType>"
            f"<Content><![CDATA[{text}]]></Content><MsgId>{msg_id}</MsgId><AgentID>1000002</AgentID></xml>")


def post_as_wecom(url: str, inner: str, nonce: str = "1372623149", crypto: WeChatCrypto = CRYPTO,
          client: httpx.Client | None = None) -> httpx.Response:
    """What WeCom sends: the encrypted message in an XML envelope, its signature in the query."""
    timestamp = str(int(time.time()))
    envelope = crypto.encrypt_message(inner, nonce, timestamp)
    signature = re.search(r"<MsgSignature><!\[CDATA\[(.*?)\]\]>", envelope).group(1)
    encrypt = re.search(r"<Encrypt><!\[CDATA\[(.*?)\]\]>", envelope).group(1)
    body = (f"<xml><ToUserName><![CDATA[{CORP_ID}]]></ToUserName><Encrypt><![CDATA[{encrypt}]]></Encrypt>"
            f"<AgentID><![CDATA[1000002]]></AgentID></xml>")
    return (client or httpx).post(url + "/bot/wecom/callback", content=body.encode(), timeout=10,
                                  params={"msg_signature": signature, "timestamp": timestamp, "nonce": nonce})


def passive_text(response: httpx.Response) -> str:
    fields = parse_xml(response.content)
    plain = CRYPTO.decrypt_message(response.text, fields["MsgSignature"], fields["TimeStamp"], fields["Nonce"])
    return parse_xml(plain)["Content"]
