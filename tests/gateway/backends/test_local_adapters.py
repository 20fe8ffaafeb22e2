"""LoRA adapters on the local backend: loading, unloading, and batches that mix adapters and the base model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("local")

from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import LlamaConfig, LlamaForCausalLM

from gateway.backends.base import AdapterNotLoaded, BackendError, ChatRequest, ChatResult, serves_adapters
from gateway.backends.local import LocalBackend
from tests.gateway.backends.conftest import local_backend

A, B = "sql@3", "chat.v2@1"  # names peft could not take as they are


def _body(text: str = "hi", **params: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 8, **params}


def _req(body: dict[str, Any], adapter: str | None = None) -> ChatRequest:
    return ChatRequest(body=body, model="tiny", adapter=adapter)


def _ids(result: ChatResult, choice: int = 0) -> list[int]:
    assert result.extras.completion_token_ids is not None
    return result.extras.completion_token_ids[choice]


async def _run(backend: LocalBackend, body: dict[str, Any], adapter: str | None = None) -> list[int]:
    return _ids(await backend.chat(_req(body, adapter)))


def _lora_layers(backend: LocalBackend) -> int:
    assert backend._engine is not None
    return sum(isinstance(m, BaseTunerLayer) for m in backend._engine.base_model.modules())


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    b = local_backend(tiny_model_dir, batch_wait_ms=30, max_batch_size=16)
    await b.start()
    yield b
    await b.aclose()


@pytest.fixture
async def with_adapters(backend: LocalBackend, lora_adapters: dict[str, Path]) -> LocalBackend:
    await backend.load_adapter(A, str(lora_adapters["a"]))
    await backend.load_adapter(B, str(lora_adapters["b"]))
    return backend


async def test_adapters_change_the_output_and_the_base_is_unchanged(backend: LocalBackend,
                                                                    lora_adapters: dict[str, Path]) -> None:
    body = _body("Tell me something", max_tokens=10)
    before = await _run(backend, body)
    assert serves_adapters(backend) and _lora_layers(backend) == 0
    await backend.load_adapter(A, str(lora_adapters["a"]))
    await backend.load_adapter(B, str(lora_adapters["b"]))
    assert await backend.loaded_adapters() == {A, B}
    base, a, b = await _run(backend, body), await _run(backend, body, A), await _run(backend, body, B)
    assert base == before  # base rows run through peft as "__base__": untouched by any adapter
    assert len({tuple(base), tuple(a), tuple(b)}) == 3
    assert await _run(backend, body, A) == a  # and deterministic


async def test_a_mixed_batch_matches_solo_runs(with_adapters: LocalBackend) -> None:
    backend = with_adapters
    # Different prompt lengths, and rows leaving the batch at different steps.
    plan = [(_body(f"question {i} " + "word " * (2 * i), max_tokens=4 + i), adapter)
            for i, adapter in enumerate([A, B, None, B, None, A, None, A, B])]
    solo = [await _run(backend, body, adapter) for body, adapter in plan]
    passes = backend.forward_passes
    batched = await asyncio.gather(*(backend.chat(_req(body, adapter)) for body, adapter in plan))
    batched_passes = backend.forward_passes - passes
    assert batched_passes <= 16, f"9 concurrent requests took {batched_passes} forward passes"
    assert [_ids(r) for r in batched] == solo


async def test_n_copies_keep_their_adapter(with_adapters: LocalBackend) -> None:
    backend = with_adapters
    body = _body("copies")
    solo = {adapter: await _run(backend, body, adapter) for adapter in (A, B, None)}
    results = await asyncio.gather(*(backend.chat(_req({**body, "n": 2}, adapter)) for adapter in (A, B, None)))
    for adapter, result in zip((A, B, None), results, strict=True):
        assert _ids(result, 0) == _ids(result, 1) == solo[adapter]


async def test_a_request_joining_a_running_batch_gets_its_own_adapter(with_adapters: LocalBackend) -> None:
    backend = with_adapters
    long_body, short_body = _body("a long one", max_tokens=40), _body("short " * 10, max_tokens=10)
    long_solo, short_solo = await _run(backend, long_body, A), await _run(backend, short_body, B)
    base_solo = await _run(backend, short_body)

    long_task = asyncio.create_task(backend.chat(_req(long_body, A)))
    start = backend.forward_passes
    while backend.forward_passes < start + 5:  # the first request is decoding
        await asyncio.sleep(0.001)
    short, base = await asyncio.gather(backend.chat(_req(short_body, B)), backend.chat(_req(short_body)))
    assert not long_task.done()  # they joined the running batch rather than waiting for it
    assert _ids(short) == short_solo and _ids(base) == base_solo
    assert _ids(await long_task) == long_solo


async def test_a_stream_runs_on_its_adapter(with_adapters: LocalBackend) -> None:
    body = _body("stream me", max_tokens=10)
    expected = await with_adapters.chat(_req(body, B))
    stream = await with_adapters.stream(_req(body, B))
    chunks = [chunk async for chunk in stream]
    assert stream.extras.completion_token_ids == expected.extras.completion_token_ids
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        expected.response["choices"][0]["message"]["content"]


async def test_an_unknown_adapter_is_adapter_not_loaded(with_adapters: LocalBackend) -> None:
    for call in (with_adapters.chat, with_adapters.stream):
        with pytest.raises(AdapterNotLoaded) as info:
            await call(_req(_body(), "nope@1"))
        assert info.value.adapter == "nope@1" and info.value.status_code == 404
        assert info.value.code == "adapter_not_loaded"


async def test_loading_a_loaded_name_again_is_a_no_op(backend: LocalBackend, lora_adapters: dict[str, Path]) -> None:
    await backend.load_adapter(A, str(lora_adapters["a"]))
    a = await _run(backend, _body(), A)
    # Again, and twice at once: one load; the other adapter's path under the same name changes nothing.
    await asyncio.gather(backend.load_adapter(A, str(lora_adapters["b"])),
                         backend.load_adapter(A, str(lora_adapters["b"])))
    assert await backend.loaded_adapters() == {A}
    assert len(backend._engine.adapters) == 1
    assert await _run(backend, _body(), A) == a


async def test_concurrent_loads_of_one_new_name_load_it_once(backend: LocalBackend,
                                                             lora_adapters: dict[str, Path]) -> None:
    await asyncio.gather(*(backend.load_adapter(A, str(lora_adapters["a"])) for _ in range(3)))
    assert await backend.loaded_adapters() == {A} and len(backend._engine.adapters) == 1


async def test_a_load_whose_caller_gave_up_still_completes(backend: LocalBackend,
                                                           lora_adapters: dict[str, Path]) -> None:
    caller = asyncio.create_task(backend.load_adapter(A, str(lora_adapters["a"])))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(asyncio.shield(backend._loading[A]), 5)
    # In the model and known here, never one without the other.
    assert await backend.loaded_adapters() == {A} and len(backend._engine.adapters) == 1
    assert await _run(backend, _body(), A) != await _run(backend, _body())


async def test_unloading(with_adapters: LocalBackend) -> None:
    backend = with_adapters
    body = _body("after unloading")
    b = await _run(backend, body, B)
    await backend.unload_adapter(A)
    await backend.unload_adapter(A)  # not loaded any more: fine
    await backend.unload_adapter("never@1")
    assert await backend.loaded_adapters() == {B}
    with pytest.raises(AdapterNotLoaded):
        await backend.chat(_req(body, A))
    assert await _run(backend, body, B) == b  # the other one is untouched

    await backend.unload_adapter(B)
    assert await backend.loaded_adapters() == set()
    assert backend._engine.peft is None and _lora_layers(backend) == 0  # the plain model again
    assert await _run(backend, body) == await _run(backend, body)


async def test_the_base_after_unloading_everything_matches_the_base_before(backend: LocalBackend,
                                                                           lora_adapters: dict[str, Path]) -> None:
    body = _body("base", max_tokens=10)
    before = await _run(backend, body)
    await backend.load_adapter(A, str(lora_adapters["a"]))
    await backend.unload_adapter(A)
    assert await _run(backend, body) == before
    await backend.load_adapter(A, str(lora_adapters["a"]))  # and it can be loaded again
    assert await _run(backend, body, A) != before


def _adapter_for_another_model(folder: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(folder)
    return folder


async def test_bad_adapters_are_400s_and_leave_the_model_as_it_was(backend: LocalBackend, tmp_path: Path,
                                                                   lora_adapters: dict[str, Path]) -> None:
    body = _body("still fine")
    before = await _run(backend, body)
    wrong_target = tmp_path / "wrong-target"
    wrong_target.mkdir()
    config = json.loads((lora_adapters["a"] / "adapter_config.json").read_text())
    (wrong_target / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["nowhere_proj"]}))
    (wrong_target / "adapter_model.safetensors").write_bytes((lora_adapters["a"] / "adapter_model.safetensors")
                                                             .read_bytes())
    not_lora = tmp_path / "not-lora"
    not_lora.mkdir()
    (not_lora / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    (not_lora / "adapter_model.safetensors").write_bytes(b"")
    bad = {
        "missing": tmp_path / "nowhere",
        "empty": tmp_path,
        "not-lora": not_lora,
        "wrong-target": wrong_target,
        "wrong-shape": _adapter_for_another_model(tmp_path / "other-model"),
    }

    async def check_refused() -> None:
        for label, path in bad.items():
            with pytest.raises(BackendError) as info:
                await backend.load_adapter(f"bad-{label}@1", str(path))
            error = info.value
            assert (error.status_code, error.error_type, error.code) == (400, "invalid_request_error",
                                                                         "adapter_load_failed"), label
            assert f"bad-{label}@1" in error.message and str(path) in error.message

    await check_refused()  # while the model is plain: a failed first load must unwrap it fully
    assert backend._engine.peft is None and _lora_layers(backend) == 0
    assert await backend.loaded_adapters() == set()
    assert await _run(backend, body) == before

    await backend.load_adapter(A, str(lora_adapters["a"]))
    a = await _run(backend, body, A)
    await check_refused()  # while wrapped: the good adapter survives
    assert await backend.loaded_adapters() == {A} and len(backend._engine.adapters) == 1
    assert await _run(backend, body, A) == a and await _run(backend, body) == before


async def test_loading_while_a_generation_runs(backend: LocalBackend, lora_adapters: dict[str, Path]) -> None:
    long_body = _body("a long one", max_tokens=200)
    solo = await _run(backend, long_body)
    task = asyncio.create_task(backend.chat(_req(long_body)))
    start = backend.forward_passes
    while backend.forward_passes < start + 3:
        await asyncio.sleep(0.001)
    await backend.load_adapter(A, str(lora_adapters["a"]))
    assert not task.done()  # the load did not wait for the generation to end
    a = await _run(backend, _body(), A)  # nor does a request for the new adapter
    assert not task.done()
    assert _ids(await task) == solo
    assert await _run(backend, _body(), A) == a


async def test_unloading_waits_for_the_requests_still_using_it(with_adapters: LocalBackend) -> None:
    backend = with_adapters
    long_body = _body("a long one", max_tokens=200)
    solo = await _run(backend, long_body, A)
    task = asyncio.create_task(backend.chat(_req(long_body, A)))
    start = backend.forward_passes
    while backend.forward_passes < start + 3:
        await asyncio.sleep(0.001)
    unload = asyncio.create_task(backend.unload_adapter(A))
    await asyncio.sleep(0)
    with pytest.raises(AdapterNotLoaded):  # new requests are refused at once
        await backend.chat(_req(_body(), A))
    assert await _run(backend, _body(), B)  # others are served meanwhile
    assert not task.done() and not unload.done()
    assert _ids(await task) == solo  # the running one finishes with its adapter
    await asyncio.wait_for(unload, 5)
    assert backend._engine.adapters == {backend._adapters[B].internal}


async def test_closing_the_backend_with_adapters_loaded(with_adapters: LocalBackend) -> None:
    await with_adapters.aclose()
    assert await with_adapters.loaded_adapters() == set()
    await with_adapters.unload_adapter(A)  # nothing to do
    with pytest.raises(BackendError):
        await with_adapters.load_adapter(A, "/nowhere")


def test_the_fixture_adapters_are_real_loras(lora_adapters: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    for folder in lora_adapters.values():
        weights = load_file(folder / "adapter_model.safetensors")
        assert weights and all(t.abs().sum() > 0 for t in weights.values())


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]


async def test_an_adapter_is_served_the_tool_rendering_it_was_trained_with(
        backend: LocalBackend, lora_adapters: dict[str, Path], tmp_path: Path, smol_tokenizer) -> None:  # noqa: ANN001
    import shutil

    from gateway.backends.local.adapters import write_rendering
    from gateway.prompting import encode_prompt

    compact = tmp_path / "compact"
    shutil.copytree(lora_adapters["a"], compact)
    write_rendering(compact, "compact")
    await backend.load_adapter(A, str(compact))
    await backend.load_adapter(B, str(lora_adapters["b"]))  # records nothing: the backend's own rendering
    body = {**_body("define cat"), "tools": TOOLS}
    messages = body["messages"]
    prompts = {name: (await backend._prepare(_req(body, name))).prompt_ids for name in (A, B, None)}
    assert prompts[A] == encode_prompt(smol_tokenizer, messages, TOOLS, rendering="compact")
    assert prompts[B] == prompts[None] == encode_prompt(smol_tokenizer, messages, TOOLS, rendering="hermes")
    assert len(prompts[A]) < len(prompts[None])

    bogus = tmp_path / "bogus"
    shutil.copytree(lora_adapters["a"], bogus)
    (bogus / "rendering.json").write_text(json.dumps({"rendering": "yaml"}))
    with pytest.raises(BackendError) as raised:
        await backend.load_adapter("bogus@1", str(bogus))
    assert raised.value.status_code == 400 and "unknown tool rendering" in str(raised.value)


async def test_a_lone_adapter_runs_merged_and_gives_what_it_gives_unmerged(tiny_model_dir: Path,
                                                                             lora_adapters: dict[str, Path]) -> None:
    body = _body("Tell me something", max_tokens=10)
    plain = local_backend(tiny_model_dir, batch_wait_ms=30, max_batch_size=16)
    merging = local_backend(tiny_model_dir, batch_wait_ms=30, max_batch_size=16, merge_lone_adapter=True)
    expected: dict[str | None, list[int]] = {}
    await plain.start()
    try:
        expected[None] = await _run(plain, body)
        for name, key in ((A, "a"), (B, "b")):
            await plain.load_adapter(name, str(lora_adapters[key]))
            expected[name] = await _run(plain, body, name)
    finally:
        await plain.aclose()
    await merging.start()
    try:
        assert merging._engine is not None
        lora = merging._engine.model
        await merging.load_adapter(A, str(lora_adapters["a"]))
        await merging.load_adapter(B, str(lora_adapters["b"]))
        # Runs of one adapter at a time merge it once; the base and a mixed batch unmerge first.
        assert [await _run(merging, body, A) for _ in range(2)] == [expected[A]] * 2
        assert lora.merged is not None and lora.merges == 1
        assert await _run(merging, body, B) == expected[B] and lora.merges == 2
        assert await _run(merging, body) == expected[None] and lora.merged is None
        mixed = await asyncio.gather(_run(merging, body, A), _run(merging, body), _run(merging, body, B))
        assert mixed == [expected[A], expected[None], expected[B]]
        # Unloading everything leaves the base weights as they were: no merged delta stays behind.
        await _run(merging, body, A)
        await merging.unload_adapter(A)
        await merging.unload_adapter(B)
        assert _lora_layers(merging) == 0 and await _run(merging, body) == expected[None]
    finally:
        await merging.aclose()
