"""The local backend on a tiny random Llama (fast), and on the real embedded model (integration)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("local")

from transformers import PreTrainedTokenizerBase

from gateway.backends.base import BackendError, BackendUnavailable, ChatRequest, ChatResult
from gateway.backends.local import LocalBackend
from gateway.backends.local.loading import (
    ModelLoadError,
    _fingerprint,
    cache_folder,
    embedded_model_file,
    load_model,
)
from gateway.backends.local.text import TextTracker as _TextTracker
from gateway.config import BackendSettings
from gateway.prompting import encode_prompt
from tests.gateway.backends.conftest import script as _script

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _body(text: str = "hi", **params: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 8, **params}


def _req(body: dict[str, Any]) -> ChatRequest:
    return ChatRequest(body=body, model="tiny")


def _ids(result: ChatResult, choice: int = 0) -> list[int]:
    assert result.extras.completion_token_ids is not None
    return result.extras.completion_token_ids[choice]


def _content(result: ChatResult, choice: int = 0) -> str:
    return result.response["choices"][choice]["message"]["content"]


async def test_chat_response_shape_and_recorded_ids(backend: LocalBackend,
                                                    smol_tokenizer: PreTrainedTokenizerBase) -> None:
    body = _body("Tell me something", max_tokens=12)
    result = await backend.chat(_req(body))
    r = result.response
    assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion" and r["model"] == "tiny"
    assert isinstance(r["created"], int)
    [choice] = r["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    ids = _ids(result)
    assert len(ids) == 12
    assert result.extras.prompt_token_ids == encode_prompt(smol_tokenizer, body["messages"])
    assert smol_tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    logprobs = result.extras.completion_logprobs[0]
    assert len(logprobs) == 12 and all(lp <= 0 for lp in logprobs)
    assert r["usage"] == {"prompt_tokens": len(result.extras.prompt_token_ids), "completion_tokens": 12,
                          "total_tokens": len(result.extras.prompt_token_ids) + 12}


async def test_greedy_is_deterministic(backend: LocalBackend) -> None:
    first, second = await backend.chat(_req(_body())), await backend.chat(_req(_body()))
    assert _ids(first) == _ids(second)
    assert _content(first) == _content(second)


async def test_seeded_sampling_is_reproducible(backend: LocalBackend) -> None:
    body = _body(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    a, b = await backend.chat(_req(body)), await backend.chat(_req(body))
    other = await backend.chat(_req({**body, "seed": 4321}))
    assert _ids(a) == _ids(b)
    assert _ids(a) != _ids(other)


async def test_concurrent_requests_share_forward_passes_and_match_solo_runs(backend: LocalBackend) -> None:
    bodies = [_body(f"question number {i} " + "word " * i) for i in range(8)]  # different prompt lengths
    solo = [_ids(await backend.chat(_req(b))) for b in bodies]
    sequential_passes = backend.forward_passes
    assert sequential_passes == 8 * 8  # a prefill and 7 decode steps each

    batched = await asyncio.gather(*(backend.chat(_req(b)) for b in bodies))
    batched_passes = backend.forward_passes - sequential_passes
    assert batched_passes <= 16, f"8 concurrent requests took {batched_passes} forward passes"
    # Left padding must not change what any sequence computes.
    assert [_ids(r) for r in batched] == solo


async def test_a_request_joining_a_running_batch_matches_its_solo_run(backend: LocalBackend) -> None:
    long_body, short_body = _body("a long one", max_tokens=40), _body("short " * 10, max_tokens=10)
    long_solo, short_solo = _ids(await backend.chat(_req(long_body))), _ids(await backend.chat(_req(short_body)))

    long_task = asyncio.create_task(backend.chat(_req(long_body)))
    start = backend.forward_passes
    while backend.forward_passes < start + 5:  # the first request is decoding
        await asyncio.sleep(0.001)
    short = await backend.chat(_req(short_body))
    assert _ids(short) == short_solo
    assert _ids(await long_task) == long_solo


async def test_small_batch_limit_still_serves_everyone(tiny_model_dir: Path) -> None:
    b = LocalBackend(BackendSettings(name="local", kind="local", model_path=str(tiny_model_dir), max_batch_size=2))
    await b.start()
    try:
        bodies = [_body(f"q{i}", max_tokens=5) for i in range(5)]
        solo = [_ids(await b.chat(_req(body))) for body in bodies]
        results = await asyncio.gather(*(b.chat(_req(body)) for body in bodies))
        assert [_ids(r) for r in results] == solo
    finally:
        await b.aclose()


async def test_n_produces_independent_choices(backend: LocalBackend) -> None:
    result = await backend.chat(_req(_body(n=3, temperature=1.0, seed=7, max_tokens=10)))
    choices = result.response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len(result.extras.completion_token_ids) == 3 == len(result.extras.completion_logprobs)
    assert len({tuple(_ids(result, i)) for i in range(3)}) == 3
    assert result.response["usage"]["completion_tokens"] == 30
    again = await backend.chat(_req(_body(n=3, temperature=1.0, seed=7, max_tokens=10)))
    assert [_ids(again, i) for i in range(3)] == [_ids(result, i) for i in range(3)]

    greedy = await backend.chat(_req(_body(n=2)))
    assert _ids(greedy, 0) == _ids(greedy, 1) == _ids(await backend.chat(_req(_body())))


async def test_stop_string_ends_the_text_before_it(backend: LocalBackend) -> None:
    full = _content(await backend.chat(_req(_body(max_tokens=30))))
    stop = full[10:13]
    cut = full[:full.index(stop)]
    result = await backend.chat(_req(_body(max_tokens=30, stop=[stop, "never-appears"])))
    assert _content(result) == cut
    assert result.response["choices"][0]["finish_reason"] == "stop"
    streamed = await _collect(await backend.stream(_req(_body(max_tokens=30, stop=stop))))
    assert _stream_text(streamed) == cut


async def test_max_tokens_and_max_completion_tokens_give_length(backend: LocalBackend) -> None:
    result = await backend.chat(_req(_body(max_tokens=None, max_completion_tokens=3)))
    assert result.response["choices"][0]["finish_reason"] == "length"
    assert len(_ids(result)) == 3


async def test_end_of_turn_token_stops_and_is_recorded_but_not_shown(backend: LocalBackend,
                                                                     smol_tokenizer) -> None:
    text_ids = smol_tokenizer.encode("Hello there", add_special_tokens=False)
    _script(backend, [*text_ids, smol_tokenizer.convert_tokens_to_ids("<|im_end|>"), *text_ids])
    result = await backend.chat(_req(_body(max_tokens=50)))
    assert _content(result) == "Hello there"
    assert result.response["choices"][0]["finish_reason"] == "stop"
    assert _ids(result) == [*text_ids, smol_tokenizer.eos_token_id]


async def test_context_overflow_is_a_400(backend: LocalBackend) -> None:
    too_long = "word " * backend.loaded.context_length
    with pytest.raises(BackendError) as info:
        await backend.chat(_req(_body(too_long)))
    assert info.value.status_code == 400
    assert info.value.code == "context_length_exceeded"
    assert info.value.error_type == "invalid_request_error"
    with pytest.raises(BackendError):
        await backend.stream(_req(_body(too_long)))


async def test_generation_stops_at_the_context_length(backend: LocalBackend, smol_tokenizer) -> None:
    context = backend.loaded.context_length
    words = context
    while len(encode_prompt(smol_tokenizer, _body("word " * words)["messages"])) > context - 20:
        words -= 1
    body = _body("word " * words)
    del body["max_tokens"]  # the default (256) is more than the context leaves: the context ends it
    result = await backend.chat(_req(body))
    prompt = len(result.extras.prompt_token_ids)
    assert context - prompt == 20 and len(_ids(result)) == 20
    assert result.response["choices"][0]["finish_reason"] == "length"
    # A limit asked for explicitly that the context cannot hold is refused, as OpenAI refuses it.
    with pytest.raises(BackendError) as info:
        await backend.chat(_req(_body("word " * words, max_tokens=21)))
    assert (info.value.status_code, info.value.param, info.value.code) == (400, "max_tokens", "context_length_exceeded")
    assert len(_ids(await backend.chat(_req(_body("word " * words, max_tokens=20))))) == 20


@pytest.mark.parametrize("params", [{"temperature": 3}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0},
                                    {"stop": 5}, {"messages": []}, {"tools": "all"}])
async def test_invalid_parameters_are_400s(backend: LocalBackend, params: dict[str, Any]) -> None:
    with pytest.raises(BackendError) as info:
        await backend.chat(_req({**_body(), **params}))
    assert info.value.status_code == 400


async def test_tool_calls_are_parsed(backend: LocalBackend, smol_tokenizer) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _script(backend, [*smol_tokenizer.encode(text, add_special_tokens=False), smol_tokenizer.eos_token_id])
    result = await backend.chat(_req(_body(tools=TOOLS, max_tokens=100)))
    [choice] = result.response["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    without_tools = await backend.chat(_req(_body(max_tokens=100)))  # no tools offered: text stays text
    assert _content(without_tools) == text and "tool_calls" not in without_tools.response["choices"][0]["message"]


async def test_tools_reach_the_prompt_unless_tool_choice_is_none(backend: LocalBackend, smol_tokenizer) -> None:
    plain = await backend.chat(_req(_body(max_tokens=1)))
    with_tools = await backend.chat(_req(_body(tools=TOOLS, max_tokens=1)))
    none = await backend.chat(_req(_body(tools=TOOLS, tool_choice="none", max_tokens=1)))
    assert "get_weather" in smol_tokenizer.decode(with_tools.extras.prompt_token_ids)
    assert none.extras.prompt_token_ids == plain.extras.prompt_token_ids
    with pytest.raises(BackendError):
        await backend.chat(_req(_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})))


async def _collect(stream: Any) -> list[dict[str, Any]]:
    return [chunk async for chunk in stream]


def _stream_text(chunks: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"] and c["choices"][0]["index"] == index)


async def test_stream_chunks_match_the_non_streamed_completion(backend: LocalBackend) -> None:
    body = _body("stream me", max_tokens=20)
    expected = await backend.chat(_req(body))
    stream = await backend.stream(_req(body))
    chunks = await _collect(stream)
    first, last = chunks[0], chunks[-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {(first["id"], first["created"], "tiny")}
    assert last["choices"] == [] and last["usage"] == expected.response["usage"]
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert _stream_text(chunks) == _content(expected)
    assert stream.extras.completion_token_ids == expected.extras.completion_token_ids
    assert stream.extras.prompt_token_ids == expected.extras.prompt_token_ids


async def test_stream_with_n_reports_every_choice(backend: LocalBackend) -> None:
    expected = await backend.chat(_req(_body(n=2, temperature=1.0, seed=3)))
    chunks = await _collect(await backend.stream(_req(_body(n=2, temperature=1.0, seed=3))))
    for i in range(2):
        assert _stream_text(chunks, i) == _content(expected, i)
    finishes = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1]


async def test_stream_sends_tool_call_deltas_and_no_markup(backend: LocalBackend, smol_tokenizer) -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _script(backend, [*smol_tokenizer.encode(text, add_special_tokens=False), smol_tokenizer.eos_token_id])
    chunks = await _collect(await backend.stream(_req(_body(tools=TOOLS, max_tokens=100))))
    assert _stream_text(chunks) == "Checking.\n"
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
              if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert deltas[0]["index"] == 0 and deltas[0]["id"].startswith("call_") and deltas[0]["type"] == "function"
    assert deltas[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_closing_a_stream_cancels_its_generation(backend: LocalBackend) -> None:
    stream = await backend.stream(_req(_body(max_tokens=200)))
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen == 4:
            break
    await stream.aclose()
    engine = backend._engine
    deadline = time.monotonic() + 2
    while engine._rows and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert not engine._rows
    passes = backend.forward_passes
    await asyncio.sleep(0.05)
    assert backend.forward_passes == passes
    assert len(stream.extras.completion_token_ids[0]) < 200


async def test_closing_a_stream_from_another_task_ends_its_reader(backend: LocalBackend) -> None:
    stream = await backend.stream(_req(_body(max_tokens=200)))
    reader = asyncio.create_task(_collect(stream))
    await asyncio.sleep(0.02)
    await stream.aclose()
    chunks = await asyncio.wait_for(reader, 2)
    assert all(c["choices"] for c in chunks)  # no usage chunk for an abandoned stream


async def test_cancelled_chat_stops_its_sequences(backend: LocalBackend) -> None:
    task = asyncio.create_task(backend.chat(_req(_body(max_tokens=200))))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 2
    while backend._engine._rows and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert not backend._engine._rows


async def test_closing_the_backend_fails_waiting_requests(tiny_model_dir: Path) -> None:
    b = LocalBackend(BackendSettings(name="local", kind="local", model_path=str(tiny_model_dir)))
    await b.start()
    task = asyncio.create_task(b.chat(_req(_body(max_tokens=200))))
    await asyncio.sleep(0.05)
    await b.aclose()
    with pytest.raises(BackendUnavailable):
        await task
    with pytest.raises(BackendUnavailable):
        await b.chat(_req(_body()))


def test_text_tracker_never_splits_characters(smol_tokenizer) -> None:
    text = "日本語 ✓ naïve — 🙂 end"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    tracker = _TextTracker(smol_tokenizer, ())
    pieces = [tracker.push(i)[0] for i in ids]
    pieces.append(tracker.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_text_tracker_holds_back_a_possible_stop_string(smol_tokenizer) -> None:
    tracker = _TextTracker(smol_tokenizer, ("STOP",))
    out = []
    for token in smol_tokenizer.encode("go ST on, then STOP here", add_special_tokens=False):
        piece, stopped = tracker.push(token)
        out.append(piece)
        if stopped:
            break
    # Pieces cannot be taken back, so the "ST" of "STOP" must never have been released.
    assert stopped and "".join(out) == "go ST on, then "


@pytest.mark.integration
async def test_embedded_model_generates_and_records_ids(smol_tokenizer) -> None:
    b = LocalBackend(BackendSettings(name="local", kind="local"))
    await b.start()
    try:
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 8}
        result = await b.chat(ChatRequest(body=body, model="smollm2-135m-instruct"))
        content = _content(result)
        ids = _ids(result)
        assert content.strip() and 0 < len(ids) <= 8
        assert smol_tokenizer.decode(ids, skip_special_tokens=True) == content
        assert len(result.extras.completion_logprobs[0]) == len(ids)
    finally:
        await b.aclose()


@pytest.mark.integration
def test_first_load_writes_the_cache_and_the_next_load_uses_it(tmp_path: Path) -> None:
    first = load_model(cache_dir=str(tmp_path))
    assert first.source == "gguf"
    folder = tmp_path / embedded_model_file().stem
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    second = load_model(cache_dir=str(tmp_path))
    assert second.source == "cache" and second.path == folder
    assert second.load_seconds < first.load_seconds / 3
    for name, tensor in first.model.state_dict().items():
        assert tensor.equal(second.model.state_dict()[name]), name
    assert second.tokenizer.eos_token == "<|im_end|>"


def test_a_gguf_is_served_from_a_matching_cache_and_never_from_a_stale_one(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"GGUF not really")
    folder = cache_folder(gguf, tmp_path / "cache")
    shutil.copytree(tiny_model_dir, folder)
    (folder / "source.json").write_text(json.dumps(_fingerprint(gguf)))
    loaded = load_model(str(gguf), str(tmp_path / "cache"))
    assert loaded.source == "cache" and loaded.path == folder

    gguf.write_bytes(b"GGUF changed since")  # the cache no longer describes this file
    with pytest.raises(ModelLoadError):
        load_model(str(gguf), str(tmp_path / "cache"))


async def test_a_missing_model_fails_start_with_503(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "nowhere"))
    b = LocalBackend(BackendSettings(name="local", kind="local", model_path=str(tmp_path)))  # empty folder
    with pytest.raises(BackendUnavailable) as info:
        await b.start()
    assert info.value.status_code == 503


async def test_count_tokens_matches_the_prompt_it_would_run(backend: LocalBackend) -> None:
    from gateway.prompting import encode_prompt

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, model"}]
    assert backend.count_tokens(messages) == len(encode_prompt(backend.loaded.tokenizer, messages))
    assert backend.count_tokens(messages + [{"role": "assistant", "content": "hi " * 50}]) > \
        backend.count_tokens(messages) + 40
