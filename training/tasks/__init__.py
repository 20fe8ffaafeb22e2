"""Task suites: tasks in fixed train/validation/test splits, their tools, a verifier and a solver.

Used to evaluate a model through the real agent loop, to generate demonstrations for fine-tuning and
to gate a trained adapter. ``get_suite("tools")`` is the tool-use suite (``tools_suite.py``);
``test_only_markers(suite)`` names what only its test split contains, and ``leak_filter(suite)`` flags training
text that holds held-out material. See README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from training.tasks.base import (
    SPLITS,
    Demonstration,
    Fault,
    Suite,
    Task,
    TaskToolbox,
    check_final,
    fault_outcome,
    format_number,
    is_refusal,
    numbers_in,
)
from training.tasks.tools_suite import ToolsSuite

SUITES: dict[str, Callable[[], Suite]] = {"tools": ToolsSuite}


def get_suite(name: str, **options: Any) -> Suite:
    """The suite called ``name`` (``options`` go to its constructor, e.g. ``data_dir`` for "tools")."""
    try:
        factory = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown task suite {name!r} (known: {', '.join(sorted(SUITES))})") from None
    return factory(**options)


def test_only_markers(suite: Suite) -> dict[str, list[str]]:
    """What only the test split holds, for leak checks on anything a training run consumes.

    - ``prompts``: every test prompt (none occurs in train or validation);
    - ``tools``: tool names offered in test tasks and in no train or validation task;
    - ``families``: task family names only test tasks have (compare with a task's ``family``, not free text);
    - ``phrasings``: one distinctive text fragment per test-only phrasing template.
    """
    test = suite.tasks("test")
    seen = [t for split in SPLITS if split != "test" for t in suite.tasks(split)]
    seen_tools = {name for t in seen for name in t.tools}
    seen_families = {t.family for t in seen}
    return {
        "prompts": [t.prompt for t in test],
        "tools": sorted({name for t in test for name in t.tools} - seen_tools),
        "families": sorted({t.family for t in test} - seen_families),
        "phrasings": list(suite.test_only_phrasings()),
    }


test_only_markers.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test


def leak_filter(suite: Suite, held_out: Iterable[Task] = ()) -> Callable[[str], bool]:
    """Whether a training row's text holds held-out material: a test or validation prompt, a test-only tool or a
    test-only phrasing (validation chooses checkpoints and rolls back: trained on, it would measure recall), or
    the prompt of a task of ``held_out`` (the gate's)."""
    markers = test_only_markers(suite)
    needles = [*markers["prompts"], *(t.prompt for t in suite.tasks("validation")), *markers["tools"],
               *markers["phrasings"], *(t.prompt for t in held_out)]
    return lambda text: any(n in text for n in needles)


__all__ = [
    "SPLITS", "SUITES", "Demonstration", "Fault", "Suite", "Task", "TaskToolbox", "ToolsSuite", "check_final",
    "fault_outcome", "format_number", "get_suite", "is_refusal", "leak_filter", "numbers_in", "test_only_markers",
]
