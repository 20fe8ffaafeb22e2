"""The local engine driven directly on its own thread, with no event loop: events come back through each job's
``deliver`` callback."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from tests.extras import skip_without

skip_without("local")

import torch

from gateway.backends.local import engine as engine_module
from gateway.backends.local.engine import Engine
from gateway.backends.local.jobs import Failure, Finish, Job, JobEvent, Token
from gateway.backends.local.kv import position_bytes
from gateway.backends.local.loading import LoadedModel, load_model
from gateway.backends.local.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)  # ignore_eos: the random model must not end a sequence early


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


class _Inbox:
    """One job's delivered events; called on the engine thread and read after it has been joined."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.events: list[JobEvent] = []
        self.job: Job | None = None
        self._cancel_after = cancel_after

    def __call__(self, events: list[JobEvent]) -> None:
        self.events.extend(events)
        if self._cancel_after is not None and len(self.tokens) >= self._cancel_after:
            assert self.job is not None
            self.job.cancelled = True  # as the facade does from its loop; the engine drops the job at its next step

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, Token)]

    @property
    def finishes(self) -> list[Finish]:
        return [e for e in self.events if isinstance(e, Finish)]


def _job(loaded: LoadedModel, text: str, inbox: _Inbox, **params: object) -> Job:
    job = Job(loaded.tokenizer.encode(text), SamplingParams(**params), inbox)  # type: ignore[arg-type]
    inbox.job = job
    return job


def _run(engine: Engine, *jobs: Job) -> None:
    for job in jobs:
        engine.submit(job)
    thread = threading.Thread(target=engine.run, name="engine")
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()


def _two_jobs(loaded: LoadedModel) -> tuple[Engine, _Inbox, _Inbox]:
    engine = Engine(loaded, max_batch_size=8)
    short, long = _Inbox(), _Inbox()
    # Different prompt lengths, so one row is left-padded, and different limits, so one row leaves early.
    _run(engine, _job(loaded, "a short prompt", short, max_tokens=5, **GREEDY),
         _job(loaded, "a somewhat longer prompt than the other one", long, max_tokens=9, **GREEDY))
    return engine, short, long


def test_two_jobs_share_the_batch_and_greedy_output_repeats(loaded: LoadedModel) -> None:
    engine, short, long = _two_jobs(loaded)
    for inbox, length in ((short, 5), (long, 9)):
        assert len(inbox.tokens) == length
        assert inbox.finishes == [Finish(0, "length")] and inbox.events[-1] == Finish(0, "length")
        assert not any(isinstance(e, Failure) for e in inbox.events)
        text = "".join(e.text for e in inbox.events if isinstance(e, Token))
        assert text == loaded.tokenizer.decode(inbox.tokens, skip_special_tokens=True)
    # One prefill for both, then a decoding step for each token but the last.
    assert engine.forward_passes == 1 + 8
    assert not engine._rows

    _, short_again, long_again = _two_jobs(loaded)
    assert (short_again.tokens, long_again.tokens) == (short.tokens, long.tokens)


def test_a_job_cancelled_mid_generation_is_dropped_and_the_other_goes_on(loaded: LoadedModel) -> None:
    solo = _Inbox()
    _run(Engine(loaded, max_batch_size=8), _job(loaded, "the one that stays", solo, max_tokens=12, **GREEDY))

    engine = Engine(loaded, max_batch_size=8)
    cancelled, kept = _Inbox(cancel_after=3), _Inbox()
    _run(engine, _job(loaded, "cancel me after three tokens, please", cancelled, max_tokens=50, **GREEDY),
         _job(loaded, "the one that stays", kept, max_tokens=12, **GREEDY))
    # Cancelled by its owner, the job hears nothing more: no further token, no finish, no failure.
    assert len(cancelled.tokens) == 3 and all(isinstance(e, Token) for e in cancelled.events)
    # Dropping the row (and the padding only it needed) leaves the other's computation as it was alone.
    assert kept.tokens == solo.tokens and kept.finishes == [Finish(0, "length")]
    assert not engine._rows and not engine.inbox


def test_a_failing_step_fails_every_job_of_the_batch_and_the_engine_serves_on(loaded: LoadedModel) -> None:
    engine = Engine(loaded, max_batch_size=8)
    choose, steps = engine._choose, 0

    def failing(logits: torch.Tensor) -> tuple[list[int], list[float]]:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("boom")
        return choose(logits)

    engine._choose = failing  # type: ignore[method-assign]
    first, second = _Inbox(), _Inbox()
    _run(engine, _job(loaded, "one", first, max_tokens=10, **GREEDY),
         _job(loaded, "two", second, max_tokens=10, **GREEDY))
    for inbox in (first, second):
        assert len(inbox.tokens) == 2 and not inbox.finishes
        [failure] = [e for e in inbox.events if isinstance(e, Failure)]
        assert failure.error.status_code == 500 and "boom" in str(failure.error)
    assert not engine._rows

    again = _Inbox()
    _run(engine, _job(loaded, "one", again, max_tokens=4, **GREEDY))
    assert again.tokens[:2] == first.tokens and len(again.tokens) == 4 and again.finishes == [Finish(0, "length")]


def test_a_failing_prefill_fails_the_jobs_being_admitted_too(loaded: LoadedModel) -> None:
    engine = Engine(loaded, max_batch_size=8)
    running = _Inbox()
    engine.submit(_job(loaded, "one", running, max_tokens=10, **GREEDY))
    engine._admit()  # running, one token chosen per step from here
    prefill = engine._prefill

    def failing(jobs: list[Job]) -> None:
        raise RuntimeError("boom in prefill")

    engine._prefill = failing  # type: ignore[method-assign]
    admitting = _Inbox()
    _run(engine, _job(loaded, "two", admitting, max_tokens=10, **GREEDY))
    for inbox in (running, admitting):  # out of the inbox, not yet a row: it hears of the failure all the same
        [failure] = [e for e in inbox.events if isinstance(e, Failure)]
        assert failure.error.status_code == 500 and "boom in prefill" in str(failure.error)
    assert not engine._rows and not engine._admitting and not engine.inbox
    engine._prefill = prefill  # type: ignore[method-assign]


def test_the_engine_imports_no_asyncio() -> None:
    tree = ast.parse(Path(engine_module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.split(".")[0] == "asyncio"}


def test_a_batch_cache_budget_holds_back_rows_that_would_be_padded_past_it(loaded: LoadedModel) -> None:
    long_text, short_text = "a prompt a good deal longer than the others, " * 4, "short"
    width = len(loaded.tokenizer.encode(long_text))
    per_position = position_bytes(loaded.model.config, loaded.model.dtype)
    alone = {}
    for text in (long_text, short_text):
        alone[text] = _Inbox()
        _run(Engine(loaded, max_batch_size=8), _job(loaded, text, alone[text], max_tokens=6, **GREEDY))

    # Room for two rows as wide as the long prompt, not three: the second short prompt, padded to the long one's
    # width, would pass it, so it waits for a row to finish.
    engine = Engine(loaded, max_batch_size=8, batch_cache_bytes=(3 * width - 1) * per_position)
    inboxes = [_Inbox(), _Inbox(), _Inbox()]
    for text, inbox in zip((long_text, short_text, short_text), inboxes, strict=True):
        engine.submit(_job(loaded, text, inbox, max_tokens=6, **GREEDY))
    engine._admit()
    assert len(engine._rows) == 2 and len(engine.inbox) == 1
    _run(engine)
    assert [inbox.tokens for inbox in inboxes] == [alone[long_text].tokens] + [alone[short_text].tokens] * 2
    assert all(inbox.finishes == [Finish(0, "length")] for inbox in inboxes)

    # Without the budget all three join at once; and a job past the budget on its own still runs, alone.
    unlimited = Engine(loaded, max_batch_size=8)
    for text in (long_text, short_text, short_text):
        unlimited.submit(_job(loaded, text, _Inbox(), max_tokens=6, **GREEDY))
    unlimited._admit()
    assert len(unlimited._rows) == 3
    tight, lone = Engine(loaded, max_batch_size=8, batch_cache_bytes=per_position), _Inbox()
    _run(tight, _job(loaded, long_text, lone, max_tokens=6, **GREEDY))
    assert lone.tokens == alone[long_text].tokens
