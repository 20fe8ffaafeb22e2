"""The WeCom adapter on a real gateway: WeCom's side of every exchange is played by wechatpy's enterprise crypto
(an independent implementation), and its send-message API by a loopback stand-in."""

from __future__ import annotations

import re
import sqlite3
import time

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from wechatpy.enterprise.crypto import WeChatCrypto

from gateway.bot.wecom import parse_xml, split_text, text_reply
from tests.gateway.bot.conftest import bot_gateway
from tests.standin import ServerThread

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


def _wecom(api_url: str, ack: str = "") -> dict:
    extra = f"""[bot.wecom]
corp_id = "{CORP_ID}"
agent_id = 1000002
api_base = "{api_url}"
ack_text = "{ack}"
"""
    return {"extra": extra, "env": {"HARNESS_WECOM_TOKEN": TOKEN, "HARNESS_WECOM_AES_KEY": AES_KEY,
                                    "HARNESS_WECOM_SECRET": SECRET}}


def _inner(text: str, msg_id: str, user: str = "zhangsan", kind: str = "text") -> str:
    return (f"<xml><ToUserName><![CDATA[{CORP_ID}]]></ToUserName><FromUserName><![CDATA[{user}]]></FromUserName>"
            f"<CreateTime>1409659813</CreateTime><MsgType><![CDATA[{kind}]]></MsgType>"
            f"<Content><![CDATA[{text}]]></Content><MsgId>{msg_id}</MsgId><AgentID>1000002</AgentID></xml>")


def _post(url: str, inner: str, nonce: str = "1372623149", crypto: WeChatCrypto = CRYPTO,
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


def _passive_text(response: httpx.Response) -> str:
    fields = parse_xml(response.content)
    plain = CRYPTO.decrypt_message(response.text, fields["MsgSignature"], fields["TimeStamp"], fields["Nonce"])
    return parse_xml(plain)["Content"]


@pytest.mark.integration
def test_the_url_handshake_echoes_what_wecom_encrypted(tmp_path) -> None:
    with bot_gateway(tmp_path, [], **_wecom("http://127.0.0.1:9")) as gw:
        timestamp, nonce = "1409659589", "263014780"
        echo = CRYPTO.encrypt_message("echo-4388415120", nonce, timestamp)  # wechatpy builds the echostr
        fields = parse_xml(echo)
        answer = httpx.get(gw.url + "/bot/wecom/callback", params={
            "msg_signature": fields["MsgSignature"], "timestamp": timestamp, "nonce": nonce,
            "echostr": fields["Encrypt"]})
        assert answer.status_code == 200 and answer.text == "echo-4388415120"
        forged = httpx.get(gw.url + "/bot/wecom/callback", params={
            "msg_signature": "0" * 40, "timestamp": timestamp, "nonce": nonce, "echostr": fields["Encrypt"]})
        assert forged.status_code == 401


@pytest.mark.integration
def test_a_message_is_acknowledged_at_once_retries_are_dropped_and_the_reply_is_sent(tmp_path) -> None:
    api = SendAPI()
    with ServerThread(api.app) as wecom_api, \
            bot_gateway(tmp_path, ["你好，张三！"], delay=1.0, **_wecom(wecom_api.url, ack="收到，正在处理…")) as gw:
        started = time.monotonic()
        first = _post(gw.url, _inner("你好", "4561255354251345929"))
        assert first.status_code == 200 and time.monotonic() - started < 0.9  # before the model answered
        assert _passive_text(first) == "收到，正在处理…"
        # WeCom's retry of the same MsgId, and a forged signature, change nothing
        assert _post(gw.url, _inner("你好", "4561255354251345929"), nonce="99").content == b""
        assert _post(gw.url, _inner("hi", "1"), crypto=WeChatCrypto("not-the-token", AES_KEY, CORP_ID)
                     ).status_code == 401
        api.wait(1)
        assert api.sent == [{"token": "token-2", "touser": "zhangsan", "msgtype": "text", "agentid": 1000002,
                             "text": {"content": "你好，张三！"}, "safe": 0}]
        assert (api.tokens, api.refused) == (2, 1)  # the expired token was renewed once
        assert len(gw.backend.requests) == 1
    db = sqlite3.connect(tmp_path / "h.db")
    assert db.execute("SELECT platform, external_id, status, reply FROM bot_messages").fetchall() == [
        ("wecom", "4561255354251345929", "delivered", "你好，张三！")]


@pytest.mark.integration
def test_non_text_messages_and_rate_limits_get_a_passive_reply(tmp_path) -> None:
    with bot_gateway(tmp_path, ["a", "b"], rate=1, **_wecom("http://127.0.0.1:9")) as gw:
        assert _passive_text(_post(gw.url, _inner("", "5", kind="image"))) == "I can only read text messages."
        assert _post(gw.url, _inner("one", "6")).content == b""
        assert _post(gw.url, _inner("one", "6"), nonce="2").content == b""  # WeCom's retry is not the user's
        assert "too fast" in _passive_text(_post(gw.url, _inner("two", "7")))
        assert _post(gw.url, _inner("  ", "9")).content == b""  # an empty text is not a turn
        event = _post(gw.url, _inner("", "8", kind="event"))
        assert event.status_code == 200 and event.content == b""
        bad = httpx.post(gw.url + "/bot/wecom/callback", content=b"<xml><Encrypt>", params={
            "msg_signature": "x", "timestamp": "1", "nonce": "2"})
        assert bad.status_code == 400
    stored = sqlite3.connect(tmp_path / "h.db").execute("SELECT external_id FROM bot_messages").fetchall()
    assert stored == [("6",)]


def test_the_passive_reply_plaintext_and_long_replies_are_cut_for_the_send_api() -> None:
    xml = text_reply("zhangsan", CORP_ID, "a ]]> b", 1)
    assert parse_xml(xml) == {"ToUserName": "zhangsan", "FromUserName": CORP_ID, "CreateTime": "1",
                              "MsgType": "text", "Content": "a ]]> b"}
    text = ("第一行\n" * 400) + "末"
    pieces = split_text(text)
    assert "".join(pieces) == text and all(len(p.encode()) <= 2048 for p in pieces) and len(pieces) > 1
    assert all(p.endswith("\n") for p in pieces[:-1])
    assert split_text("") == [""] and split_text("short") == ["short"]
    with pytest.raises(ValueError, match="not a WeCom XML"):
        parse_xml('<!DOCTYPE x [<!ENTITY a "aaaa">]><xml><A>&a;</A></xml>')


@pytest.mark.integration
def test_an_outgoing_message_waits_for_approval_then_goes_through_the_send_api(tmp_path) -> None:
    from tests.scripted import call

    api = SendAPI()
    script = [call("send_message", {"to": "lisi", "text": "The meeting moved to 3 pm."}), "I told Li Si."]
    with ServerThread(api.app) as wecom_api, bot_gateway(tmp_path, script, **_wecom(wecom_api.url)) as gw:
        _post(gw.url, _inner("Tell Li Si the meeting moved to 3 pm.", "42"))
        deadline = time.monotonic() + 10
        while not (held := gw.admin("GET", "/admin/approvals").json()["data"]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert (held[0]["tool"], held[0]["arguments"]["to"]) == ("send_message", "lisi")
        assert api.sent == []  # nothing goes out before a person says so
        gw.admin("POST", f"/admin/approvals/{held[0]['id']}/approve")
        api.wait(2)
        assert [(m["touser"], m["text"]["content"]) for m in api.sent] == [
            ("lisi", "The meeting moved to 3 pm."), ("zhangsan", "I told Li Si.")]
