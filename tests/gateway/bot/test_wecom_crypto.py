"""WeCom callback crypto against an independent implementation (wechatpy's enterprise crypto) and fixed vectors."""

from __future__ import annotations

import base64
import re

import pytest
from wechatpy.enterprise.crypto import WeChatCrypto

from gateway.bot import wecom_crypto as wc

TOKEN = "QDG6eK"
ENCODING_AES_KEY = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C"
CORP_ID = "wx5823bf96d3bd56c7"
KEY = wc.aes_key(ENCODING_AES_KEY)
MESSAGE = ("<xml><ToUserName><![CDATA[wx5823bf96d3bd56c7]]></ToUserName><FromUserName><![CDATA[mycreate]]>"
           "</FromUserName><CreateTime>1409659813</CreateTime><MsgType><![CDATA[text]]></MsgType>"
           "<Content><![CDATA[hello, 你好]]></Content><MsgId>4561255354251345929</MsgId><AgentID>218</AgentID></xml>")


def _field(xml: str, name: str) -> str:
    match = re.search(rf"<{name}>(?:<!\[CDATA\[)?(.*?)(?:\]\]>)?</{name}>", xml)
    assert match, name
    return match.group(1)


def test_the_key_is_the_encoding_key_base64_decoded() -> None:
    assert KEY == base64.b64decode(ENCODING_AES_KEY + "=") and len(KEY) == 32
    for bad in ("short", ENCODING_AES_KEY[:-1] + "!"):
        with pytest.raises(wc.CryptoError):
            wc.aes_key(bad)


def test_signature_is_sha1_of_the_sorted_parts() -> None:
    # sorted: "1409659813" < "1372623149" is false; by hand: ["1372623149", "1409659813", "QDG6eK", "abc"]
    import hashlib

    expected = hashlib.sha1(b"13726231491409659813QDG6eKabc").hexdigest()
    assert wc.signature(TOKEN, "1409659813", "1372623149", "abc") == expected
    wc.check_signature(TOKEN, "1409659813", "1372623149", "abc", expected.upper())
    with pytest.raises(wc.CryptoError, match="signature"):
        wc.check_signature(TOKEN, "1409659813", "1372623149", "abd", expected)


def test_a_fixed_vector_encrypts_and_decrypts() -> None:
    random = bytes(range(16))
    encrypted = wc.encrypt(KEY, "hello", CORP_ID, random)
    # 16 random + 4 length + 5 message + 18 corp id = 43 bytes, padded to 64: 64 bytes of ciphertext.
    assert len(base64.b64decode(encrypted)) == 64
    assert wc.encrypt(KEY, "hello", CORP_ID, random) == encrypted  # deterministic given the random prefix
    assert wc.decrypt(KEY, encrypted, CORP_ID) == "hello"
    assert wc.encrypt(KEY, "hello", CORP_ID) != encrypted  # a fresh random prefix otherwise


def test_url_verification_agrees_with_wechatpy() -> None:
    echostr = wc.encrypt(KEY, "echo-4388415120", CORP_ID)
    sig = wc.signature(TOKEN, "1409659589", "263014780", echostr)
    assert wc.verify_url(TOKEN, KEY, CORP_ID, sig, "1409659589", "263014780", echostr) == "echo-4388415120"
    theirs = WeChatCrypto(TOKEN, ENCODING_AES_KEY, CORP_ID)
    assert theirs.check_signature(sig, "1409659589", "263014780", echostr) == "echo-4388415120"


def test_messages_wechatpy_encrypts_decrypt_here() -> None:
    theirs = WeChatCrypto(TOKEN, ENCODING_AES_KEY, CORP_ID)
    envelope = theirs.encrypt_message(MESSAGE, "1372623149", "1409659813")
    encrypted, sig = _field(envelope, "Encrypt"), _field(envelope, "MsgSignature")
    wc.check_signature(TOKEN, "1409659813", "1372623149", encrypted, sig)
    assert wc.decrypt(KEY, encrypted, CORP_ID) == MESSAGE


def test_replies_encrypted_here_decrypt_in_wechatpy() -> None:
    envelope = wc.reply_envelope(TOKEN, KEY, CORP_ID, MESSAGE, "1409659813", "1372623149")
    theirs = WeChatCrypto(TOKEN, ENCODING_AES_KEY, CORP_ID)
    assert theirs.decrypt_message(envelope, _field(envelope, "MsgSignature"), "1409659813", "1372623149") == MESSAGE


def test_tampering_a_wrong_key_or_another_receiver_is_refused() -> None:
    encrypted = wc.encrypt(KEY, "hello", CORP_ID)
    with pytest.raises(wc.CryptoError, match="another receiver"):
        wc.decrypt(KEY, encrypted, "wx0000000000000000")
    other = wc.aes_key("A" * 43)
    with pytest.raises(wc.CryptoError):
        wc.decrypt(other, encrypted, CORP_ID)
    with pytest.raises(wc.CryptoError, match="base64"):
        wc.decrypt(KEY, "not base64!", CORP_ID)
    with pytest.raises(wc.CryptoError, match="whole AES blocks"):
        wc.decrypt(KEY, base64.b64encode(b"x" * 17).decode(), CORP_ID)
    with pytest.raises(wc.CryptoError):
        wc.reply_envelope(TOKEN, KEY, CORP_ID, "hi", "1409659813", "x]]><y")
