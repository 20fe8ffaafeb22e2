"""The process's heap, tuned for an engine whose tensors come and go in sizes of a few MiB.

glibc serves an allocation below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each time
a mapped block is freed; so a prefill's activations, each a few MiB, end up in the heap, and the heap, with small
long-lived objects between the freed blocks, cannot shrink: measured, 520 MiB of it lay free at the peak of eight
agent episodes, a quarter of the process. With a fixed threshold of 1 MiB, blocks that large are mapped and go back to
the system when freed; a mapping costs page faults when first written, a few percent of an episode's time.
Training goes the other way (its blocks are larger and come back every step, so the page faults cost it a third of
its speed), and as the setting is the process's, a phase sets the mode it wants when it starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import platform

import structlog

log = structlog.get_logger()

MALLOPT = {"M_TRIM_THRESHOLD": -1, "M_MMAP_THRESHOLD": -3}  # glibc's mallopt parameters (malloc.h)
THRESHOLD = 1 << 20
# glibc's own ceiling for the threshold it raises by itself on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and the trim
# threshold it pairs with it (twice that): where a long-running heap ends up untuned.
HEAP_THRESHOLD = 32 << 20
HEAP_TRIM_THRESHOLD = 2 * HEAP_THRESHOLD


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the tuning calls below are glibc's), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def _mallopt(**values: int) -> bool:
    libc = _glibc()
    if libc is None:
        return False
    done = True
    for parameter, value in values.items():
        if not libc.mallopt(MALLOPT[parameter], value):
            log.warning("local.mallopt_failed", parameter=parameter, value=value)
            done = False
    return done


_mapping = False  # whether map_large_allocations is in force


def map_large_allocations() -> bool:
    """Have glibc map every allocation from ``THRESHOLD`` bytes on; whether it could (not glibc: nothing changes)."""
    global _mapping
    _mapping = _mallopt(M_MMAP_THRESHOLD=THRESHOLD) or _mapping
    return _mapping


def keep_allocations_in_heap() -> bool:
    """Undo ``map_large_allocations``: blocks below ``HEAP_THRESHOLD`` come from the heap again, which is kept
    unless ``HEAP_TRIM_THRESHOLD`` of it lies free at its top (glibc does not go back to raising the threshold by
    itself once it was set, so this sets where that would have led); where nothing had mapped, glibc is left as it
    is. Whether large blocks now come from the heap (not glibc: nothing changes, False)."""
    global _mapping
    if _mapping and _mallopt(M_MMAP_THRESHOLD=HEAP_THRESHOLD, M_TRIM_THRESHOLD=HEAP_TRIM_THRESHOLD):
        _mapping = False
    return _glibc() is not None and not _mapping


def release_free_memory() -> bool:
    """Collect garbage and hand the heap's free pages back to the system (glibc's ``malloc_trim``): after a phase
    whose tensors are gone (training, an evaluation's engine) the heap keeps its high-water mark otherwise, and the
    next phase's peak adds to it. Whether it could (not glibc: only the collection)."""
    gc.collect()
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
