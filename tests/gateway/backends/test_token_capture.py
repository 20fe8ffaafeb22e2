"""Sampled token ids and log-probabilities as SGLang and vLLM send them, read into extras and taken out of the answer,
and this gateway's own form of them, both ways."""

from __future__ import annotations

import copy
from typing import Any

from gateway.backends import token_capture
from gateway.backends.base import CallExtras


def _answer(**choice: Any) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "a b"}, "finish_reason": "stop", **choice}]}


def _content(*logprobs: float) -> dict[str, Any]:
    return {"content": [{"token": "t", "logprob": lp, "bytes": [116], "top_logprobs": []} for lp in logprobs]}


def test_sglang_fields_become_sampled_logprobs_and_leave_the_answer() -> None:
    answer = _answer(logprobs=_content(-0.5, -1.25), prompt_token_ids=[1, 2, 3],
                     meta_info={"id": "x", "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None]]})
    extras = token_capture.from_sglang(answer, logprobs_asked=False)
    assert extras == CallExtras(prompt_token_ids=[1, 2, 3], completion_token_ids=[[7, 8]],
                                completion_logprobs=None, completion_sampled_logprobs=[[-0.5, -1.25]])
    assert set(answer["choices"][0]) == {"index", "message", "finish_reason", "logprobs"}
    assert answer["choices"][0]["logprobs"] is None  # the caller did not ask for them

    asked = _answer(logprobs=_content(-0.5), meta_info={"output_token_logprobs": [[-0.5, 7, None]]})
    token_capture.from_sglang(asked, logprobs_asked=True)
    assert asked["choices"][0]["logprobs"] == _content(-0.5)


def test_sglang_without_logprobs_content_reads_them_from_meta_info() -> None:
    answer = _answer(meta_info={"output_token_logprobs": [[-0.25, 4, "a"], [-0.75, 5, "b"]]})
    extras = token_capture.from_sglang(answer, logprobs_asked=False)
    assert extras.completion_token_ids == [[4, 5]] and extras.completion_sampled_logprobs == [[-0.25, -0.75]]


def test_vllm_fields_become_the_models_own_logprobs() -> None:
    answer = {**_answer(logprobs=_content(-0.5, -1.0), token_ids=[7, 8]), "prompt_token_ids": [1, 2]}
    extras = token_capture.from_vllm(answer, logprobs_asked=False)
    assert extras == CallExtras(prompt_token_ids=[1, 2], completion_token_ids=[[7, 8]],
                                completion_logprobs=[[-0.5, -1.0]], completion_sampled_logprobs=None)
    assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]


def test_logprobs_that_do_not_cover_every_token_are_dropped_not_misaligned() -> None:
    answer = {**_answer(logprobs=_content(-0.5), token_ids=[7, 8]), "prompt_token_ids": [1]}
    extras = token_capture.from_vllm(answer, logprobs_asked=False)
    assert extras.completion_token_ids == [[7, 8]] and extras.completion_logprobs is None


def test_an_answer_without_tokens_gives_empty_extras() -> None:
    answer = _answer()
    assert token_capture.from_sglang(copy.deepcopy(answer), logprobs_asked=False) == CallExtras()
    assert token_capture.from_vllm(copy.deepcopy(answer), logprobs_asked=False) == CallExtras()


def test_the_gateways_form_round_trips() -> None:
    extras = CallExtras(prompt_token_ids=[1, 2], completion_token_ids=[[7, 8], [9]],
                        completion_logprobs=[[-0.1, -0.2], [-0.3]], completion_sampled_logprobs=[[-0.4, -0.5], [-0.6]])
    answer = _answer()
    answer["choices"].append({**answer["choices"][0], "index": 1})
    token_capture.attach(answer, extras)
    assert answer["prompt_token_ids"] == [1, 2]
    assert [c["token_ids"] for c in answer["choices"]] == [[7, 8], [9]]
    assert [c["sampled_logprobs"] for c in answer["choices"]] == [[-0.4, -0.5], [-0.6]]
    assert token_capture.read(answer) == extras
    assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]

    partial = _answer()
    token_capture.attach(partial, CallExtras(prompt_token_ids=[1], completion_token_ids=[[7]],
                                             completion_sampled_logprobs=[[-0.4]]))
    assert partial["choices"][0]["token_logprobs"] is None
    assert token_capture.read(partial) == CallExtras(prompt_token_ids=[1], completion_token_ids=[[7]],
                                                     completion_sampled_logprobs=[[-0.4]])
