"""The WeCom adapter on a real gateway: WeCom's side of every exchange is played by wechatpy's enterprise crypto
(an independent implementation), and its send-message API by a loopback stand-in."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from wechatpy.enterprise.crypto import WeChatCrypto

from gateway.bot.wecom import parse_xml, split_text, text_reply
from tests.gateway.bot.support import bot_gateway
from tests.gateway.bot.wecom_side import (
    AES_KEY,
    CORP_ID,
    CRYPTO,
    SendAPI,
    passive_text,
    post_as_wecom,
    wecom_config,
    wecom_message,
)
from tests.standin import ServerThread


@pytest.mark.integration
def test_the_url_handshake_echoes_what_wecom_encrypted(tmp_path) -> None:
    with bot_gateway(tmp_path, [], **wecom_config("http://127.0.0.1:9")) as gw:
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
            bot_gateway(tmp_path, ["你好，张三！"], delay=1.0,
                        **wecom_config(wecom_api.url, ack="收到，正在处理…")) as gw:
        started = time.monotonic()
        first = post_as_wecom(gw.url, wecom_message("你好", "4561255354251345929"))
        assert first.status_code == 200 and time.monotonic() - started < 0.9  # before the model answered
        assert passive_text(first) == "收到，正在处理…"
        # WeCom's retry of the same MsgId, and a forged signature, change nothing
        assert post_as_wecom(gw.url, wecom_message("你好", "4561255354251345929"), nonce="99").content == b""
        assert post_as_wecom(gw.url, wecom_message("hi", "1"), crypto=WeChatCrypto("not-the-token", AES_KEY, CORP_ID)
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
    with bot_gateway(tmp_path, ["a", "b"], rate=1, **wecom_config("http://127.0.0.1:9")) as gw:
        image = post_as_wecom(gw.url, wecom_message("", "5", kind="image"))
        assert passive_text(image) == "I can only read text messages."
        assert post_as_wecom(gw.url, wecom_message("one", "6")).content == b""
        # WeCom's retry is not the user's
        assert post_as_wecom(gw.url, wecom_message("one", "6"), nonce="2").content == b""
        assert "too fast" in passive_text(post_as_wecom(gw.url, wecom_message("two", "7")))
        assert post_as_wecom(gw.url, wecom_message("  ", "9")).content == b""  # an empty text is not a turn
        event = post_as_wecom(gw.url, wecom_message("", "8", kind="event"))
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
    with ServerThread(api.app) as wecom_api, bot_gateway(tmp_path, script, **wecom_config(wecom_api.url)) as gw:
        post_as_wecom(gw.url, wecom_message("Tell Li Si the meeting moved to 3 pm.", "42"))
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
