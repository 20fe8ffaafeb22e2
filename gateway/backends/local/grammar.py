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

What a grammar may cost is bounded, since every sequence of the batch waits for the slowest mask (``LIMITS`` and
the constants below): a schema whose cost llguidance does not meter (a long ``pattern``, a minimum no context
holds) is a 400 up front; the grammar and its matchers are built before the job reaches the engine, within
``COMPILE_SECONDS``, and a grammar that fails on its only path (a ``$ref`` cycle, a recursion that never ends) is
a 400 too; during generation llguidance's per-step fuel bounds each mask, and a sequence whose masks still cost
too much, or whose grammar fails, ends with the finish reason ``error`` (``ERROR_FINISH``), never ``stop``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import structlog
import torch

from gateway.agent.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from gateway.backends.base import BackendError
from gateway.backends.local.sampling import invalid_request

log = structlog.get_logger()

_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_ANSWER = "response_format.json_schema.schema"
_ARGUMENTS = "/properties/arguments"  # where a call's schema holds the tool's parameters

# The finish reason of a sequence whose grammar failed (or cost too much) before it completed: its text is whatever
# was generated until then, which the grammar did not finish; OpenAI has no such reason, and ``stop`` would claim
# the output matches.
ERROR_FINISH = "error"
# Building a grammar and its matchers (validation, the lexer's first states, the first mask, the probe) takes a
# thread, never the engine's: a 400 past this. 5,000 required properties take 0.45 s on two slow cores.
COMPILE_SECONDS = 2.0
# A sequence's masks may take MASK_ALLOWANCE_SECONDS in all plus MASK_SECONDS_PER_TOKEN for each mask computed;
# past that it ends with ERROR_FINISH. A mask usually takes 0.1-1 ms and llguidance's step fuel holds one to about
# 10 ms; the allowance absorbs the first masks of new lexemes and a busy machine's scheduling, and 20 ms a token is
# a third of a decoding step of eight sequences, so no sequence can slow the batch for long, let alone by seconds.
MASK_ALLOWANCE_SECONDS = 0.5
MASK_SECONDS_PER_TOKEN = 0.02
# Characters of one regex (``pattern``, ``patternProperties``' names): llguidance's fuel does not meter the cost of
# a long regex, which grows with its length at every token (300,000 characters: 50 ms a token, on every token;
# 1,000: under 0.2 ms).
MAX_PATTERN = 1000
# A ``minLength``/``minItems``/``minProperties``/``minContains`` beyond this can never be met within a context.
MAX_MINIMUM = 100_000
# Forced steps walked when a grammar is built, to find one that fails on its only path.
PROBE_STEPS = 16
# llguidance's own bounds, its defaults but for: lexer construction fuel 200,000 (1,000,000: over a second for
# ``(a{1000}){1000}``), fuel for one mask's lexing 100,000 (200,000: about 14 ms at llguidance's own reckoning),
# lexer states per matcher 20,000 (250,000: up to 500 MB; copies for ``n`` share them), and errors without the
# parser's state or the grammar in them (they reach logs and clients).
LIMITS = {"initial_lexer_fuel": 200_000, "step_lexer_fuel": 100_000, "step_max_items": 50_000,
          "max_lexer_states": 20_000, "verbose_errors": False}


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


def _unsupported(reason: str, param: str) -> BackendError:
    # llguidance's errors quote the grammar around the fault, which may be a whole 300 KB schema.
    reason = reason if len(reason) <= 500 else reason[:500] + " ..."
    return invalid_request(f"The schema cannot be enforced: {reason}", param, "unsupported_schema")


def _checked(grammar: str, param: str) -> str:
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=_limits())
    if error:
        raise _unsupported("; ".join(messages), param)
    return grammar


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


# Keywords whose values are data, not schemas: nothing under them is a pattern or a reference.
_DATA = frozenset({"const", "enum", "default", "examples"})
_MINIMUMS = ("minLength", "minItems", "minProperties", "minContains")


def _too_costly(schema: Any) -> str | None:
    """Why ``schema`` would cost more than llguidance meters (see ``MAX_PATTERN``, ``MAX_MINIMUM``), or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        named = node.get("patternProperties")
        for pattern in [node.get("pattern"), *(named if isinstance(named, dict) else ())]:
            if isinstance(pattern, str) and len(pattern) > MAX_PATTERN:
                return f"a pattern of {len(pattern)} characters (at most {MAX_PATTERN})"
        for key in _MINIMUMS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_MINIMUM:
                return f"{key} {value} (at most {MAX_MINIMUM}: no context holds more)"
        stack.extend(value for key, value in node.items() if key not in _DATA)
    return None


def _rooted(node: Any, root: str) -> Any:
    """``node`` with its local references (``#``, ``#/$defs/...``) made relative to ``root``, the JSON pointer
    where it is nested: a tool's parameters sit under ``/properties/arguments`` of the call's schema."""
    if isinstance(node, list):
        return [_rooted(item, root) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + root + value[1:]
        else:
            out[key] = value if key in _DATA else _rooted(value, root)
    return out


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


def _parameters(tool: dict[str, Any]) -> Any:
    return (tool.get("function") or {}).get("parameters") or {"type": "object"}


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    # Each call is a %json grammar of its own, so its references resolve within it: the parameters' own
    # ``#/$defs/...`` are rewritten to where the parameters now sit.
    return _laid_out({"type": "object", "properties": {"name": {"const": (tool.get("function") or {}).get("name")},
                                                       "arguments": _rooted(_parameters(tool), _ARGUMENTS)},
                      "required": ["name", "arguments"], "additionalProperties": False})


def output_grammar(*, answer: dict[str, Any] | None, tools: list[dict[str, Any]] | None, calls: str,
                   parallel: bool) -> str | None:
    """The grammar a reply must match, or None when it is free.

    ``answer``: the schema of a reply that is an answer (``answer_schema``), None for free text. ``calls``:
    ``required`` (the reply is calls of ``tools`` only), ``checked`` (calls are optional, but each must be a call
    of ``tools`` with valid arguments) or ``free`` (calls are not checked). ``parallel``: several calls may follow
    each other.
    """
    compiled_tools = tools if tools and (calls != "free" or answer is not None) else []
    for schema, param in [*([(answer, _ANSWER)] if answer is not None else []),
                          *((_parameters(tool), "tools") for tool in compiled_tools)]:
        if (reason := _too_costly(schema)) is not None:
            raise _unsupported(reason, param)
    if not tools:
        return None if answer is None else _compiled(f"start: %json {json.dumps(_laid_out(answer))}", _ANSWER)
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
    return _compiled("\n".join(["%llguidance {}", *start, *rules]) + "\n", _param(answer))


def _param(answer: dict[str, Any] | None) -> str:
    return "tools" if answer is None else _ANSWER


def _compiled(lark: str, param: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise _unsupported(str(exc), param) from None
    return _checked(grammar, param)


def matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A fresh matcher, under ``LIMITS``: one per generated sequence, advanced token by token."""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())


def _error(m: llguidance.LLMatcher) -> str:
    return m.get_error().replace("<non-verbose/>", "").strip() or "the grammar failed"


def _probe(m: llguidance.LLMatcher) -> str | None:
    """Why the grammar fails on the path every output must take (its forced tokens), or None; ``m`` is advanced."""
    for _ in range(PROBE_STEPS):
        forced = m.compute_ff_tokens()
        if m.is_error() or (forced and not m.consume_tokens(forced)):
            return _error(m)
        if not forced:
            break
    mask = m.compute_bitmask()
    if m.is_error():
        return _error(m)
    return None if any(mask) else "no token is allowed"


class Grammar:
    """A request's grammar, built: one matcher per sequence, each at the start, its first mask computed."""

    def __init__(self, matchers: list[llguidance.LLMatcher], eos_token: int) -> None:
        self._matchers = matchers
        self._eos_token = eos_token

    @classmethod
    def build(cls, text: str, tokenizer: llguidance.LLTokenizer, n: int, param: str) -> Grammar:
        """Build the matchers (the lexer's construction is the costly part), or a 400 when the grammar fails
        before any output could match it. Runs off the engine thread."""
        prototype = matcher(tokenizer, text)
        prototype.compute_bitmask()  # the first lexer states, once for every copy
        if (reason := _error(prototype) if prototype.is_error() else _probe(prototype.deep_copy())) is not None:
            raise _unsupported(f"it fails before any output can match it ({reason})", param)
        return cls([prototype] + [prototype.deep_copy() for _ in range(n - 1)], tokenizer.eos_token)

    def constraint(self, index: int) -> Constraint:
        """Sequence ``index``'s constraint; each is handed out once."""
        return Constraint(self._matchers[index], self._eos_token)


async def compile_grammar(tokenizer: Callable[[], llguidance.LLTokenizer], n: int, *,
                          answer: dict[str, Any] | None, tools: list[dict[str, Any]] | None, calls: str,
                          parallel: bool) -> Grammar | None:
    """``output_grammar``, built for ``n`` sequences, or None when the reply is free; a 400 when it cannot be
    enforced or building it takes over ``COMPILE_SECONDS``.

    On a thread of its own, so neither the event loop nor the engine's step waits for it; past the bound the
    thread finishes on its own (llguidance's fuel bounds it) and its result is dropped.
    """
    if not ((tools and calls != "free") or answer is not None):
        return None
    tokens = await asyncio.to_thread(tokenizer)  # built once, on first use (~0.3 s): not the request's cost

    def build() -> Grammar | None:
        text = output_grammar(answer=answer, tools=tools, calls=calls, parallel=parallel)
        return None if text is None else Grammar.build(text, tokens, n, _param(answer))

    started = time.perf_counter()
    try:
        return await asyncio.wait_for(asyncio.to_thread(build), COMPILE_SECONDS)
    except TimeoutError:
        log.warning("local.grammar_too_slow", seconds=round(time.perf_counter() - started, 3))
        raise _unsupported(f"building it took over {COMPILE_SECONDS:g} s", _param(answer)) from None


class Constraint:
    """One sequence's grammar as it generates: its matcher, what its masks have cost, and why it failed."""

    def __init__(self, m: llguidance.LLMatcher, eos_token: int) -> None:
        self.matcher = m
        self.eos_token = eos_token
        self.failure: str | None = None
        self.masks = 0
        self.mask_seconds = 0.0

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.warning("local.grammar_failed", reason=reason[:200], tokens=self.masks)

    def charge(self, seconds: float) -> None:
        """Account one mask that took ``seconds``; fail past the budget, or when the grammar failed computing it."""
        self.masks += 1
        self.mask_seconds += seconds
        if self.matcher.is_error():
            self.fail(_error(self.matcher))
        elif self.mask_seconds > MASK_ALLOWANCE_SECONDS + MASK_SECONDS_PER_TOKEN * self.masks:
            self.fail(f"its masks took {self.mask_seconds:.2f} s over {self.masks} tokens")

    def advance(self, token: int, consume: bool) -> str | None:
        """The finish ``token`` brings: ``ERROR_FINISH`` when the grammar failed, ``stop`` when the output is
        complete (nothing but the end may follow), else None. ``consume``: whether ``token`` is output (not an
        end of turn or a stop string, which the grammar does not see)."""
        if self.failure is None and consume and not self.matcher.consume_token(token):
            self.fail(_error(self.matcher))  # only a token chosen around the mask (a scripted test) fails here
        if self.failure is not None:
            return ERROR_FINISH
        return "stop" if consume and self.matcher.is_stopped() else None


_MASK_THREADS = max(1, min(32, (os.cpu_count() or 1) * 4 // 5))  # as many as llguidance's own executor takes


class Masks:
    """The tokens each constrained sequence may take next, as a mask over the vocabulary.

    Each row's bitmask (32 tokens per int32) is written by llguidance on a thread of a pool, which times it for the
    row's budget (``Constraint.charge``); it is unpacked here with plain tensor operations (llguidance's own
    helper compiles a kernel, which on CPU costs seconds at first use). A failed row may take only the end of
    turn, so it ends at once.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=_MASK_THREADS, thread_name_prefix="grammar-mask")
        self._bits = torch.arange(32, dtype=torch.int32)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, Constraint]]) -> None:
        """Set to -inf, in place, each listed row's logits of the tokens its constraint forbids."""
        packed = torch.zeros((len(rows), self.words), dtype=torch.int32)
        size = self.words * 4

        def compute(k: int) -> float:
            started = time.perf_counter()
            rows[k][1].matcher.unsafe_compute_mask_ptr(packed.data_ptr() + k * size, size)
            return time.perf_counter() - started

        live = [k for k, (_, c) in enumerate(rows) if c.failure is None]
        spent = list(self._pool.map(compute, live)) if len(live) > 1 else [compute(k) for k in live]
        for k, seconds in zip(live, spent, strict=True):
            rows[k][1].charge(seconds)
        allowed = ((packed.unsqueeze(-1) >> self._bits) & 1).bool().flatten(1)[:, :logits.shape[1]]
        for k in (~allowed.any(dim=1)).nonzero()[:, 0].tolist():
            rows[k][1].fail("no token is allowed")
        for k, (_, c) in enumerate(rows):
            if c.failure is not None:
                allowed[k] = False
                allowed[k, c.eos_token] = True
        index = torch.tensor([i for i, _ in rows])
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
