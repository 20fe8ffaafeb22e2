"""``replay export --format hf``: the rows as a ``datasets`` dataset, built as they stream, saved with ``save_to_disk``.

``datasets`` comes with the ``[train]`` extra; ``replay/export.py`` checks for it before anything is read.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from replay.export import ExportError, ExportResult, Row
from replay.records import new_id


def hf_features() -> Any:
    from datasets import Features, Sequence, Value

    text, number = Value("string"), Value("int64")
    return Features({
        "messages": text, "tools": text, "metadata": text,
        "prompt_token_ids": Sequence(Value("int32")), "completion_token_ids": Sequence(Value("int32")),
        "trajectory_id": text, "source": text, "tenant": text, "model": text, "base_model": text, "adapter": text,
        "adapter_version": text, "task_id": text, "group_id": text, "parent_id": text, "status": text,
        "termination_reason": text, "final_reward": Value("float64"), "call_id": text, "seq": number,
        "first_seq": number, "call_status": text, "finish_reason": text, "purpose": text, "error": text,
        "redacted": Value("bool"),
    })


def hf_row(row: Row) -> dict[str, Any]:
    return {
        "messages": row.messages.decode(), "tools": row.tools.decode() if row.tools else None,
        "metadata": row.metadata.decode() if row.metadata else None,
        "prompt_token_ids": orjson.loads(row.prompt_token_ids) if row.prompt_token_ids else None,
        "completion_token_ids": orjson.loads(row.completion_token_ids) if row.completion_token_ids else None,
        **row.trajectory, **row.call,
    }


def _hf_generator(rows: Any) -> Iterator[dict[str, Any]]:
    # ``rows`` is a _Source: datasets fingerprints gen_kwargs, and a plain generator object would not pickle.
    for row in rows():
        yield hf_row(row)


class _Source:
    """Rows of an export as a callable, so datasets can consume them from ``from_generator``."""

    def __init__(self, make: Callable[[], Iterator[Row]], result: ExportResult) -> None:
        self.make = make
        self.result = result

    def __call__(self) -> Iterator[Row]:
        for row in self.make():
            self.result.rows += 1
            self.result.redacted_rows += row.call["redacted"]
            yield row

    def __reduce__(self) -> Any:  # never actually pickled (one process); a stable stand-in for hashing
        return (str, ("replay-export-source",))


def write_hf(rows: Callable[[], Iterator[Row]], output: Path, result: ExportResult) -> None:
    """A ``datasets`` dataset built from the rows as they stream, saved with ``save_to_disk``."""
    import datasets

    cache = Path(tempfile.mkdtemp(prefix=".export-cache-", dir=output.parent))
    try:
        # A fresh cache dir and a fresh fingerprint each time: never a stale dataset from an earlier run.
        with _quiet_datasets():
            try:
                ds = datasets.Dataset.from_generator(_hf_generator, features=hf_features(), cache_dir=str(cache),
                                                     gen_kwargs={"rows": _Source(rows, result)},
                                                     fingerprint=new_id())
            except Exception as exc:
                # datasets wraps what the generator raised; a person should see the original reason.
                inner = _original(exc)
                if inner is not exc:
                    raise inner from None
                if result.rows == 0:
                    raise ExportError("no model call in the selection had a reply to export; nothing written") from None
                raise
            ds.save_to_disk(str(output))
        del ds
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _original(exc: BaseException) -> BaseException:
    seen = exc
    while seen is not None:
        if isinstance(seen, (ExportError, sqlite3.Error, OSError)):
            return seen
        seen = seen.__cause__ or seen.__context__  # type: ignore[assignment]
    return exc


class _quiet_datasets:
    """datasets draws its own progress bars; ours already shows the export's progress."""

    def __enter__(self) -> None:
        import datasets

        self.was = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        import datasets

        if self.was:
            datasets.utils.logging.enable_progress_bar()
