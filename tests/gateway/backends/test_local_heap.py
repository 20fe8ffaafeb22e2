"""The heap's two modes (``heap.py``), as glibc reports them: a block of a few MiB is mapped after
``map_large_allocations`` and comes from the heap after ``keep_allocations_in_heap``, and either call undoes the other
(the evaluator and training set them in turn in one process)."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extras import skip_without

skip_without("local")  # the package's __init__ loads the engine

from gateway.backends.local.heap import keep_allocations_in_heap, map_large_allocations

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's")

ROOT = Path(__file__).resolve().parents[3]
# A prefill's activation is a few MiB; each check asks for more than the one before, so no block freed earlier fits it.
SIZES = itertools.count(4 << 20, 1 << 20)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mapped_when_allocated() -> bool:
    """Whether a block the heap cannot serve from what it holds becomes a mapping of its own (glibc counts those in
    ``hblkhd``) rather than more heap: the heap's free top is given back first, so it is one or the other."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim(0)
    size = next(SIZES)
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    assert block
    try:
        return libc.mallinfo2().hblkhd - before >= size
    finally:
        libc.free(block)


def modes_in_turn() -> list[bool]:
    """Each call's result, then whether a block was mapped after it: map, heap, map again."""
    seen = []
    for mode in (map_large_allocations, keep_allocations_in_heap, map_large_allocations):
        seen += [mode(), _mapped_when_allocated()]
    return seen


def test_each_mode_undoes_the_other() -> None:
    # In a fresh process: this one's heap, after other tests, may hold free blocks large enough to serve the check.
    out = subprocess.run([sys.executable, "-c", "from tests.gateway.backends.test_local_heap import modes_in_turn; "
                          "print(modes_in_turn())"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == str([True, True, True, False, True, True])
