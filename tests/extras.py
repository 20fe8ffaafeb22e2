"""Test modules that need an optional extra skip themselves where it is not installed (CI's core-only run).

With ``HARNESS_REQUIRE_EXTRAS=1`` (CI's full run) a missing extra fails instead, so a broken install can
never pass as skipped tests.
"""

from __future__ import annotations

import os

import pytest

from extras import MissingExtra, require_extra


def skip_without(extra: str) -> None:
    """Call at the top of a test module, before importing what ``extra`` brings."""
    try:
        require_extra(extra, "these tests")
    except MissingExtra as exc:
        if os.environ.get("HARNESS_REQUIRE_EXTRAS") == "1":
            raise
        pytest.skip(str(exc), allow_module_level=True)
