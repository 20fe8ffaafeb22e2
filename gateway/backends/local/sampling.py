"""Sampling for the embedded model: the request's parameters, checked, and the choice of each next token."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gateway.backends.base import BackendError

if TYPE_CHECKING:
    from gateway.backends.local.grammar import Grammar

DEFAULT_MAX_TOKENS = 256
MAX_N = 128
GREEDY_BELOW = 1e-5  # temperatures this small sample the argmax anyway


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> BackendError:
    """A 400 naming the request field at fault, as OpenAI words it."""
    return BackendError(message, status_code=400, error_type="invalid_request_error", param=param, code=code)


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    logprobs: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None  # what the output must match, built (``grammar.py``); None: anything
    tool_stop: str | None = None  # "first" | "last": end after the first, or the last, ``</tool_call>``

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, biases); the grammar mask aside."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

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
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise invalid_request("logprobs must be a boolean", "logprobs")
        top_logprobs = integer("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise invalid_request("top_logprobs needs logprobs set to true", "top_logprobs")
        return cls(
            max_tokens=integer(limit_name, DEFAULT_MAX_TOKENS, 1, 1 << 30),  # type: ignore[arg-type]
            temperature=number("temperature", 1.0, 0.0, 2.0),
            top_p=top_p,
            n=integer("n", 1, 1, MAX_N),  # type: ignore[arg-type]
            seed=integer("seed", None, -(1 << 63), (1 << 63) - 1),
            stop=tuple(s for s in stop or () if s),
            ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=bool(logprobs),
            top_logprobs=top_logprobs or 0,
            frequency_penalty=number("frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=number("presence_penalty", 0.0, -2.0, 2.0),
            logit_bias=_logit_bias(body.get("logit_bias")),
        )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid_request("logit_bias must map token ids to numbers between -100 and 100", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()) or isinstance(bias, bool) or \
                not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid_request("logit_bias must map token ids to numbers between -100 and 100", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Choice:
    """A sampled token and its log-probabilities: ``logprob`` under the model itself (temperature 1, nothing
    masked or biased: what KL and perplexity compare), ``sampled_logprob`` under the distribution it was
    drawn from (after penalties, biases, the grammar mask, temperature and top-p: what an importance ratio
    compares; 0 for a greedy choice), and the model's most likely alternatives when asked for."""

    token: int
    logprob: float
    sampled_logprob: float
    top: tuple[tuple[int, float], ...] = ()


def shape_logits(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """One row's logits after OpenAI's frequency and presence penalties and ``logit_bias`` (a new tensor)."""
    out = logits.clone()
    if generated and (params.frequency_penalty or params.presence_penalty):
        ids, counts = torch.tensor(generated).unique(return_counts=True)
        out[ids] -= params.frequency_penalty * counts.to(out.dtype) + params.presence_penalty
    for token, bias in params.logit_bias:
        if token < out.shape[0]:
            out[token] += bias
    return out


def choose(raw: torch.Tensor, shaped: torch.Tensor,
           rows: list[tuple[SamplingParams, torch.Generator]]) -> list[Choice]:
    """The next token of each row, drawn from ``shaped`` (the logits after penalties, biases and any grammar
    mask; ``rows`` gives each row's parameters and generator), with its log-probabilities (see ``Choice``)."""
    model = torch.log_softmax(raw, dim=-1)
    chosen = shaped.argmax(dim=-1)
    sampled = [0.0] * len(rows)
    for i, (params, generator) in enumerate(rows):
        if params.temperature < GREEDY_BELOW:
            continue
        probs = torch.softmax(shaped[i] / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keeps at least the top token
            probs = probs.scatter(0, order[outside], 0.0)
            probs = probs / probs.sum()
        token = torch.multinomial(probs, 1, generator=generator)[0]
        chosen[i] = token
        sampled[i] = float(torch.log(probs[token]))
    tokens = chosen.tolist()
    logprobs = model.gather(1, chosen[:, None])[:, 0].tolist()
    wanted = max((params.top_logprobs for params, _ in rows), default=0)
    top_values, top_ids = model.topk(wanted, dim=-1) if wanted else (None, None)
    out = []
    for i, (params, _) in enumerate(rows):
        top: tuple[tuple[int, float], ...] = ()
        if params.top_logprobs and top_ids is not None and top_values is not None:
            top = tuple(zip(top_ids[i, :params.top_logprobs].tolist(), top_values[i, :params.top_logprobs].tolist(),
                            strict=True))
        out.append(Choice(tokens[i], logprobs[i], sampled[i], top))
    return out


def generators(params: SamplingParams) -> list[torch.Generator]:
    """One generator per sequence; with a seed the whole request is reproducible, whatever it is batched with."""
    base = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    seeds = torch.randint(0, 1 << 62, (params.n,), generator=base).tolist()
    return [torch.Generator().manual_seed(s) for s in seeds]
