"""The OpenAI-compatible backend's request body: what it refuses to forward."""

import pytest

from gateway.backends.base import BackendError, ChatRequest
from gateway.backends.openai_compat import OpenAICompatBackend
from gateway.config import BackendSettings


def test_constrain_tool_calls_is_refused_by_name_not_forwarded() -> None:
    backend = OpenAICompatBackend(BackendSettings(name="up", kind="openai", base_url="http://127.0.0.1:9/v1",
                                                  models=["m"]))
    body = {"messages": [{"role": "user", "content": "hi"}], "constrain_tool_calls": True}
    with pytest.raises(BackendError) as caught:
        backend._body(ChatRequest(body=body, model="m"), stream=False)
    assert caught.value.status_code == 400 and caught.value.param == "constrain_tool_calls"
    forwarded = backend._body(ChatRequest(body={**body, "constrain_tool_calls": False}, model="m"), stream=False)
    assert "constrain_tool_calls" not in forwarded
