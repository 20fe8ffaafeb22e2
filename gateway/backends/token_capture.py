"""The token ids and log-probabilities a completion was sampled with, as each server sends them, and as this
gateway sends them on (pure: no I/O).

A caller that trains on what it is answered (``replay-train --gateway``) asks with ``return_token_ids: true``.
The gateway asks its backend in the backend's own terms and answers in one form, whatever served the call:

- the response's ``prompt_token_ids``: the prompt as the model read it;
- each choice's ``token_ids``; ``token_logprobs``, the log-probabilities under the model itself; and
  ``sampled_logprobs``, under the distribution each token was drawn from (temperature applied), where the backend
  gives them;
- the header ``X-Harness-Backend``: the backend (a pool's member, one replica) that sampled it.

SGLang (``logprobs``, ``return_prompt_token_ids`` and ``return_meta_info``): each choice's ``prompt_token_ids``,
and ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]``. Its log-probabilities are taken after the
temperature unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB``, so they are read as sampled ones.
vLLM (``logprobs`` and ``return_token_ids``): the response's ``prompt_token_ids`` and each choice's ``token_ids``,
the log-probabilities in ``logprobs.content``; its default ``logprobs_mode`` is the raw model's.
"""

from __future__ import annotations

from typing import Any

from gateway.backends.base import CallExtras

GATEWAY_FIELD = "return_token_ids"
BACKEND_HEADER = "X-Harness-Backend"  # on such an answer: the backend (a pool's member) that sampled it
SGLANG_FIELDS = {"logprobs": True, "return_prompt_token_ids": True, "return_meta_info": True}
VLLM_FIELDS = {"logprobs": True, "return_token_ids": True}


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _floats(value: Any) -> list[float] | None:
    if isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    return None


def _content_logprobs(choice: dict[str, Any]) -> list[float] | None:
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list):
        return None
    return _floats([entry.get("logprob") if isinstance(entry, dict) else None for entry in content])


def _choices(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in response.get("choices") or [] if isinstance(c, dict)]


def _strip(response: dict[str, Any], keys: tuple[str, ...], *, logprobs_asked: bool) -> None:
    """The server's own fields leave the answer: the caller reads them in this gateway's form."""
    for key in keys:
        response.pop(key, None)
    for choice in _choices(response):
        for key in keys:
            choice.pop(key, None)
        if not logprobs_asked:
            choice["logprobs"] = None


def from_sglang(response: dict[str, Any], *, logprobs_asked: bool) -> CallExtras:
    """SGLang's fields read into extras, and taken out of ``response``."""
    choices = _choices(response)
    prompt = _ints(choices[0].get("prompt_token_ids")) if choices else None
    ids: list[list[int]] = []
    sampled: list[list[float]] = []
    for choice in choices:
        entries = (choice.get("meta_info") or {}).get("output_token_logprobs") \
            if isinstance(choice.get("meta_info"), dict) else None
        pairs = [e for e in entries if isinstance(e, list | tuple) and len(e) >= 2] if isinstance(entries, list) \
            else []
        ids.append(_ints(choice.get("token_ids")) or _ints([e[1] for e in pairs]) or [])
        sampled.append(_content_logprobs(choice) or _floats([e[0] for e in pairs]) or [])
    _strip(response, ("prompt_token_ids", "token_ids", "meta_info"), logprobs_asked=logprobs_asked)
    return _extras(prompt, ids, sampled=sampled)


def from_vllm(response: dict[str, Any], *, logprobs_asked: bool) -> CallExtras:
    """vLLM's fields read into extras, and taken out of ``response``."""
    choices = _choices(response)
    prompt = _ints(response.get("prompt_token_ids"))
    ids = [_ints(c.get("token_ids")) or [] for c in choices]
    own = [_content_logprobs(c) or [] for c in choices]
    _strip(response, ("prompt_token_ids", "token_ids"), logprobs_asked=logprobs_asked)
    return _extras(prompt, ids, own=own)


def _extras(prompt: list[int] | None, ids: list[list[int]], *, own: list[list[float]] | None = None,
            sampled: list[list[float]] | None = None) -> CallExtras:
    """Log-probabilities kept only where one was given for every token, so a list never misaligns with its ids."""
    if not any(ids):
        return CallExtras(prompt_token_ids=prompt)

    def aligned(values: list[list[float]] | None) -> list[list[float]] | None:
        if values is None or any(len(v) != len(i) for v, i in zip(values, ids, strict=True)):
            return None
        return values

    return CallExtras(prompt_token_ids=prompt, completion_token_ids=ids, completion_logprobs=aligned(own),
                      completion_sampled_logprobs=aligned(sampled))


def attach(response: dict[str, Any], extras: CallExtras) -> None:
    """Put a call's token ids and log-probabilities into this gateway's answer (its own form, above)."""
    response["prompt_token_ids"] = extras.prompt_token_ids
    for index, choice in enumerate(_choices(response)):
        for key, values in (("token_ids", extras.completion_token_ids), ("token_logprobs", extras.completion_logprobs),
                            ("sampled_logprobs", extras.completion_sampled_logprobs)):
            choice[key] = values[index] if values is not None and index < len(values) else None


def read(response: dict[str, Any]) -> CallExtras:
    """What ``attach`` put into an answer, taken back out of it: the client's side."""
    choices = _choices(response)
    columns = {key: [choice.pop(key, None) for choice in choices]
               for key in ("token_ids", "token_logprobs", "sampled_logprobs")}
    prompt = _ints(response.pop("prompt_token_ids", None))
    ids = [_ints(v) or [] for v in columns["token_ids"]]
    own = [_floats(v) for v in columns["token_logprobs"]]
    sampled = [_floats(v) for v in columns["sampled_logprobs"]]
    return _extras(prompt, ids, own=None if None in own else own,  # type: ignore[arg-type]
                   sampled=None if None in sampled else sampled)  # type: ignore[arg-type]
