"""WeCom (企业微信) application callbacks: signatures and message encryption, pure functions (no I/O).

As WeCom's callback documentation specifies:

- the signature is the hex SHA-1 of ``token``, ``timestamp``, ``nonce`` and the encrypted text, sorted as strings
  and joined without a separator;
- the AES key is the 43-character ``EncodingAESKey`` base64-decoded (with one ``=`` appended): 32 bytes, AES-256
  in CBC mode, the IV its first 16 bytes;
- the plaintext is 16 random bytes, the message's length as 4 bytes in network order, the message (UTF-8), then
  the receiver id (the corp id); padded PKCS#7-style to a multiple of 32 bytes (not AES's 16); base64 over all.

``CryptoError`` says what failed, without echoing secrets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK = 32  # WeCom pads to 32 bytes


class CryptoError(ValueError):
    """A signature that does not match, a key that is not one, or a message that does not decrypt."""


def aes_key(encoding_aes_key: str) -> bytes:
    """The 32-byte AES key an ``EncodingAESKey`` (43 base64 characters) stands for."""
    if len(encoding_aes_key) != 43:
        raise CryptoError("EncodingAESKey must be 43 characters")
    try:
        key = base64.b64decode(encoding_aes_key + "=", validate=True)
    except binascii.Error:
        raise CryptoError("EncodingAESKey is not base64") from None
    if len(key) != 32:
        raise CryptoError("EncodingAESKey does not decode to 32 bytes")
    return key


def signature(token: str, timestamp: str, nonce: str, encrypted: str) -> str:
    return hashlib.sha1("".join(sorted([token, timestamp, nonce, encrypted])).encode()).hexdigest()


def check_signature(token: str, timestamp: str, nonce: str, encrypted: str, given: str) -> None:
    if not hmac.compare_digest(signature(token, timestamp, nonce, encrypted), given.lower()):
        raise CryptoError("signature does not match")


def encrypt(key: bytes, message: str, receive_id: str, random: bytes | None = None) -> str:
    """``message`` encrypted for WeCom, base64; ``random`` (16 bytes) only for reproducible tests."""
    random = os.urandom(16) if random is None else random
    if len(random) != 16:
        raise CryptoError("the random prefix must be 16 bytes")
    body = message.encode()
    plain = random + struct.pack(">I", len(body)) + body + receive_id.encode()
    pad = BLOCK - len(plain) % BLOCK
    plain += bytes([pad]) * pad
    encryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).encryptor()
    return base64.b64encode(encryptor.update(plain) + encryptor.finalize()).decode()


def decrypt(key: bytes, encrypted: str, receive_id: str) -> str:
    """The message inside ``encrypted``, which must name ``receive_id`` as its receiver."""
    try:
        data = base64.b64decode(encrypted, validate=True)
    except binascii.Error:
        raise CryptoError("the encrypted text is not base64") from None
    if not data or len(data) % 16:
        raise CryptoError("the encrypted text is not whole AES blocks")
    decryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).decryptor()
    plain = decryptor.update(data) + decryptor.finalize()
    pad = plain[-1]
    if not 1 <= pad <= BLOCK or plain[-pad:] != bytes([pad]) * pad:
        raise CryptoError("bad padding: wrong key, or not a WeCom message")
    plain = plain[:-pad]
    if len(plain) < 20:
        raise CryptoError("the decrypted text is too short")
    (length,) = struct.unpack(">I", plain[16:20])
    body, receiver = plain[20:20 + length], plain[20 + length:]
    if len(body) != length:
        raise CryptoError("the decrypted text is shorter than its stated length")
    if not hmac.compare_digest(receiver, receive_id.encode()):
        raise CryptoError("the message is for another receiver (corp id)")
    try:
        return body.decode()
    except UnicodeDecodeError:
        raise CryptoError("the message is not UTF-8") from None


def verify_url(token: str, key: bytes, receive_id: str, msg_signature: str, timestamp: str, nonce: str,
               echostr: str) -> str:
    """The URL-verification handshake: check the signature over ``echostr`` and return what it decrypts to."""
    check_signature(token, timestamp, nonce, echostr, msg_signature)
    return decrypt(key, echostr, receive_id)


def reply_envelope(token: str, key: bytes, receive_id: str, message: str, timestamp: str, nonce: str,
                   random: bytes | None = None) -> str:
    """A passive reply as WeCom expects it: the encrypted message, its signature, timestamp and nonce, in XML."""
    if not (timestamp.isdigit() and nonce.isalnum()):
        raise CryptoError("timestamp must be digits and nonce letters and digits")
    encrypted = encrypt(key, message, receive_id, random)
    sig = signature(token, timestamp, nonce, encrypted)
    return (f"<xml><Encrypt><![CDATA[{encrypted}]]></Encrypt><MsgSignature><![CDATA[{sig}]]></MsgSignature>"
            f"<TimeStamp>{timestamp}</TimeStamp><Nonce><![CDATA[{nonce}]]></Nonce></xml>")
