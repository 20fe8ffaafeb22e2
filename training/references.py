"""The gate's reference, evaluated once: its test report cached under a key of everything the report depends on.

Every replay-train run compares its candidate with the reference (the active adapter, else the base) on the gate's
tasks (``[training.gate]``: drawn with a fixed seed from the test templates). The reference rarely changes
between runs, so its report is kept in ``<output_dir>/references/<key>.json``
and read back while the key is the same. The key hashes

- the weights: the base model's fingerprint (``local.loading.model_fingerprint``: names, sizes and head hashes, as
  the model cache checks them) and, for an adapter, every file of its folder (weights, config, the rendering it
  is served in);
- the suite: its name and ``version`` (bumped when its tools or verifier change), and the task set (each task's
  id, prompt, tools, expected value and fault);
- the decoding: the episode limits, ``eval_max_tokens``, the samples per task and their temperature (one sample:
  greedy);
- the general check: the general data it reads, its seed and ``max_seq_len``.

Anything else that changes an evaluation must be added to the key, or a stale report is served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import orjson
import structlog

from gateway.backends.local.loading import model_fingerprint
from training.episodes import EPISODE_LIMITS
from training.evaluate import Evaluator, Report
from training.general_data import GENERAL_PROMPTS
from training.metrics import Episode, Loss
from training.settings import TrainingSettings
from training.tasks import Suite, Task

log = structlog.get_logger()

KEY_FORMAT = 2  # bump when the key's parts or the report's fields change


def _hash_files(digest: hashlib._Hash, path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0".encode())
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)


async def reference_report(evaluator: Evaluator, cache: ReferenceCache, suite: Suite, tasks: list[Task],
                           adapter: Path | None, settings: TrainingSettings, *, label: str, split: str = "gate",
                           general: Callable[[str | Path | None], list[Loss]] | None = None) -> tuple[Report, bool]:
    """``adapter``'s (None: the base's) report on ``tasks`` (``[training.gate] samples`` each), from the cache when
    its key is there (and whether it was), else evaluated and cached."""
    gate = settings.gate
    key = await asyncio.to_thread(reference_key, suite, tasks, adapter, settings)
    cached = await asyncio.to_thread(cache.get, key)
    if cached is not None:
        return dataclasses.replace(cached, model=label), True
    report = await evaluator.evaluate_tasks(suite, tasks, adapter, split=split, samples=gate.samples,
                                            temperature=gate.temperature, general=general, label=label)
    await asyncio.to_thread(cache.put, key, report)
    return report, False


def reference_key(suite: Suite, tasks: list[Task], adapter: Path | None, settings: TrainingSettings) -> str:
    """The cache key of ``adapter``'s (None: the base's) report on ``tasks`` of ``suite`` (see the module doc)."""
    digest = hashlib.sha256(f"format {KEY_FORMAT}\n".encode())
    # The base is large and read at every run: its fingerprint; an adapter is small: every byte.
    digest.update(orjson.dumps(model_fingerprint(settings.model_path), option=orjson.OPT_SORT_KEYS))
    digest.update(b"\0adapter\0")
    if adapter is not None:
        _hash_files(digest, Path(adapter))
    samples = settings.gate.samples
    digest.update(orjson.dumps({"suite": suite.name, "version": suite.version,
                                "tasks": [dataclasses.asdict(t) for t in tasks],
                                "system_prompt": suite.system_prompt, "limits": dataclasses.asdict(EPISODE_LIMITS),
                                "max_tokens": settings.eval_max_tokens, "samples": samples,
                                "constrain_tool_calls": settings.constrain_tool_calls,
                                "temperature": settings.gate.temperature if samples > 1 else 0.0,
                                "general_seed": settings.seed, "max_seq_len": settings.max_seq_len},
                               option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS))
    _hash_files(digest, Path(settings.general_data) if settings.general_data else GENERAL_PROMPTS)
    return digest.hexdigest()[:32]


class ReferenceCache:
    """Reports by key, as JSON files in one folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def get(self, key: str) -> Report | None:
        path = self.folder / f"{key}.json"
        if not path.is_file():
            return None
        data = orjson.loads(path.read_bytes())
        data["episodes"] = [Episode(**e) for e in data["episodes"]]
        data["general_losses"] = [tuple(loss) for loss in data["general_losses"]]
        return Report(**data)

    def put(self, key: str, report: Report) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{key}.json"
        partial = path.with_suffix(".tmp")
        partial.write_bytes(report.to_json())
        partial.replace(path)  # whole or not at all: a run killed mid-write leaves no half report
        log.info("reference.cached", key=key, model=report.model, path=str(path))
        return path
