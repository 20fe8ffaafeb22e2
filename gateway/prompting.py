"""OpenAI chat messages (and tool specs) → the exact prompt text and token ids a model sees.

One implementation for serving (the local backend) and training, so a model is trained on exactly
what it is served. Tools go through the tokenizer's chat template when the template knows about
them; otherwise (SmolLM2's template silently drops ``tools``) they are written into the system prompt
in the Hermes format, tool calls become ``<tool_call>`` text and tool results ``<tool_response>``
blocks in a user turn — the format ``gateway.agent.parsing`` reads back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # settings name the renderings; they must not import transformers for it
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
# How tool specs are written into the system prompt (a model is served the rendering it was trained with):
# "hermes": each spec as one line of JSON, its keys sorted (the store keeps JSON with sorted keys, so a spec read
# back renders as it was served); "compact": one signature line per tool (``tool_signature``).
Rendering = Literal["hermes", "compact"]
RENDERINGS: tuple[Rendering, ...] = ("hermes", "compact")
DEFAULT_RENDERING: Rendering = "hermes"

HERMES_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
COMPACT_TOOLS_PROMPT = (
    "# Tools\n\n"
    "Functions you may call (name(parameter: type), ? marks an optional one):\n"
    "{tools}\n\n"
    "Call one as <tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message],
                  tools: list[dict[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                  rendering: Rendering = DEFAULT_RENDERING) -> str:
    """The prompt text for ``messages`` (OpenAI chat format) with ``tools`` (OpenAI tool specs), written in
    ``rendering`` where the chat template has no tool support of its own.

    ``add_generation_prompt=False`` renders a finished conversation (for training data).
    """
    tools = tools or None
    if template_supports_tools(tokenizer, tools):
        return tokenizer.apply_chat_template(
            [_native_message(m) for m in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, tokenize=False,
        )
    return tokenizer.apply_chat_template(
        _hermes_messages(messages, tools, rendering), add_generation_prompt=add_generation_prompt, tokenize=False,
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message],
                  tools: list[dict[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                  rendering: Rendering = DEFAULT_RENDERING) -> list[int]:
    """Token ids of ``render_prompt``; the template writes its own special tokens, so none are added."""
    text = render_prompt(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                         rendering=rendering)
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


def tools_prompt(tools: Iterable[dict[str, Any]], rendering: Rendering = DEFAULT_RENDERING) -> str:
    """The system-prompt block that declares ``tools``: whatever order their keys come in, the same text."""
    functions = [tool.get("function", tool) for tool in tools]
    if rendering == "compact":
        return COMPACT_TOOLS_PROMPT.format(tools="\n".join(tool_signature(f) for f in functions))
    lines = [json.dumps({"type": "function", "function": f}, ensure_ascii=False, sort_keys=True) for f in functions]
    return HERMES_TOOLS_PROMPT.format(tools="\n".join(lines))


def tool_signature(function: dict[str, Any]) -> str:
    """One line for a function: ``name(required: type, optional?: type): first sentence of its description``;
    types as TypeScript writes them (``string[]``, ``"a"|"b"``, ``{key: type}``). Required parameters come in the
    order ``required`` lists them, then the optional ones by name: the order of an object's keys is not kept by
    the store, the order of a list is."""
    line = f"{function.get('name', '')}({_fields(function.get('parameters') or {})})"
    description = _first_sentence(function.get("description") or "")
    return f"{line}: {description}" if description else line


def _fields(schema: dict[str, Any]) -> str:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [name for name in schema.get("required") or [] if name in properties]
    optional = sorted(name for name in properties if name not in required)
    return ", ".join([f"{name}: {_type(properties[name])}" for name in required]
                     + [f"{name}?: {_type(properties[name])}" for name in optional])


def _type(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return "|".join(json.dumps(value, ensure_ascii=False) for value in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return "|".join(_type(option) for option in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(_type({**schema, "type": k}) for k in kind)
    if kind == "array":
        item = _type(schema.get("items"))
        return f"({item})[]" if "|" in item else f"{item}[]"
    if kind == "object" or "properties" in schema:
        fields = _fields(schema)
        return f"{{{fields}}}" if fields else "object"
    return str(kind) if kind else "any"


def _first_sentence(text: str) -> str:
    # A period followed by a space ends the sentence; "e.g. 5" or "3.5" do not, a sentence that ends the text does.
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)\.(\s|$)", text.strip())
    return text.strip()[:match.start() + 1] if match else text.strip()


def hermes_tool_call_text(name: str, arguments: Any) -> str:
    payload = {"name": name, "arguments": _arguments_object(arguments)}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def _hermes_messages(messages: list[Message], tools: list[dict[str, Any]] | None,
                     rendering: Rendering) -> list[Message]:
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
        block = tools_prompt(tools, rendering)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
