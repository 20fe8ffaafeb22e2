"""OpenAI chat messages (and tool specs) → the exact prompt text and token ids a model sees.

One implementation for serving (the local backend) and training, so a model is trained on exactly
what it is served. Tools go through the tokenizer's chat template when the template knows about
them; otherwise (SmolLM2's template silently drops ``tools``) they are written into the system prompt
in the Hermes format, tool calls become ``<tool_call>`` text and tool results ``<tool_response>``
blocks in a user turn — the format ``gateway.agent.parsing`` reads back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

HERMES_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message],
                  tools: list[dict[str, Any]] | None = None, *, add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` (OpenAI chat format) with ``tools`` (OpenAI tool specs).

    ``add_generation_prompt=False`` renders a finished conversation (for training data).
    """
    tools = tools or None
    if template_supports_tools(tokenizer, tools):
        return tokenizer.apply_chat_template(
            [_native_message(m) for m in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, tokenize=False,
        )
    return tokenizer.apply_chat_template(
        _hermes_messages(messages, tools), add_generation_prompt=add_generation_prompt, tokenize=False,
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message],
                  tools: list[dict[str, Any]] | None = None, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``render_prompt``; the template writes its own special tokens, so none are added."""
    text = render_prompt(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_supports_tools(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None) -> bool:
    """Whether the chat template reads ``tools``; templates that do not, drop them without a word."""
    template = tokenizer.get_chat_template(None, tools)
    return "tools" in template


def message_text(content: Any) -> str:
    """Message content as one string: ``None`` is empty, a list of parts keeps its text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                text = part.get("text", part.get("refusal"))
                if isinstance(text, str):
                    texts.append(text)
        return "\n".join(texts)
    return str(content)


def _role(message: Message) -> str:
    role = message.get("role", "user")
    return "system" if role == "developer" else role


def _arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as an object where the JSON string parses, so templates render them as JSON."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _native_message(message: Message) -> Message:
    out = dict(message, role=_role(message), content=message_text(message.get("content")))
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"],
                                  "arguments": _arguments_object(call["function"].get("arguments"))}}
            for call in message["tool_calls"]
        ]
    return out


def hermes_tools_prompt(tools: Iterable[dict[str, Any]]) -> str:
    """The system-prompt block that declares ``tools`` in the Hermes format."""
    lines = []
    for tool in tools:
        function = tool.get("function", tool)
        lines.append(json.dumps({"type": "function", "function": function}, ensure_ascii=False))
    return HERMES_TOOLS_PROMPT.format(tools="\n".join(lines))


def hermes_tool_call_text(name: str, arguments: Any) -> str:
    payload = {"name": name, "arguments": _arguments_object(arguments)}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def _hermes_messages(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """Plain ``{role, content}`` messages that carry tools, calls and results as Hermes text."""
    out: list[Message] = []
    previous_role = None
    for message in messages:
        role, text = _role(message), message_text(message.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            # Results of parallel calls share one user turn, as Hermes-trained models expect.
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            if role == "assistant" and message.get("tool_calls"):
                calls = [hermes_tool_call_text(c["function"]["name"], c["function"].get("arguments"))
                         for c in message["tool_calls"]]
                text = "\n".join([text, *calls] if text else calls)
            out.append({"role": role, "content": text})
        previous_role = role
    if tools:
        block = hermes_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
