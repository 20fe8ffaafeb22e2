"""What a chat request asks of the embedded engine: the parameters it honours (a 400 names any other), and the
tools the prompt offers with how their calls are checked."""

from __future__ import annotations

from typing import Any

from gateway.backends.local.sampling import invalid_request

# Parameters the engine honours, and those that concern the gateway or the client rather than generation.
ACCEPTED = frozenset({
    "model", "messages", "stream", "stream_options", "n", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "user", "metadata", "store",
    "service_tier", "prompt_cache_key", "safety_identifier", "ignore_eos", "constrain_tool_calls",
})
# OpenAI parameters this engine cannot honour: a 400 naming them, unless they are null (modalities: text only).
UNSUPPORTED = frozenset({"audio", "prediction", "web_search_options", "reasoning_effort", "verbosity", "functions",
                          "function_call", "modalities"})



def check_parameters(body: dict[str, Any]) -> None:
    """A 400 naming the first parameter this engine would otherwise have to ignore."""
    for key, value in body.items():
        if key in ACCEPTED or (key in UNSUPPORTED and value is None) or (key == "modalities" and value == ["text"]):
            continue
        if key in UNSUPPORTED:
            raise invalid_request(f"Unsupported parameter: '{key}' is not supported by the embedded model.", key,
                                  "unsupported_parameter")
        raise invalid_request(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    if not isinstance(body.get("constrain_tool_calls", False), bool):
        raise invalid_request("constrain_tool_calls must be a boolean", "constrain_tool_calls")


def tools_for(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
    """The tools the prompt offers, after ``tool_choice`` (none, all, or the one named), and how calls of them are
    checked (``output_grammar``'s ``calls``): required, checked (``constrain_tool_calls``) or free."""
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise invalid_request("tools must be a list", "tools")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict) and choice not in ("none", "auto", "required"):
        raise invalid_request("tool_choice must be none, auto, required or a named function", "tool_choice")
    if not tools or choice == "none":
        return None, "free"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        named = [t for t in tools if (t.get("function") or {}).get("name") == name]
        if not named:
            raise invalid_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return named, "required"
    if choice == "required":
        return tools, "required"
    return tools, "checked" if body.get("constrain_tool_calls") else "free"


# A raw-prompt completion (``/v1/completions``): the sampling parameters it shares with chat, and those of the legacy
# API this engine cannot honour unless they are left at what asks for nothing.
COMPLETION_ACCEPTED = frozenset({
    "model", "prompt", "stream", "stream_options", "n", "temperature", "top_p", "max_tokens", "stop", "seed",
    "frequency_penalty", "presence_penalty", "logit_bias", "user", "ignore_eos",
})
_COMPLETION_IDLE: dict[str, tuple[object, ...]] = {"echo": (None, False), "suffix": (None,), "logprobs": (None,)}


def check_completion_parameters(body: dict[str, Any]) -> str | list[int]:
    """The one prompt of a ``/v1/completions`` body (text, or token ids), after a 400 naming the first parameter this
    engine would otherwise have to ignore. Several prompts in one request are refused: each would be a job of its
    own, and the answer's choices would have to be interleaved by prompt."""
    for key, value in body.items():
        if key in COMPLETION_ACCEPTED or value in _COMPLETION_IDLE.get(key, ()):
            continue
        if key == "best_of" and value in (None, body.get("n", 1)):
            continue
        if key in _COMPLETION_IDLE or key == "best_of":
            raise invalid_request(f"Unsupported parameter: '{key}' is not supported by the embedded model.", key,
                                  "unsupported_parameter")
        raise invalid_request(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt[0]
    raise invalid_request("The embedded model completes one prompt per request; send each prompt on its own.",
                          "prompt", "unsupported_value")
