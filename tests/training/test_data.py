"""Training rows: the loss mask, render equality with what the local backend served, store rows, mixing,
general data and perplexity."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.extras import skip_without

skip_without("train")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from gateway.app import build_app
from gateway.backends.base import ChatRequest, ChatResult
from gateway.backends.local import LocalBackend
from gateway.config import BackendSettings
from gateway.prompting import encode_prompt, hermes_tool_call_text
from replay.filters import Filters
from replay.importer import Conversation, build_op, import_conversations, read_file
from replay.rewards import recompute
from replay.settings import RewardSettings
from replay.store import TrajectoryStore
from replay.vocabulary import DEMO
from tests.gateway.backends.conftest import script as _script
from tests.replay import builders
from training import batches, general_data
from training.batches import perplexity
from training.data import (
    IGNORE,
    Example,
    TooLong,
    examples_from_store,
    is_recovered,
    mix,
    render_example,
)
from training.general_data import general_conversations, general_examples, load_conversations, split_general
from training.settings import HarnessSettings
from training.sft import label_loss

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a weather assistant."}


def call(call_id: str, city: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def tool(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def answer(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


HISTORY = [SYSTEM, user("Weather in Paris and Rome?"),
           {"role": "assistant", "content": "Checking both.", "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]},
           tool("c1", "Sunny, 21 C"), tool("c2", "Tool get_weather failed: upstream timeout"),
           answer("Paris is sunny; Rome failed."), user("Try Rome again please.")]


def trained_text(tokenizer: PreTrainedTokenizerBase, example: Example) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE])


def masked_ids(example: Example) -> list[int]:
    return [t for t, label in zip(example.input_ids, example.labels, strict=True) if label == IGNORE]


# -- the loss mask -------------------------------------------------------------------------------------


def test_the_loss_mask_is_exactly_the_assistant_text_and_its_end(smol_tokenizer: PreTrainedTokenizerBase) -> None:
    example = render_example(smol_tokenizer, HISTORY, TOOLS, completion=answer("Rome is cloudy, 18 C."))
    assert trained_text(smol_tokenizer, example) == "Rome is cloudy, 18 C.<|im_end|>"
    # Everything before it — system with the tools, users, earlier assistant turns with their calls, tool
    # results — is the prompt exactly as the backend encodes it, and masked.
    prompt = encode_prompt(smol_tokenizer, HISTORY, TOOLS)
    assert masked_ids(example) == prompt and example.input_ids[:len(prompt)] == prompt
    rendered = smol_tokenizer.decode(prompt)
    assert "<tool_response>\nTool get_weather failed" in rendered and '"city": "Rome"' in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert example.kind == "task" and len(example.labels) == len(example.input_ids)


def test_a_tool_call_completion_is_trained_in_the_hermes_form(smol_tokenizer: PreTrainedTokenizerBase) -> None:
    reply = {"role": "assistant", "content": None, "tool_calls": [call("c3", "Rome")]}
    example = render_example(smol_tokenizer, HISTORY, TOOLS, completion=reply)
    expected = hermes_tool_call_text("get_weather", {"city": "Rome"}) + "<|im_end|>"
    assert trained_text(smol_tokenizer, example) == expected
    assert trained_text(smol_tokenizer, example) == \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'


def test_captured_ids_are_kept_and_end_with_a_stop(smol_tokenizer: PreTrainedTokenizerBase) -> None:
    end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = encode_prompt(smol_tokenizer, HISTORY, TOOLS)
    words = smol_tokenizer("Rome is cloudy.", add_special_tokens=False)["input_ids"]
    stopped = render_example(smol_tokenizer, HISTORY, TOOLS, completion_ids=[*words, end], prompt_ids=prompt)
    assert stopped.input_ids == [*prompt, *words, end]
    assert stopped.labels == [IGNORE] * len(prompt) + [*words, end]
    # Ids recorded without their stop token (another backend) get the end of turn, so the model learns to stop...
    assert render_example(smol_tokenizer, HISTORY, TOOLS, completion_ids=words).input_ids[-1] == end
    # ...unless the generation was cut off by the length limit: then it did not end there.
    cut = render_example(smol_tokenizer, HISTORY, TOOLS, completion_ids=words, finished=False)
    assert cut.input_ids == [*prompt, *words]
    cut_text = render_example(smol_tokenizer, HISTORY, TOOLS, completion=answer("Rome is"), finished=False)
    assert trained_text(smol_tokenizer, cut_text) == "Rome is"


def test_long_rows_lose_prompt_from_the_left_never_completion(smol_tokenizer: PreTrainedTokenizerBase) -> None:
    full = render_example(smol_tokenizer, HISTORY, TOOLS, completion=answer("Rome is cloudy, 18 C."))
    completion = [t for t, label in zip(full.input_ids, full.labels, strict=True) if label != IGNORE]
    cut = render_example(smol_tokenizer, HISTORY, TOOLS, completion=answer("Rome is cloudy, 18 C."), max_seq_len=40)
    assert len(cut.input_ids) == 40
    assert cut.input_ids == full.input_ids[-40:] and cut.labels == full.labels[-40:]
    assert [t for t, label in zip(cut.input_ids, cut.labels, strict=True) if label != IGNORE] == completion
    with pytest.raises(TooLong):
        render_example(smol_tokenizer, HISTORY, TOOLS, completion=answer("Rome is cloudy, 18 C."),
                       max_seq_len=len(completion))  # no prompt token would be left to predict the first from


# -- recovered -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("messages", "status", "expected"), [
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", "Tool get_weather failed: boom"), answer("It is sunny.")], "completed", True),
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", "Tool get_weather timed out after 5s"), answer("Sunny.")], None, True),
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", ""), answer("Sunny.")], "completed", True),  # an empty result counts as a failure
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", "Sunny"), answer("Sunny.")], "completed", False),  # nothing failed
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", "Tool get_weather failed: boom"), answer("Sunny.")], "terminated", False),  # stopped by a limit
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", "Tool get_weather failed: boom"),
      {"role": "assistant", "content": None, "tool_calls": [call("b", "X")]}], "completed", False),  # no answer yet
    ([user("q"), {"role": "assistant", "content": None, "tool_calls": [call("a", "X")]},
      tool("a", "Tool get_weather failed: boom"), answer("  ")], "completed", False),  # an empty answer
    ([user("Tool use failed for me yesterday"), answer("Sorry to hear that.")], "completed", False),  # not a tool
])
def test_recovered_means_a_failed_tool_then_a_final_answer(messages: list[dict[str, Any]], status: str | None,
                                                           expected: bool) -> None:
    assert is_recovered(messages, status) is expected


# -- rows from a store ---------------------------------------------------------------------------------


async def test_store_rows_count_recovered_rendered_too_long_and_excluded(
        tmp_path: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    path = tmp_path / "store.db"
    store = await builders.open_store(path)
    try:
        # The builders record fake token ids, which no fresh encoding matches: those rows are re-rendered.
        recovered = await builders.agent_trajectory(store, "What is 2+2?", result="Tool calculator failed: boom",
                                                    final="4", status="completed")
        plain = await builders.agent_trajectory(store, "What is 3+3?", result="6", final="6", status="completed")
        secret = await builders.agent_trajectory(store, "What is 9+9? TEST-SPLIT", final="18", status="completed",
                                                 token_ids=False)
        long = await builders.write(store, [([user("Say a lot")], answer("word " * 300))], status="completed")
    finally:
        await store.close()

    examples, stats = examples_from_store(path, Filters(), smol_tokenizer, max_seq_len=256,
                                          exclude=lambda text: "TEST-SPLIT" in text)
    assert stats.trajectories == 4 and stats.calls == 7
    assert stats.excluded == 2 and stats.too_long == 1
    # Each two-call trajectory is one row: the call and the answer both labelled in the answer's row.
    assert stats.merged == 2 and stats.rows == len(examples) == 2
    assert stats.mismatched == 2 and stats.rendered == 2 and stats.captured == 0
    assert [(e.trajectory_id, e.seq, e.recovered) for e in examples] == [(recovered, 1, True), (plain, 1, False)]
    assert stats.recovered == 1
    assert secret not in {e.trajectory_id for e in examples} and long not in {e.trajectory_id for e in examples}
    row = examples[0]
    assert trained_text(smol_tokenizer, row) == \
        '<tool_call>\n{"name": "calculator", "arguments": {"expr": "2+2"}}\n</tool_call><|im_end|>4<|im_end|>'
    assert "Tool calculator failed: boom" in smol_tokenizer.decode(masked_ids(row))


async def test_an_invalid_call_is_context_never_a_label_and_the_recovery_is_trained(
        tmp_path: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    bad = {"role": "assistant", "content": None, "tool_calls": [call("c1", "Rome")]}
    bad["tool_calls"][0]["function"]["arguments"] = json.dumps({"town": "Rome"})  # not the schema's "city"
    good = {"role": "assistant", "content": None, "tool_calls": [call("c2", "Rome")]}
    error = tool("c1", "Invalid arguments for get_weather: 'city' is a required property")
    first = [SYSTEM, user("Weather in Rome?")]
    second = [*first, bad, error]
    third = [*second, good, tool("c2", "Cloudy, 18 C")]
    path = tmp_path / "store.db"
    store = await builders.open_store(path)
    try:
        tid = await builders.write(store, [(first, bad), (second, good), (third, answer("Rome is cloudy, 18 C."))],
                                   status="completed", tools=TOOLS, token_ids=False)
        split = await builders.write(store, [(first, bad), ([SYSTEM, user("Start again.")], answer("Fine."))],
                                     status="completed", tools=TOOLS, token_ids=False)
    finally:
        await store.close()
    examples, stats = examples_from_store(path, Filters(), smol_tokenizer, max_seq_len=4096)
    assert stats.masked == 2 and stats.merged == 1
    merged = next(e for e in examples if e.trajectory_id == tid)
    text = trained_text(smol_tokenizer, merged)
    assert '"town"' not in text and '"city": "Rome"' in text and text.endswith("Rome is cloudy, 18 C.<|im_end|>")
    assert '"town"' in smol_tokenizer.decode(masked_ids(merged))  # the mistake stays in the context
    # History rewritten between calls: a row per call, and the invalid one is no row at all.
    assert [(e.trajectory_id, e.seq) for e in examples if e.trajectory_id == split] == [(split, 1)]


# -- render equality with what the local backend served ------------------------------------------------


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


TOOL_CALL_TEXT = hermes_tool_call_text("get_weather", {"city": "Rome"}) + "<|im_end|>"
FINAL_TEXT = "Rome is cloudy, 18 C.<|im_end|>"


async def test_rendered_rows_equal_what_the_local_backend_generated_from(
        tiny_model_dir: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    backend = LocalBackend(BackendSettings(name="local", kind="local", model_path=str(tiny_model_dir),
                                           batch_wait_ms=1))
    await backend.start()
    try:
        _script(backend, _ids(smol_tokenizer, TOOL_CALL_TEXT))
        first = await backend.chat(ChatRequest(body={"messages": HISTORY, "tools": TOOLS, "temperature": 0,
                                                     "max_tokens": 64}, model="tiny"))
        reply = first.message
        assert reply["tool_calls"] and first.response["choices"][0]["finish_reason"] == "tool_calls"
        history = [*HISTORY, reply, tool(reply["tool_calls"][0]["id"], "Cloudy, 18 C")]
        _script(backend, _ids(smol_tokenizer, FINAL_TEXT))
        second = await backend.chat(ChatRequest(body={"messages": history, "tools": TOOLS, "max_tokens": 64},
                                                model="tiny"))
        _script(backend, _ids(smol_tokenizer, FINAL_TEXT))
        cut = await backend.chat(ChatRequest(body={"messages": history, "tools": TOOLS, "max_tokens": 3},
                                             model="tiny"))
    finally:
        await backend.aclose()

    for messages, result in ((HISTORY, first), (history, second)):
        extras = result.extras
        assert extras.prompt_token_ids is not None and extras.completion_token_ids is not None
        # The backend records every generated id, the stop token included.
        assert extras.completion_token_ids[0][-1] == smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
        # Rendered from the messages alone, the row is token for token what the model saw and wrote.
        rendered = render_example(smol_tokenizer, messages, TOOLS, completion=result.message)
        prompt = extras.prompt_token_ids
        assert rendered.input_ids[:len(prompt)] == prompt
        assert rendered.input_ids[len(prompt):] == extras.completion_token_ids[0]
        assert rendered.labels == [IGNORE] * len(prompt) + extras.completion_token_ids[0]
        captured = render_example(smol_tokenizer, messages, TOOLS, completion_ids=extras.completion_token_ids[0],
                                  prompt_ids=prompt)
        assert captured.input_ids == rendered.input_ids and captured.labels == rendered.labels
    # Cut off by max_tokens: the ids end without a stop token, and none is added.
    assert cut.response["choices"][0]["finish_reason"] == "length"
    assert cut.extras.completion_token_ids is not None and cut.extras.prompt_token_ids is not None
    truncated = render_example(smol_tokenizer, history, TOOLS, completion_ids=cut.extras.completion_token_ids[0],
                               prompt_ids=cut.extras.prompt_token_ids, finished=False)
    assert truncated.input_ids[len(cut.extras.prompt_token_ids):] == cut.extras.completion_token_ids[0]


@pytest.fixture
async def gateway_app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[tuple[Any, list[ChatResult]]]:
    """A real gateway (in-process) on the tiny model, recording into a temp store; yields the app and every
    ChatResult its local backend returned."""
    settings = HarnessSettings.model_validate({
        "store": {"path": str(tmp_path / "harness.db")},
        "backends": [{"name": "local", "kind": "local", "model_path": str(tiny_model_dir), "models": ["tiny"],
                      "batch_wait_ms": 1}],
        "routing": {"adapters_dir": str(tmp_path / "adapters")},
    })
    app = build_app(settings)
    gateway = app.state.gateway
    await gateway.start()
    backend = gateway.backends[0]
    results: list[ChatResult] = []
    chat = backend.chat

    async def recording_chat(request: ChatRequest) -> ChatResult:
        result = await chat(request)
        results.append(result)
        return result

    backend.chat = recording_chat
    try:
        yield app, results
    finally:
        await gateway.stop()


async def test_store_round_trip_trains_on_the_exact_ids_served(
        gateway_app: tuple[Any, list[ChatResult]], tmp_path: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    app, results = gateway_app
    backend = app.state.gateway.backends[0]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        _script(backend, _ids(smol_tokenizer, TOOL_CALL_TEXT))
        body = {"model": "tiny", "messages": HISTORY, "tools": TOOLS, "temperature": 0, "max_tokens": 64}
        first = (await client.post("/v1/chat/completions", json=body)).json()
        reply = first["choices"][0]["message"]
        history = [*HISTORY, reply, tool(reply["tool_calls"][0]["id"], "Cloudy, 18 C")]
        _script(backend, _ids(smol_tokenizer, FINAL_TEXT))
        response = await client.post("/v1/chat/completions", json={**body, "messages": history})
        assert response.status_code == 200, response.text
    await app.state.gateway.store.close()  # everything committed before reading the file

    # The store keeps JSON with sorted keys, so the tool specs read back differ in key order from those sent
    # (TOOLS lists name, description, parameters): they render the same, so the captured ids are recognised.
    examples, stats = examples_from_store(tmp_path / "harness.db", Filters(), smol_tokenizer, max_seq_len=4096)
    assert stats.trajectories == 1 and stats.merged == 1 and stats.captured == 1 and stats.mismatched == 0
    assert len(results) == 2 and len(examples) == 1
    [row] = examples
    first, second = (r.extras for r in results)
    # The last call's prompt and reply, exactly as served; the first reply labelled where it lies in that prompt,
    # and those labels are the very ids the model generated at the first step.
    assert row.input_ids == second.prompt_token_ids + second.completion_token_ids[0]
    start = len(first.prompt_token_ids)
    end = start + len(first.completion_token_ids[0])
    assert row.input_ids[:start] == first.prompt_token_ids
    assert row.labels[start:end] == first.completion_token_ids[0]
    assert row.labels[len(second.prompt_token_ids):] == second.completion_token_ids[0]
    assert all(label == IGNORE for label in row.labels[:start] + row.labels[end:len(second.prompt_token_ids)])
    assert trained_text(smol_tokenizer, row) == TOOL_CALL_TEXT + FINAL_TEXT
    # Training in another rendering than the one served: the captured ids are not that prompt, so re-rendered.
    compact, stats = examples_from_store(tmp_path / "harness.db", Filters(), smol_tokenizer, max_seq_len=4096,
                                         rendering="compact")
    assert stats.captured == 0 and stats.rendered == stats.mismatched == 1
    prompt = encode_prompt(smol_tokenizer, HISTORY, TOOLS, rendering="compact")
    assert compact[0].input_ids[:len(prompt)] == prompt


async def test_production_traffic_without_a_verifier_trains_on_what_users_rated_up(
        gateway_app: tuple[Any, list[ChatResult]], tmp_path: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    """The documented path (docs/training.md, "Traffic that is not a suite"): a user's thumbs are task success,
    the reward engine totals them, and --min-reward 0.7 keeps only what was rated up."""
    app, _ = gateway_app
    backend = app.state.gateway.backends[0]
    ids = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        for rating in ("up", "down", None):
            _script(backend, _ids(smol_tokenizer, FINAL_TEXT))
            body = {"model": "tiny", "max_tokens": 64,
                    "messages": [{"role": "system", "content": f"You answer questions ({rating})."},
                                 user("What is the weather in Rome?")]}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            ids[rating] = response.headers["X-Harness-Trajectory-Id"]
            if rating is not None:
                rated = await client.post(f"/v1/trajectories/{ids[rating]}/feedback", json={"rating": rating})
                assert rated.status_code == 201, rated.text
    await app.state.gateway.store.close()

    store = TrajectoryStore(str(tmp_path / "harness.db"))
    await store.start()
    try:
        summary = await recompute(store, Filters(source="proxy"), RewardSettings())
    finally:
        await store.close()
    assert summary.count == 3 and summary.unknown_success == 1  # the unrated one: success unknown
    examples, stats = examples_from_store(tmp_path / "harness.db", Filters(source="proxy", min_reward=0.7),
                                          smol_tokenizer, max_seq_len=4096)
    assert stats.trajectories == 1 and [e.trajectory_id for e in examples] == [ids["up"]]
    assert stats.captured == 1 and trained_text(smol_tokenizer, examples[0]) == FINAL_TEXT


# Keys in the order a client sends them (name, description, parameters), which the store does not keep.
DEMO_MESSAGES = [SYSTEM, user("Weather in Rome?"), {"role": "assistant", "content": None,
                                                     "tool_calls": [call("c1", "Rome")]},
                 tool("c1", "Cloudy, 18 C"), answer("Rome is cloudy, 18 C.")]


@pytest.mark.parametrize("rendering", ["hermes", "compact"])
async def test_demonstrations_and_imports_train_on_the_prompt_the_engine_generates_from(
        tmp_path: Path, tiny_model_dir: Path, smol_tokenizer: PreTrainedTokenizerBase, rendering: str) -> None:
    path = tmp_path / "store.db"
    store = await builders.open_store(path)
    try:
        # A demonstration as `harness capture` writes one; an import as `harness replay import` reads a file.
        await store.write(build_op([Conversation(line=1, messages=DEMO_MESSAGES, tools=TOOLS)], source=DEMO))
        file = tmp_path / "import.jsonl"
        file.write_text(json.dumps({"messages": DEMO_MESSAGES, "tools": TOOLS}) + "\n")
        await import_conversations(store, read_file(file), source="import")
    finally:
        await store.close()
    examples, stats = examples_from_store(path, Filters(), smol_tokenizer, max_seq_len=4096, rendering=rendering)
    assert stats.trajectories == 2 and stats.merged == stats.rendered == len(examples) == 2

    backend = LocalBackend(BackendSettings(name="local", kind="local", model_path=str(tiny_model_dir),
                                           tool_rendering=rendering))
    await backend.start()
    try:
        turns = [i for i, m in enumerate(DEMO_MESSAGES) if m["role"] == "assistant"]
        served = [(await backend._prepare(ChatRequest(body={"messages": DEMO_MESSAGES[:i], "tools": TOOLS},
                                                      model="tiny"))).prompt_ids for i in turns]
    finally:
        await backend.aclose()
    assert served[0] != encode_prompt(smol_tokenizer, DEMO_MESSAGES[:turns[0]], TOOLS,
                                      rendering="compact" if rendering == "hermes" else "hermes")
    for row in examples:  # each call's prompt, token for token, is what the engine generates from
        assert row.input_ids[:len(served[0])] == served[0] and row.input_ids[:len(served[1])] == served[1]
        assert all(label == IGNORE for label in row.labels[:len(served[0])])
        assert trained_text(smol_tokenizer, row) == TOOL_CALL_TEXT + FINAL_TEXT


# -- mixing --------------------------------------------------------------------------------------------


def _rows(n: int, *, kind: str = "task", recovered: bool = False, start: int = 0) -> list[Example]:
    return [Example(input_ids=[i, i], labels=[IGNORE, i], trajectory_id=f"{kind}{i}", seq=0, kind=kind,
                    recovered=recovered) for i in range(start, start + n)]


def test_mix_reaches_the_configured_shares_deterministically() -> None:
    task = _rows(90) + _rows(10, recovered=True, start=90)
    general = _rows(50, kind="general")
    mixed = mix(task, general, min_recovered_share=0.3, general_share=0.2, seed=7)
    tasks = [e for e in mixed if e.kind == "task"]
    generals = [e for e in mixed if e.kind == "general"]
    assert sum(e.recovered for e in tasks) / len(tasks) >= 0.3
    assert sum(e.recovered for e in tasks) / len(tasks) < 0.31  # no more repeats than needed
    assert {e.trajectory_id for e in tasks if not e.recovered} == {f"task{i}" for i in range(90)}
    assert len(generals) / len(mixed) == pytest.approx(0.2, abs=0.01)
    assert len(set(map(id, generals))) == len(generals)  # enough general rows: no repeats
    assert mix(task, general, min_recovered_share=0.3, general_share=0.2, seed=7) == mixed
    assert mix(task, general, min_recovered_share=0.3, general_share=0.2, seed=8) != mixed


def test_mix_repeats_general_rows_when_too_few_and_leaves_shares_already_met() -> None:
    task = _rows(50) + _rows(50, recovered=True, start=50)
    general = _rows(3, kind="general")
    mixed = mix(task, general, min_recovered_share=0.2, general_share=0.5, seed=0)
    assert sum(e.kind == "task" for e in mixed) == 100  # recovered share already met: nothing repeated
    assert sum(e.kind == "general" for e in mixed) == 100
    assert {e.trajectory_id for e in mixed if e.kind == "general"} == {"general0", "general1", "general2"}
    # No recovered rows at all: nothing to repeat; no general rows: none added.
    assert len(mix(_rows(10), [], min_recovered_share=0.5, general_share=0.3, seed=0)) == 10


# -- general data --------------------------------------------------------------------------------------


def test_shipped_prompts_are_plain_and_varied() -> None:
    prompts = general_data.load_prompts()
    assert 100 <= len(prompts) <= 150 and len(set(prompts)) == len(prompts)
    assert all(isinstance(p, str) and 10 < len(p) < 200 for p in prompts)


def test_general_answers_are_generated_once_and_cached(tiny_model_dir: Path, tmp_path: Path,
                                                       smol_tokenizer: PreTrainedTokenizerBase,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about topic {i}."}) + "\n" for i in range(5)))
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    first = general_conversations(model, smol_tokenizer, cache_dir=tmp_path / "cache", max_new_tokens=4,
                                  prompts_path=prompts, batch_size=2)
    assert [c[0] for c in first] == [user(f"Tell me about topic {i}.") for i in range(5)]
    assert all(c[1]["role"] == "assistant" and c[1]["finish_reason"] == "length" for c in first)
    [cached] = list((tmp_path / "cache").iterdir())
    assert load_conversations(cached) == first

    def no_generation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(general_data, "_greedy", no_generation)
    assert general_conversations(model, smol_tokenizer, cache_dir=tmp_path / "cache", max_new_tokens=4,
                                 prompts_path=prompts) == first


def test_general_split_and_examples(smol_tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    conversations = [[user(f"Question {i}?"), answer(f"Answer {i}.")] for i in range(20)]
    train, held = split_general(conversations, held_out=0.25, seed=3)
    assert len(held) == 5 and len(train) == 15 and sorted(map(str, train + held)) == sorted(map(str, conversations))
    assert split_general(conversations, held_out=0.25, seed=3) == (train, held)
    examples = general_examples(smol_tokenizer, held, max_seq_len=512)
    assert [e.kind for e in examples] == ["general"] * 5
    assert trained_text(smol_tokenizer, examples[0]) == held[0][1]["content"] + "<|im_end|>"
    cut = general_examples(smol_tokenizer, [[user("q"), {**answer("Half an"), "finish_reason": "length"}]], 512)
    assert trained_text(smol_tokenizer, cut[0]) == "Half an"
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"messages": conversations[0]}) + "\n\n")
    assert load_conversations(path) == [conversations[0]]
    path.write_text(json.dumps({"messages": [user("no reply")]}) + "\n")
    with pytest.raises(ValueError, match="mine.jsonl:1"):
        load_conversations(path)


# -- perplexity ----------------------------------------------------------------------------------------


def test_perplexity_is_finite_and_a_noise_adapter_raises_it(smol_tokenizer: PreTrainedTokenizerBase) -> None:
    from peft import LoraConfig, get_peft_model

    conversations = [[user(f"What is {i} plus {i}?"), answer(f"The answer is {2 * i}.")] for i in range(4)]
    examples = general_examples(smol_tokenizer, conversations, max_seq_len=256)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=smol_tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Fit the answers first, so the base model has something for the noise to spoil.
    batch = batches.pad_batch(examples, smol_tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-2)
    for _ in range(12):
        label_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    base = perplexity(model, smol_tokenizer, examples, batch_size=3)
    assert math.isfinite(base) and 1 < base < 100
    # Per text, in the examples' order, whatever the batching: what the gate pairs text by text.
    losses = batches.example_losses(model, smol_tokenizer, examples, batch_size=3)
    assert [t for _, t in losses] == [sum(label != IGNORE for label in e.labels) for e in examples]
    for (nll, tokens), alone in zip(losses, (batches.example_losses(model, smol_tokenizer, [e])[0] for e in examples),
                                    strict=True):
        assert nll == pytest.approx(alone[0], rel=1e-4) and tokens == alone[1]
    assert math.exp(sum(n for n, _ in losses) / sum(t for _, t in losses)) == pytest.approx(base)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj",
                                                                                      "down_proj"]))
    assert perplexity(peft_model, smol_tokenizer, examples) == pytest.approx(base)  # peft's init changes nothing
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    noisy = perplexity(peft_model, smol_tokenizer, examples)
    assert math.isfinite(noisy) and noisy > 100 * base
    with peft_model.disable_adapter():
        assert perplexity(peft_model, smol_tokenizer, examples) == pytest.approx(base)
