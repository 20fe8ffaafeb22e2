"""Redaction is pure: planted secrets go, ordinary text stays, and the JSON pre-check never misses one."""

from __future__ import annotations

import orjson
import pytest

from replay.redact import Redactor

KEY = "sk-proj-" + "a1B2c3D4e5F6g7H8i9J0k1L2"
HARNESS_KEY = "sk-harness-" + "Zx_9-qwertyuiopASDFGHJKLzxcvbnm"
AWS = "AKIAIOSFODNN7EXAMPLE"
GITHUB = "ghp_" + "a1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"

CASES = [
    (f"my key is {KEY}.", "[REDACTED:api_key]", KEY),
    (f"export OPENAI_API_KEY={HARNESS_KEY}", "[REDACTED:api_key]", HARNESS_KEY),
    (f"aws {AWS} here", "[REDACTED:aws_key]", AWS),
    (f"token {GITHUB}", "[REDACTED:github_token]", GITHUB),
    ("curl -H 'Authorization: Bearer abc.def-123_x' https://x", "Authorization: Bearer [REDACTED:bearer]",
     "abc.def-123_x"),
    ('{"Authorization": "Basic dXNlcjpwYXNz"}', "[REDACTED:bearer]", "dXNlcjpwYXNz"),
    (f"Bearer {JWT}", "Bearer [REDACTED:bearer]", JWT),
    (f"jwt={JWT}", "[REDACTED:jwt]", JWT),
    ("api_key=0123456789abcdef0123456789abcdef", "api_key=[REDACTED:secret]", "0123456789abcdef"),
    ('{"token": "ZXhhbXBsZTEyMzQ1Njc4OTA="}', '"token": "[REDACTED:secret]"', "ZXhhbXBsZTEy"),
    ("password=hunter2 ok", "password=[REDACTED:password] ok", "hunter2"),
    ("write to jane.doe+ml@example.co.uk today", "[REDACTED:email]", "jane.doe"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "[REDACTED:private_key]", "MIIEow"),
    ("slack xoxb-1234567890-abcdefghij", "[REDACTED:slack_token]", "xoxb-1234567890"),
]

BENIGN = [
    "The bearer bonds matured in 1990.",
    "the token generation step is slow",
    "task-abcdefghijklmnopqrstu and risk-free-investment-strategies",
    "Use the api_key parameter to authenticate.",
    "2 + 2 = 4, see section 3.1",
    "the password field must not be empty",
]


@pytest.mark.parametrize(("text", "expected", "secret"), CASES)
def test_defaults_remove_planted_secrets(text: str, expected: str, secret: str) -> None:
    out = Redactor().text(text)
    assert expected in out
    assert secret not in out


@pytest.mark.parametrize("text", BENIGN)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert Redactor().text(text) == text


@pytest.mark.parametrize(("text", "expected", "secret"), CASES)
def test_the_json_precheck_never_misses_a_secret(text: str, expected: str, secret: str) -> None:
    # Stored bodies are JSON: the pre-check runs on the encoded bytes, where newlines and quotes are escaped.
    r = Redactor()
    for wrapped in (text, f"line one\n{text}\n", f'he said "{text}"'):
        assert r.may_match(orjson.dumps({"role": "user", "content": wrapped}))
        value, changed = r.value({"role": "user", "content": wrapped})
        assert changed and secret not in value["content"]


def test_clean_bodies_skip_decoding() -> None:
    r = Redactor()
    assert not r.may_match(orjson.dumps({"role": "assistant", "content": "The answer is 4."}))
    assert not Redactor(defaults=False).may_match(orjson.dumps({"content": KEY}))


def test_value_redacts_every_string_and_reports_change() -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "http_get",
                                                          "arguments": f'{{"headers": {{"x-key": "{KEY}"}}}}'}}]}
    out, changed = Redactor().value(message)
    assert changed
    assert KEY not in orjson.dumps(out).decode()
    assert out["tool_calls"][0]["id"] == "call_1" and out["role"] == "assistant"
    assert message["tool_calls"][0]["function"]["arguments"].count(KEY) == 1  # the input is not mutated
    same, changed = Redactor().value({"role": "user", "content": [{"type": "text", "text": "hello"}]})
    assert not changed and same == {"role": "user", "content": [{"type": "text", "text": "hello"}]}


def test_custom_patterns_and_switching_defaults_off() -> None:
    r = Redactor(patterns=[r"ACME-\d{6}"])
    assert r.text("ticket ACME-123456 by bob@example.com") == "ticket [REDACTED:custom] by [REDACTED:email]"
    only_custom = Redactor(defaults=False, patterns=[r"ACME-\d{6}"])
    assert only_custom.text("ACME-123456 bob@example.com") == "[REDACTED:custom] bob@example.com"
    assert only_custom.may_match(b'"nothing obvious"')  # custom patterns cannot be pre-checked
    off = Redactor(defaults=False)
    assert not off.active and off.text(KEY) == KEY
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Redactor(patterns=["(unclosed"])
