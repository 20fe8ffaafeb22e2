"""Sampling for the embedded model: the request's parameters, checked, and the choice of each next token."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch

from gateway.backends.base import BackendError

DEFAULT_MAX_TOKENS = 256
MAX_N = 128
_GREEDY_BELOW = 1e-5  # temperatures this small sample the argmax anyway


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> BackendError:
    """A 400 naming the request field at fault, as OpenAI words it."""
    return BackendError(message, status_code=400, error_type="invalid_request_error", param=param, code=code)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SamplingParams:
        """Read and check the sampling fields of an OpenAI chat body (400 on bad values)."""

        def number(name: str, default: float, low: float, high: float) -> float:
            value = body.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise invalid_request(f"{name} must be a number between {low} and {high}", name)
            return float(value)

        def integer(name: str, default: int | None, low: int, high: int) -> int | None:
            value = body.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise invalid_request(f"{name} must be an integer between {low} and {high}", name)
            return value

        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise invalid_request("stop must be a string or a list of strings", "stop")
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        top_p = number("top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise invalid_request("top_p must be greater than 0", "top_p")
        return cls(
            max_tokens=integer(limit_name, DEFAULT_MAX_TOKENS, 1, 1 << 30),  # type: ignore[arg-type]
            temperature=number("temperature", 1.0, 0.0, 2.0),
            top_p=top_p,
            n=integer("n", 1, 1, MAX_N),  # type: ignore[arg-type]
            seed=integer("seed", None, -(1 << 63), (1 << 63) - 1),
            stop=tuple(s for s in stop or () if s),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )


def choose(logits: torch.Tensor, rows: list[tuple[SamplingParams, torch.Generator]]) -> tuple[list[int], list[float]]:
    """The next token of each row (``rows`` gives each row's parameters and generator) and its log-probability
    under the model (temperature 1, no top-p), the quantity a policy-gradient trainer compares against."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logits.argmax(dim=-1)
    for i, (params, generator) in enumerate(rows):
        if params.temperature < _GREEDY_BELOW:
            continue
        probs = torch.softmax(logits[i] / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keeps at least the top token
            probs = probs.scatter(0, order[outside], 0.0)
        chosen[i] = torch.multinomial(probs, 1, generator=generator)[0]
    tokens = chosen.tolist()
    return tokens, logprobs.gather(1, chosen[:, None])[:, 0].tolist()


def generators(params: SamplingParams) -> list[torch.Generator]:
    """One generator per sequence; with a seed the whole request is reproducible, whatever it is batched with."""
    base = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    seeds = torch.randint(0, 1 << 62, (params.n,), generator=base).tolist()
    return [torch.Generator().manual_seed(s) for s in seeds]
