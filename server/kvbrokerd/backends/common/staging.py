"""Many small runs over a socket: gathered into (or scattered from) a staging buffer in one native call per chunk.

A scatter/gather list of a few dozen bytes per run costs a Python memoryview, an iovec and a completion callback per
run on each side (about 3 us a run, 7 us a block of a two-tensor pull). Runs that are all small travel instead
through a per-thread staging buffer: `memcopy.copy_runs` moves a whole chunk of them between the buffer and the
cache (fault-safe, the GIL released once), and the socket sees one buffer per chunk. The wire format is the same
either way: the runs' bytes in order, so the two sides choose independently.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from kvbrokerd.backends.common import memcopy

STAGE_MAX_RUN = 64 << 10
"""Runs up to this size are staged (larger ones gain nothing: the per-run cost is small beside their bytes)."""
STAGE_MIN_RUNS = 16
STAGE_BYTES = 1 << 20
"""A chunk: consecutive runs of at most this many bytes (or one run), one socket call and one copy call."""

_buffers = threading.local()


def worth_it(lengths: np.ndarray) -> bool:
    return (memcopy.copy_runs_available() and len(lengths) >= STAGE_MIN_RUNS
            and int(lengths.max()) <= STAGE_MAX_RUN)


def chunks(lengths: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
    """(first run, end run, each run's offset in the staging buffer) of consecutive runs of <= STAGE_BYTES."""
    ends = np.cumsum(lengths, dtype=np.uint64)
    first, total = 0, len(lengths)
    while first < total:
        base = int(ends[first - 1]) if first else 0
        # A uint64 needle: a Python int would make numpy convert all of `ends` on every call.
        last = max(int(np.searchsorted(ends, np.uint64(base + STAGE_BYTES), side="right")), first + 1)
        yield first, last, (ends[first:last] - lengths[first:last]) - np.uint64(base)
        first = last


def buffer() -> np.ndarray:
    """This thread's staging buffer (made on first use, kept for the thread's life)."""
    buf: np.ndarray | None = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = np.empty(STAGE_BYTES + STAGE_MAX_RUN, dtype=np.uint8)
    return buf


def address(buf: np.ndarray) -> np.uint64:
    return np.uint64(buf.ctypes.data)
