"""Constrained decoding for the embedded model: what a request's output must match, as an llguidance grammar.

llguidance (the grammar engine vLLM and SGLang use too) computes, for each step, the set of tokens that keep the
output inside the grammar; the engine masks every other token out before sampling. It has no dependencies
beyond its own Rust core (xgrammar brings torch, transformers and triton along), covers JSON Schema and Lark
grammars in one engine, and names the JSON Schema keywords it cannot express, which become a 400 here.

What a request asks for (``output_grammar``):

- ``response_format`` ``json_object``: a JSON object; ``json_schema``: a JSON value its schema accepts.
- ``tool_choice`` ``"required"`` or a named function: the reply is ``<tool_call>`` blocks only (one, unless
  ``parallel_tool_calls`` allows more) whose JSON is ``{"name": ..., "arguments": ...}`` with arguments the tool's
  ``parameters`` schema accepts, in the Hermes form ``gateway.prompting`` renders calls in.
- ``constrain_tool_calls`` with tools offered (``auto``): text is free, but once the model opens a ``<tool_call>``
  the block must be a call of one of the offered tools, with valid arguments.
- ``response_format`` with tools offered (``auto``): either an answer of that format, or calls.

JSON is written as ``json.dumps`` writes it (``", "`` and ``": "``, no other whitespace), the form the model sees
its own earlier calls in; flexible whitespace would also let a small model pad forever.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import llguidance
import torch

from gateway.agent.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from gateway.backends.local.sampling import invalid_request

_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def tokenizer_for(hf_tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> llguidance.LLTokenizer:
    """The grammar engine's view of the model's tokenizer: every token's bytes, and which tokens end a turn.

    Tokenizers converted from GGUF wrap their byte-level decoder in a sequence the engine does not read as byte
    level (it would see ``Ġ`` where a space is); a byte-level vocabulary gets the plain byte-level decoder.
    """
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" or any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or ()):
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=sorted(stop_token_ids))


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": _JSON_LAYOUT}


def _checked(grammar: str, param: str) -> str:
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise invalid_request(f"The schema cannot be enforced: {'; '.join(messages)}", param, "unsupported_schema")
    return grammar


def _schema(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_request("A schema must be a JSON object.", param, "invalid_value")
    return value


def answer_schema(fmt: Any) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` asks the answer to match (None for free text), or a 400."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("response_format must be an object.", "response_format", "invalid_value")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid_request("response_format.json_schema needs a name and a schema.",
                                  "response_format.json_schema", "invalid_value")
        return _schema(spec.get("schema"), "response_format.json_schema.schema")
    raise invalid_request(f"response_format type {kind!r} is not supported: use text, json_object or json_schema.",
                          "response_format.type", "invalid_value")


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") or {}
    parameters = function.get("parameters") or {"type": "object"}
    return _laid_out({"type": "object", "properties": {"name": {"const": function.get("name")},
                                                       "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})


def output_grammar(*, answer: dict[str, Any] | None, tools: list[dict[str, Any]] | None, calls: str,
                   parallel: bool) -> str | None:
    """The grammar a reply must match, or None when it is free.

    ``answer``: the schema of a reply that is an answer (``answer_schema``), None for free text. ``calls``:
    ``required`` (the reply is calls of ``tools`` only), ``checked`` (calls are optional, but each must be a call
    of ``tools`` with valid arguments) or ``free`` (calls are not checked). ``parallel``: several calls may follow
    each other.
    """
    if not tools:
        return None if answer is None else _compiled(f"start: %json {json.dumps(_laid_out(answer))}",
                                                     "response_format.json_schema.schema")
    if calls == "free" and answer is None:
        return None
    opening, closing, newline = json.dumps(TOOL_CALL_OPEN + "\n"), json.dumps("\n" + TOOL_CALL_CLOSE), '"\\n"'
    rules = [f"calls: block ({newline} block)*" if parallel else "calls: block",
             f"block: {opening} call {closing}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
             *(f"call_{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools))]
    if calls == "required":
        start = ["start: calls"]
    elif answer is not None:
        start = ["start: answer | calls", f"answer: %json {json.dumps(_laid_out(answer))}"]
    else:
        # A lazy lexeme ends at the first opening tag, so free text never holds a call that escapes the grammar.
        start = ["start: checked* TEXT", r"TEXT: /(.|\n)*/", f"opening[lazy]: TEXT {json.dumps(TOOL_CALL_OPEN)}",
                 f"checked: opening {newline} call {closing}"]
    param = "tools" if answer is None else "response_format.json_schema.schema"
    return _compiled("\n".join(["%llguidance {}", *start, *rules]) + "\n", param)


def _compiled(lark: str, param: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise invalid_request(f"The schema cannot be enforced: {exc}", param, "unsupported_schema") from None
    return _checked(grammar, param)


def matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A fresh matcher: one per generated sequence, advanced token by token."""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


class Masks:
    """The tokens each constrained sequence may take next, as a mask over the vocabulary.

    llguidance writes a bitmask (32 tokens per int32) for several matchers at once on its own threads; it is
    unpacked here with plain tensor operations (llguidance's own helper compiles a kernel, which on CPU costs
    seconds at first use).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._bits = torch.arange(32, dtype=torch.int32)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, llguidance.LLMatcher]]) -> None:
        """Set to -inf, in place, each listed row's logits of the tokens its matcher forbids."""
        packed = torch.empty((len(rows), self.words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, k) for k, (_, m) in enumerate(rows)], packed.data_ptr(),
                                               self.words * 4, len(rows))
        allowed = ((packed.unsqueeze(-1) >> self._bits) & 1).bool().flatten(1)[:, :logits.shape[1]]
        index = torch.tensor([i for i, _ in rows])
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
