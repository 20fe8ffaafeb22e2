"""Server-side agent runs: ``model = "agent:<profile>"`` on chat completions, and ``/v1/agent/runs``.

Every surface returns the same ``harness`` object (see ``RunState.harness``). A streamed run sends
progress (each tool call and its outcome) as ordinary ``chat.completion.chunk`` objects with
``choices: []`` and an extra ``harness`` key, then the final answer as ordinary chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from gateway.agent.loop import EXECUTE, OBSERVE, RunState, StepEvent
from gateway.agent.service import AGENT_PREFIX, LIMIT_KEYS
from gateway.api.common import json_response, read_json_body
from gateway.api.exchange import TRAJECTORY_HEADER
from gateway.auth import Principal
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.protocol.agent_runs import validate_agent_run
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.sse import DONE, encode_event
from gateway.streaming import EventStreamResponse


def _completion(state: RunState, model: str, created: int) -> dict[str, Any]:
    h = state.harness()
    return {"id": f"chatcmpl-{state.run_id}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": state.final or ""},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": h["usage"], "harness": h}


def _progress(event: StepEvent) -> list[dict[str, Any]]:
    """What a client sees of a transition: the calls about to run, and their outcomes."""
    if event.state == EXECUTE:
        return [{"event": "tool_call", "step": event.step, **call} for call in event.data.get("calls", [])]
    if event.state == OBSERVE:
        return [{"event": "tool_result", "step": event.step, **result} for result in event.data.get("results", [])]
    return []


async def agent_chat(ctx: RequestContext, principal: Principal, parsed: ChatCompletionRequest,
                     body: dict[str, Any]) -> Response:
    gateway = ctx.gateway
    profile_name = parsed.model[len(AGENT_PREFIX):]
    created = int(time.time())
    messages = [m for m in body["messages"] if m.get("role") != "system"] or body["messages"]
    line = ctx.line
    if not parsed.stream:
        loop, recorder = gateway.agents.prepare(profile_name, messages, principal)
        line.model, line.backend, line.trajectory_id = parsed.model, loop.backend.name, loop.state.run_id
        await recorder.start(loop.state)
        state = await loop.run()
        line.agent_status, line.termination_reason = state.status, state.termination_reason
        return json_response(_completion(state, parsed.model, created), headers={TRAJECTORY_HEADER: state.run_id})

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    loop, recorder = gateway.agents.prepare(profile_name, messages, principal,
                                            on_event=lambda e: [queue.put_nowait(p) for p in _progress(e)])
    line.model, line.backend, line.trajectory_id = parsed.model, loop.backend.name, loop.state.run_id
    await recorder.start(loop.state)
    wants_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    return EventStreamResponse(_stream(loop.run, queue, loop.state, parsed.model, created, wants_usage),
                               headers={TRAJECTORY_HEADER: loop.state.run_id})


async def _stream(run: Any, queue: asyncio.Queue[dict[str, Any]], state: RunState, model: str, created: int,
                  wants_usage: bool) -> AsyncIterator[bytes]:
    base = {"id": f"chatcmpl-{state.run_id}", "object": "chat.completion.chunk", "created": created, "model": model}
    task = asyncio.create_task(run())
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield encode_event({**base, "choices": [], "harness": getter.result()})
                continue
            getter.cancel()
            break
        while not queue.empty():
            yield encode_event({**base, "choices": [], "harness": queue.get_nowait()})
        task.result()
    finally:
        if not task.done():
            task.cancel()  # the client went away: the loop records client_disconnected
            await asyncio.gather(task, return_exceptions=True)
    harness = state.harness()
    frames = [
        encode_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}]}),
        encode_event({**base, "choices": [{"index": 0, "delta": {"content": state.final or ""},
                                           "finish_reason": None}]}),
        encode_event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "harness": harness}),
    ]
    if wants_usage:
        frames.append(encode_event({**base, "choices": [], "usage": harness["usage"]}))
    frames.append(DONE)
    yield b"".join(frames)


async def create_run(ctx: RequestContext) -> Response:
    """``POST /v1/agent/runs``: start a run in the background and return its id at once."""
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    parsed = validate_agent_run(await read_json_body(request, gateway.settings.server.max_body_bytes))
    profile, messages, limits = parsed.profile, parsed.input, parsed.limits or {}
    unknown = sorted(set(limits) - set(LIMIT_KEYS))
    if unknown:
        raise APIError(400, f"Unknown limit '{unknown[0][:64]}': 'limits' may set only {', '.join(LIMIT_KEYS)}.",
                       param=f"limits.{unknown[0][:64]}", code="invalid_value")
    loop, recorder = gateway.agents.prepare(profile, messages, principal, limits=limits, hold_for_approval=True)
    loop.cancelled_as = ("interrupted", None)
    await recorder.start(loop.state)
    gateway.spawn(loop.run(), cancel_on_stop=True)
    ctx.line.trajectory_id = loop.state.run_id
    return json_response({"id": loop.state.run_id, "object": "agent.run", "profile": profile, "status": "running"},
                 status=201, headers={TRAJECTORY_HEADER: loop.state.run_id})


async def get_run(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    run_id = request.path_params["run_id"]
    found = await gateway.agents.get(run_id, principal)
    if found is None:
        raise APIError(404, f"No agent run '{run_id}'.", code="not_found")
    return json_response(found, headers={TRAJECTORY_HEADER: run_id})
