"""Copies planned byte runs between two caches' memory: the engine of the `shm` backend and of local copies.

Memory that a model server owns can shrink under a copy (it may truncate a segment it registered), and a plain
memmove that touches a vanished page dies of SIGBUS, taking the daemon with it. So a run is copied in one of two ways:

- `memmove` between mappings, only when both sides are `stable`: segments that only daemons create and size
  (AllocateCache's, reserved at creation). It is the fastest copy: on the development machine about twice the kernel's
  from tmpfs at 256 KiB runs.
- the kernel (`pread` from the source's segment file into the destination's mapping) when either side is not: a
  source that shrank gives a short read, a destination page that vanished gives EFAULT; both become an LlmError.

Both release the GIL, so two copiers really run in parallel on large plans. Callers keep the memory alive for the
whole copy (pins, held segments); the planner has checked every run against both caches' sizes, and each side
re-checks its segments' sizes (fstat) before the first byte moves.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbrokerd.backends.base import run_parts
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.planner import Plan, Progress, Run, split_runs

# Below this many bytes a second copying thread costs more than it saves.
PARALLEL_MIN_BYTES = 8 << 20
# A copy this small (tens of microseconds) is cheaper on the event loop than a hand-off to a worker thread; the
# run limit keeps a plan of many tiny runs (a Python loop) from stalling the loop.
INLINE_MAX_BYTES = 512 << 10
INLINE_MAX_RUNS = 64
_DEADLINE_CHECK_EVERY = 256

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread64
_pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
_pread.restype = ctypes.c_ssize_t


def small_enough_for_the_loop(plan: Plan) -> bool:
    return plan.total_bytes <= INLINE_MAX_BYTES and plan.num_runs <= INLINE_MAX_RUNS


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One side of a copy: where each tensor's bytes are, in this process and in their segment files."""

    label: str
    """Names the memory in errors ("cache 12", "remote cache 7 of cluster 2")."""
    addresses: list[int]
    """Base address of each tensor's mapping here (needed of a destination, and of a stable source)."""
    fds: list[int]
    """Descriptor of each tensor's segment file."""
    offsets: list[int]
    """Offset of each tensor in its segment file."""
    stable: bool
    """Only daemons can resize this memory: memmove may touch it."""
    check: Callable[[], None]
    """Raises LlmError when a segment is now smaller than the tensors in it need."""
    holds: object = None
    """Whatever keeps the descriptors and mappings above open: held for as long as the endpoint is used."""


def base_address(buffer: mmap.mmap) -> int:
    """Where a mapping starts in this process (read-only mappings too); valid while the mapping stays open."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def copy_plan(src: Endpoint, dst: Endpoint, plan: Plan, progress: Progress, deadline: float,
              executor: concurrent.futures.Executor, threads: int = 2,
              mark: Callable[[int, int], None] | None = None) -> int:
    """Copies every run of `plan`; `mark(run, bytes)` (default `progress.mark`) records each run that landed."""
    src.check()
    dst.check()
    runs = plan.runs()
    record = progress.mark if mark is None else mark
    move = _memmove if src.stable and dst.stable else _kernel_copy

    def copy(chunk: list[Run]) -> None:
        for i, (idx, st, so, dt, do, n) in enumerate(chunk):
            if i % _DEADLINE_CHECK_EVERY == 0:
                if time.monotonic() > deadline:
                    fail(LlmStatus.LLM_TIMEOUT, "deadline passed during the memory copy")
                if progress.cancelled:
                    fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
            move(src, st, so, dst, dt, do, n)
            record(idx, n)

    if threads < 2 or plan.total_bytes < PARALLEL_MIN_BYTES or len(runs) < 2:
        copy(runs)
        return plan.total_bytes
    run_parts(executor, copy, split_runs(runs, threads))
    return plan.total_bytes


def _memmove(src: Endpoint, st: int, so: int, dst: Endpoint, dt: int, do: int, n: int) -> None:
    ctypes.memmove(dst.addresses[dt] + do, src.addresses[st] + so, n)


def _kernel_copy(src: Endpoint, st: int, so: int, dst: Endpoint, dt: int, do: int, n: int) -> None:
    fd, offset, address = src.fds[st], src.offsets[st] + so, dst.addresses[dt] + do
    while n > 0:
        got = _pread(fd, address, n, offset)
        if got > 0:
            offset, address, n = offset + got, address + got, n - got
            continue
        if got == 0:
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{src.label}: its memory shrank during the copy (the model "
                 "server that owns it truncated its segment)")
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err == errno.EFAULT:
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{dst.label}: its memory vanished during the copy (its segment "
                 "was truncated, or its filesystem is full)")
        fail(LlmStatus.LLM_FAILED, f"reading {src.label}: {os.strerror(err)}")
