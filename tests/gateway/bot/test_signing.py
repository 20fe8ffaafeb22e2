"""Signed bot requests: the HMAC over timestamp, nonce and body, the time window, and refusals that say why."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from gateway.bot.signing import NONCE, SIGNATURE, TIMESTAMP, SignatureError, sign, signed_headers, verify

SECRET = b"shared-secret"
BODY = b'{"conversation_id": "c1", "user_id": "u1", "text": "hi"}'
NOW = 1_800_000_000.0


def test_the_signature_is_hmac_sha256_over_timestamp_nonce_and_body() -> None:
    expected = hmac.new(SECRET, b"1800000000.n-1." + BODY, hashlib.sha256).hexdigest()
    assert sign(SECRET, "1800000000", "n-1", BODY) == expected


def test_signed_headers_verify_and_give_back_timestamp_and_nonce() -> None:
    headers = signed_headers(SECRET, BODY, NOW, nonce="abc")
    assert headers[TIMESTAMP] == "1800000000" and headers[NONCE] == "abc"
    signed = verify(SECRET, {k.lower(): v for k, v in headers.items()}, BODY, NOW + 10, window=300)
    assert (signed.timestamp, signed.nonce) == (1_800_000_000, "abc")
    assert signed_headers(SECRET, BODY, NOW)[NONCE] != signed_headers(SECRET, BODY, NOW)[NONCE]


@pytest.mark.parametrize(("change", "reason"), [
    (lambda h, b: (h, b + b" "), "does not match"),
    (lambda h, b: ({**h, SIGNATURE: "0" * 64}, b), "does not match"),
    (lambda h, b: ({**h, NONCE: "other"}, b), "does not match"),
    (lambda h, b: ({k: v for k, v in h.items() if k != NONCE}, b), "need the headers"),
    (lambda h, b: ({**h, TIMESTAMP: "yesterday"}, b), "unix seconds"),
    (lambda h, b: ({**h, NONCE: "x" * 200}, b), "at most 128"),
])
def test_tampered_or_incomplete_requests_are_refused(change, reason) -> None:
    headers, body = change(signed_headers(SECRET, BODY, NOW, nonce="abc"), BODY)
    with pytest.raises(SignatureError, match=reason):
        verify(SECRET, headers, body, NOW, window=300)


@pytest.mark.parametrize("timestamp", ["9" * 400, "1800000000" + "0" * 3, "\u00b2", "1_800_000_000", "-1"])
def test_timestamps_that_are_not_unix_seconds_are_refused_even_when_signed(timestamp: str) -> None:
    # Signed with the right secret: the refusal must come from the timestamp itself, never an overflow.
    headers = {TIMESTAMP: timestamp, NONCE: "abc", SIGNATURE: sign(SECRET, timestamp, "abc", BODY)}
    with pytest.raises(SignatureError, match="unix seconds|300 s away"):
        verify(SECRET, headers, BODY, NOW, window=300)


def test_timestamps_outside_the_window_are_refused_either_way() -> None:
    headers = signed_headers(SECRET, BODY, NOW)
    verify(SECRET, headers, BODY, NOW + 300, window=300)
    for now in (NOW + 301, NOW - 301):
        with pytest.raises(SignatureError, match="300 s away"):
            verify(SECRET, headers, BODY, now, window=300)
    with pytest.raises(SignatureError, match="does not match"):
        verify(b"another secret", headers, BODY, NOW, window=300)
