"""What the engine is handed and hands back: jobs (a prompt and how to sample from it), operations on the model,
and the events a job receives, one list per job and decoding step, on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.backends.base import BackendError
from gateway.backends.local.adapters import Adapter
from gateway.backends.local.sampling import SamplingParams


@dataclass(eq=False)
class Op:
    """A change to the model that the engine thread runs between two steps."""

    run: Callable[[], Any]
    settle: Callable[[Any, BaseException | None], None]  # (result, error), called on the engine thread


# Events from the engine thread to a job, delivered as one list per job and step.
@dataclass(frozen=True)
class Token:
    index: int
    token_id: int
    logprob: float  # under the model (temperature 1, nothing masked)
    sampled_logprob: float  # under the distribution it was drawn from (see ``sampling.Choice``)
    text: str  # newly releasable text; "" while a character or possible stop string is incomplete
    top: tuple[tuple[int, float], ...] = ()  # the model's likeliest tokens here, when asked for


@dataclass(frozen=True)
class Finish:
    index: int
    reason: str  # stop | length | error (the grammar failed: ``grammar.ERROR_FINISH``)


@dataclass(frozen=True)
class Failure:
    error: BackendError


JobEvent = Token | Finish | Failure  # what the engine delivers to a job, step by step


@dataclass(eq=False)
class Job:
    """One request as the engine sees it: a prompt and ``params.n`` sequences to generate from it.

    A cancelled job gets no further events: its owner, who cancelled it, already knows.
    """

    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[list[JobEvent]], None]  # called on the engine thread
    adapter: Adapter | None = None  # None: the base model
    tenant: str | None = None  # whose prompts its cached keys and values may be shared with
    cancelled: bool = False  # set from any thread; the engine drops the job at its next step
