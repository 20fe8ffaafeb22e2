"""Signed bot requests and callbacks, pure (no I/O): who may talk to the bot, and proof of what we send back.

A request carries ``X-Harness-Timestamp`` (unix seconds), ``X-Harness-Nonce`` and ``X-Harness-Signature``: the hex
HMAC-SHA256, keyed with the bot's shared secret, of ``timestamp + "." + nonce + "." + raw body``. ``verify`` checks
the signature (in constant time) and that the timestamp lies within the window; whether the nonce was seen before
is the store's to say (``replay.keys.claim_nonce``), so a restart does not reopen it. Callbacks are signed the
same way (``signed_headers``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

TIMESTAMP = "X-Harness-Timestamp"
NONCE = "X-Harness-Nonce"
SIGNATURE = "X-Harness-Signature"
MAX_NONCE = 128
MAX_TIMESTAMP_DIGITS = 12  # unix seconds until the year 33658


class SignatureError(ValueError):
    """Why a request is refused (401): the message is safe to show the caller."""


@dataclass(frozen=True)
class Signed:
    timestamp: int
    nonce: str


def sign(secret: bytes, timestamp: str, nonce: str, body: bytes) -> str:
    return hmac.new(secret, f"{timestamp}.{nonce}.".encode() + body, hashlib.sha256).hexdigest()


def signed_headers(secret: bytes, body: bytes, now: float, nonce: str | None = None) -> dict[str, str]:
    """The three headers that sign ``body`` at ``now``."""
    timestamp, nonce = str(int(now)), nonce or secrets.token_hex(16)
    return {TIMESTAMP: timestamp, NONCE: nonce, SIGNATURE: sign(secret, timestamp, nonce, body)}


def verify(secret: bytes, headers: Mapping[str, str], body: bytes, now: float, window: float) -> Signed:
    """The signed timestamp and nonce of a request, or ``SignatureError`` saying why it is refused."""
    lowered = {k.lower(): v for k, v in headers.items()}
    timestamp, nonce, given = (lowered.get(h.lower()) for h in (TIMESTAMP, NONCE, SIGNATURE))
    if not timestamp or not nonce or not given:
        raise SignatureError(f"Signed requests need the headers {TIMESTAMP}, {NONCE} and {SIGNATURE}.")
    # ASCII digits only (int() takes other scripts' digits too), and few enough to be a time: a 400-digit number
    # would overflow the comparison with the clock.
    if not (timestamp.isascii() and timestamp.isdigit()) or len(timestamp) > MAX_TIMESTAMP_DIGITS:
        raise SignatureError(f"{TIMESTAMP} must be unix seconds.")
    if len(nonce) > MAX_NONCE or not nonce.isprintable():
        raise SignatureError(f"{NONCE} must be at most {MAX_NONCE} printable characters.")
    if not hmac.compare_digest(sign(secret, timestamp, nonce, body), given.lower()):
        raise SignatureError("The signature does not match the body.")
    if abs(now - int(timestamp)) > window:
        raise SignatureError(f"The timestamp is more than {window:g} s away from now.")
    return Signed(int(timestamp), nonce)
