"""An Anthropic Messages request as a chat-completions body, for the chat backends.

What a chat backend cannot take (thinking settings and signatures, server tools, block and field types it has
no counterpart for, a new release's additions) is dropped and named in ``Translated.dropped``, never refused:
the next Claude Code release must degrade, not break. ``cache_control`` is a hint chat backends do not take;
it is left out without a word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

# Top-level fields this translation reads; every other one is dropped and named.
_CONSUMED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                       "stream", "tools", "tool_choice", "metadata", "thinking", "service_tier", "cache_control"})
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass
class Translated:
    body: dict[str, Any]  # an OpenAI chat-completions body
    dropped: list[str] = field(default_factory=list)  # "field:<key>", "block:<type>", "tool:<type>", ...

    def drop(self, what: str) -> None:
        if what not in self.dropped:
            self.dropped.append(what)


def block_text(content: Any) -> str:
    """A system prompt or tool result's text: a string as is, text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def messages_to_chat(body: dict[str, Any]) -> Translated:
    out = Translated(body={"model": body.get("model"), "messages": []})
    chat = out.body
    for key in body:
        if key not in _CONSUMED:
            out.drop(f"field:{key}")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") != "disabled":
        out.drop("field:thinking")
    system = block_text(body.get("system"))
    if system:
        chat["messages"].append({"role": "system", "content": system})
    for message in body.get("messages") or []:
        if message.get("role") == "system":
            _system_in_conversation(chat["messages"], block_text(message.get("content")))
        else:
            chat["messages"] += _message(message, out)
    tools = _tools(body.get("tools"), out)
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            kind = choice.get("type")
            if kind == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
            elif kind in _CHOICES:
                chat["tool_choice"] = _CHOICES[kind]
            if choice.get("disable_parallel_tool_use") is True and kind != "none":
                chat["parallel_tool_calls"] = False
    for source, target in (("max_tokens", "max_tokens"), ("stop_sequences", "stop"), ("temperature", "temperature"),
                           ("top_p", "top_p"), ("top_k", "top_k"), ("stream", "stream")):
        if body.get(source) is not None:
            chat[target] = body[source]
    return out


def _system_in_conversation(messages: list[dict[str, Any]], text: str) -> None:
    """A system message inside the conversation (newer Claude Code releases put their environment and reminders
    there). Many chat templates take a system message only first (Mistral's refuses any other), and a small model
    answers whatever comes last: so it becomes context of the user message it follows, ahead of that message's
    own words, which stay last; after anything else it is a user message of its own. Each history translates the
    same way every time, so the conversation's prefix stays stable for stitching."""
    last = messages[-1] if messages else None
    if last is None or (last["role"] == "system" and len(messages) == 1):
        if last is None:
            messages.append({"role": "system", "content": text})
        else:
            last["content"] = f"{last['content']}\n\n{text}"
    elif last["role"] == "user" and isinstance(last["content"], str):
        last["content"] = f"{text}\n\n{last['content']}"
    else:
        messages.append({"role": "user", "content": text})


def _message(message: dict[str, Any], out: Translated) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [b for b in content or [] if isinstance(b, dict)]
    return _assistant(blocks, out) if role == "assistant" else _user(blocks, out)


def _user(blocks: list[dict[str, Any]], out: Translated) -> list[dict[str, Any]]:
    """Tool results first, as chat ``tool`` messages (they answer the assistant's calls just before), then the rest."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block, out)})
        elif kind == "text":
            parts.append({"type": "text", "text": block.get("text") or ""})
        elif kind == "image" and (url := _image_url(block.get("source"))):
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            out.drop(f"block:{kind}")
    if not parts:
        return results
    if all(p["type"] == "text" for p in parts):
        return [*results, {"role": "user", "content": "\n".join(p["text"] for p in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _result_text(block: dict[str, Any], out: Translated) -> str:
    content = block.get("content")
    if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") != "text" for b in content):
        out.drop("block:image_in_tool_result")
    text = block_text(content)
    # Chat has no error flag on a tool message: the model reads it in the text.
    return f"Error: {text}" if block.get("is_error") is True else text


def _image_url(source: Any) -> str | None:
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    return None


def _assistant(blocks: list[dict[str, Any]], out: Translated) -> list[dict[str, Any]]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text") or "")
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": orjson.dumps(block.get("input") or {}).decode()}})
        elif kind == "thinking":
            thinking.append(block.get("thinking") or "")
            if block.get("signature"):
                out.drop("thinking_signature")
        else:
            out.drop(f"block:{kind}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(tools: Any, out: Translated) -> list[dict[str, Any]]:
    functions = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind not in (None, "custom"):  # a server tool (web search, code execution): the chat backend has none
            out.drop(f"tool:{kind}")
            continue
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        functions.append({"type": "function", "function": function})
    return functions
