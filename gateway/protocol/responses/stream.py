"""A chat-completions stream as a Responses event stream.

A stream ends as OpenAI's do: ``response.completed``, ``response.incomplete`` (the output was cut short:
``max_output_tokens``, a content filter; Codex fails the turn on it, as it does against OpenAI) or
``response.failed``.
"""

from __future__ import annotations

import copy
from typing import Any

from gateway.protocol.responses.from_chat import (
    _call_item,
    _final_status,
    _Ids,
    _message_item,
    _reasoning_item,
    _response_object,
    _text_part,
    response_usage,
)
from gateway.protocol.responses.tools import ToolMap, custom_input


class _Slot:
    """One chat tool call (by its ``index``) on its way to becoming an output item."""

    def __init__(self) -> None:
        self.call_id: str | None = None
        self.name: list[str] = []
        self.arguments: list[str] = []
        self.item: dict[str, Any] | None = None  # set once announced (``output_item.added``)
        self.output_index = -1
        self.closed = False


class ResponseStream:
    """Chat-completion chunks in, Responses stream events out: a pure state machine.

    ``start()`` gives ``response.created`` and ``response.in_progress``; ``feed(chunk)`` the events a
    chunk causes; then the caller MUST call exactly one of ``finish()`` (``response.completed``, or
    ``response.incomplete`` when the output was cut short, with the usage of the stream's usage chunk) or
    ``fail(code, message)`` (``response.failed``), or the client sees
    a stream without an end -- Codex treats that as an error. Calls after the end give no events.
    ``feed``/``finish``/``fail`` start the stream themselves if ``start`` was not called.

    Every event is a dict with ``type`` and a ``sequence_number`` counting from 0. One output item is open
    at a time and closed before the next opens (text after a tool call starts a new message item). A
    function call's arguments stream as ``response.function_call_arguments.delta`` events; a custom tool's
    input is only known once its JSON arguments are complete, so it comes as one
    ``response.custom_tool_call_input.delta`` when the call closes. Tool-call fragments are expected in
    order of ``index``, as OpenAI-compatible servers send them; a fragment for a call already closed only
    updates the final response object.

    ``response``: the response object as it stands; final after ``finish``/``fail``.
    """

    def __init__(self, *, response_id: str, request: dict[str, Any], tool_map: ToolMap, created_at: int) -> None:
        self._request = request
        self._tool_map = tool_map
        self._ids = _Ids(response_id)
        self.response = _response_object(response_id=response_id, request=request, created_at=created_at,
                                         status="in_progress", output=[])
        self._seq = 0
        self._started = False
        self._ended = False
        self._current: tuple[str, Any] | None = None  # ("message" | "reasoning", item) or ("tool", _Slot)
        self._text: list[str] = []
        self._slots: dict[int, _Slot] = {}
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self._ended

    # events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot_event(self, kind: str) -> dict[str, Any]:
        """An event carrying the response as it stands. The echoed request fields (tools, instructions:
        often tens of kilobytes) are never changed here, so they are shared rather than copied."""
        snapshot = {**self.response, "output": copy.deepcopy(self.response["output"]),
                    "usage": copy.deepcopy(self.response["usage"]), "error": copy.deepcopy(self.response["error"])}
        return self._event(kind, response=snapshot)

    def start(self) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        return [self._snapshot_event("response.created"), self._snapshot_event("response.in_progress")]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self._ended:
            return []
        out = self.start()
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if (choice.get("index") or 0) != 0:
                continue  # one response per request: the first choice
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self._reasoning_delta(reasoning)
            text = delta.get("content") or delta.get("refusal")
            if isinstance(text, str) and text:
                out += self._text_delta(text)
            for fragment in delta.get("tool_calls") or ():
                out += self._tool_fragment(fragment)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[dict[str, Any]]:
        if self._ended:
            return []
        out = self.start()
        status, incomplete = _final_status(self._finish_reason)
        out += self._close_current("incomplete" if incomplete else "completed")
        self._ended = True
        self.response.update(status=status, incomplete_details=incomplete, usage=response_usage(self._usage))
        out.append(self._snapshot_event("response.incomplete" if incomplete else "response.completed"))
        return out

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """End with ``response.failed``; an item left open stays in ``output`` as ``incomplete``, without
        further events. Codes as OpenAI's: ``context_length_exceeded``, ``rate_limit_exceeded`` (with
        "try again in Ns" in the message, which Codex reads), ``insufficient_quota``, ``server_error``..."""
        if self._ended:
            return []
        out = self.start()
        current, self._current = self._current, None
        if current is not None:
            kind, value = current
            if kind == "message":
                value.update(status="incomplete", content=[_text_part("".join(self._text))])
            elif kind == "reasoning":
                value["summary"] = [{"type": "summary_text", "text": "".join(self._text)}]
            elif kind == "tool" and value.item is not None:
                self._settle_call(value, "incomplete")
        self._ended = True
        self.response.update(status="failed", error={"code": code, "message": message},
                             usage=response_usage(self._usage))
        out.append(self._snapshot_event("response.failed"))
        return out

    def error(self, code: str, message: str) -> list[dict[str, Any]]:
        """An ``error`` event, OpenAI's way to end a stream that will not complete (whatever was sent before)."""
        self._ended = True
        return [self._event("error", code=code, message=message, param=None)]

    def add_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole item made at once (a ``compaction`` item): added and done, closing whatever was open."""
        if self._ended:
            return []
        out = self.start() + self._close_current("completed")
        index, added = self._open(item)
        return [*out, added, self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    # items

    def _open(self, item: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        output = self.response["output"]
        output.append(item)
        index = len(output) - 1
        return index, self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))

    def _index_of(self, item: dict[str, Any]) -> int:
        output = self.response["output"]
        return next(i for i in range(len(output) - 1, -1, -1) if output[i] is item)

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._current is None or self._current[0] != "message":
            out += self._close_current("completed")
            item = _message_item(self._ids.next("msg"), None, "in_progress")
            index, added = self._open(item)
            out.append(added)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part("")))
            self._current, self._text = ("message", item), []
        item = self._current[1]
        self._text.append(text)
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index_of(item),
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._current is None or self._current[0] != "reasoning":
            out += self._close_current("completed")
            item = _reasoning_item(self._ids.next("rs"), None)
            index, added = self._open(item)
            out.append(added)
            out.append(self._event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                                   summary_index=0, part={"type": "summary_text", "text": ""}))
            self._current, self._text = ("reasoning", item), []
        item = self._current[1]
        self._text.append(text)
        out.append(self._event("response.reasoning_summary_text.delta", item_id=item["id"],
                               output_index=self._index_of(item), summary_index=0, delta=text))
        return out

    def _tool_fragment(self, fragment: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        index = fragment.get("index")
        if not isinstance(index, int):
            current = self._current[1] if self._current and self._current[0] == "tool" else None
            index = next((i for i, s in self._slots.items() if s is current), len(self._slots))
        slot = self._slots.get(index)
        if slot is None:
            out += self._close_current("completed")
            slot = self._slots[index] = _Slot()
            self._current = ("tool", slot)
        function = fragment.get("function") or {}
        arguments = function.get("arguments") if isinstance(function.get("arguments"), str) else ""
        if slot.closed:  # a late fragment of a call already closed (servers send calls in order; rare)
            if arguments and slot.item is not None:
                slot.arguments.append(arguments)
                self._settle_call(slot, slot.item.get("status") or "completed")
            return out
        if fragment.get("id") and not slot.call_id:
            slot.call_id = fragment["id"]
        if function.get("name") and slot.item is None:
            slot.name.append(function["name"])
        if arguments:
            slot.arguments.append(arguments)
            if slot.item is None and slot.name:
                out += self._announce(slot)
            elif slot.item is not None and slot.item["type"] == "function_call":
                out.append(self._event("response.function_call_arguments.delta", item_id=slot.item["id"],
                                       output_index=slot.output_index, delta=arguments))
        return out

    def _announce(self, slot: _Slot) -> list[dict[str, Any]]:
        """``output_item.added`` for a call, once its name is known (and what arguments came with it)."""
        entry = self._tool_map.entry_for("".join(slot.name))
        slot.item = _call_item(self._ids, entry, slot.call_id, "in_progress")
        slot.output_index, added = self._open(slot.item)
        out = [added]
        if slot.arguments and slot.item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.delta", item_id=slot.item["id"],
                                   output_index=slot.output_index, delta="".join(slot.arguments)))
        return out

    def _settle_call(self, slot: _Slot, status: str) -> None:
        assert slot.item is not None
        arguments = "".join(slot.arguments)
        slot.item["status"] = status
        if slot.item["type"] == "custom_tool_call":
            slot.item["input"] = custom_input(arguments) if arguments else ""
        else:
            slot.item["arguments"] = arguments

    def _close_current(self, status: str) -> list[dict[str, Any]]:
        current, self._current = self._current, None
        if current is None:
            return []
        kind, value = current
        out: list[dict[str, Any]] = []
        if kind == "message":
            item, text = value, "".join(self._text)
            index = self._index_of(item)
            part = _text_part(text)
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=copy.deepcopy(part)))
            item.update(status=status, content=[part])
        elif kind == "reasoning":
            item, text = value, "".join(self._text)
            index = self._index_of(item)
            part = {"type": "summary_text", "text": text}
            out.append(self._event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                                   summary_index=0, text=text))
            out.append(self._event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                                   summary_index=0, part=dict(part)))
            item["summary"] = [part]
        else:
            slot: _Slot = value
            slot.closed = True
            if slot.item is None:
                if not slot.name and not slot.arguments:
                    return []  # a fragment with nothing in it
                if not slot.name:
                    slot.name.append("")
                out += self._announce(slot)
            item, index = slot.item, slot.output_index
            assert item is not None
            self._settle_call(slot, status)
            if item["type"] == "custom_tool_call":
                if item["input"]:
                    out.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                           output_index=index, delta=item["input"]))
                out.append(self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                       output_index=index, input=item["input"]))
            else:
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=self._index_of(item),
                               item=copy.deepcopy(item)))
        return out
