"""Copies planned byte runs between two caches' memory: the engine of the `shm` backend and of local copies.

Memory that a model server owns can shrink under a copy (it may truncate a segment it registered), and a plain
memmove that touches a vanished page dies of SIGBUS, taking the daemon with it. So a run is copied in one of three
ways, the first that applies:

- `kvbrokerd._safecopy` (a small C extension, built when a C compiler is there): memmove at full speed under a
  per-thread fault guard; a page that vanishes under the copy raises FaultError, which becomes an LlmError naming the
  side that lost it. Used for every run, stable or not. `KVBROKER_SAFECOPY=0` in the daemon's environment turns it
  off (the module is then never loaded and installs no signal handler).
- `memmove` between mappings when both sides are `stable`: segments that only daemons create and size
  (AllocateCache's, reserved at creation).
- the kernel (`pread` from the source's segment file into the destination's mapping) otherwise: a source that shrank
  gives a short read, a destination page that vanished gives EFAULT; both become an LlmError. It is the slowest
  (about a third of memmove's speed at 256 KiB-2 MiB runs on the development machine).

All three release the GIL, so two copiers really run in parallel on large plans. Callers keep the memory alive for
the whole copy (pins, held segments); the planner has checked every run against both caches' sizes, and each side
re-checks its segments' sizes (fstat) before the first byte moves.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import mmap
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

import numpy as np

from kvbrokerd.backends.common.parts import run_parts
from kvbrokerd.dataplane.plan import Pieces, Plan, Progress
from kvbrokerd.errors import LlmError, LlmStatus, fail
from kvbrokerd.registry.endpoint import Endpoint

# Below this many bytes a second copying thread costs more than it saves.
PARALLEL_MIN_BYTES = 8 << 20
# A copy this small (tens of microseconds) is cheaper on the event loop than a hand-off to a worker thread; the
# run limit keeps a plan of many tiny runs (a Python loop) from stalling the loop.
INLINE_MAX_BYTES = 512 << 10
INLINE_MAX_RUNS = 1024
# A copy checks its deadline and cancellation between chunks of at most this many bytes or runs (a chunk is one
# call that releases the GIL once; a run larger than a chunk is cut into chunks). A chunk that ends after the
# deadline does not count as landed (the fence): a daemon frozen mid-copy, past its deadline, writes at most the
# chunk it was in when it resumes, never reports it as landed, and writes nothing after it.
CHUNK_BYTES = 16 << 20
CHUNK_RUNS = 4096

SAFECOPY_ENV = "KVBROKER_SAFECOPY"
_SLOW_PATH = "memory copies: memmove between daemon-owned segments, the kernel (pread, about 3x slower) for others"


def _load_safecopy() -> tuple[ModuleType | None, int, str]:
    """The fault-safe copy extension, unless it is turned off (said at INFO) or missing (a WARNING: fixable)."""
    if os.environ.get(SAFECOPY_ENV, "1").strip().lower() in ("0", "no", "false", "off"):
        return None, logging.INFO, (f"{_SLOW_PATH}: the fault-safe copy is turned off "
                                    f"({SAFECOPY_ENV}={os.environ[SAFECOPY_ENV]})")
    try:
        from kvbrokerd import _safecopy
    except ImportError as e:
        return None, logging.WARNING, (f"{_SLOW_PATH}: kvbrokerd._safecopy is not available ({e}); reinstall "
                                       "kvbroker where a C compiler and Python's headers are present")
    return _safecopy, logging.INFO, "memory copies: fault-safe memmove (kvbrokerd._safecopy) for every run"


_safecopy, _COPY_PATH_LEVEL, _COPY_PATH = _load_safecopy()


def copy_path() -> tuple[int, str]:
    """(logging level, line) saying how this process copies memory, for the daemon's log at start."""
    if _safecopy is not None and not _safecopy.handler_in_place():
        return logging.WARNING, (f"{_COPY_PATH}, but another SIGBUS/SIGSEGV handler was installed after its own: a "
                                 "page that vanishes under a copy reaches that one first")
    return _COPY_PATH_LEVEL, _COPY_PATH


_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread64
_pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
_pread.restype = ctypes.c_ssize_t


def maps_to_copy(stable: bool) -> bool:
    """Whether a copy reads this memory through a mapping here (else through its file): memmove needs stable
    memory, the fault-safe copy any memory."""
    return stable or _safecopy is not None


def copy_runs_available() -> bool:
    return _safecopy is not None


def copy_runs(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
    """`_safecopy.copy_runs` between raw addresses (uint64 arrays): raises RunFault(run, side) when a page of
    either side vanished; every run before `run` landed. Only where `copy_runs_available()`."""
    assert _safecopy is not None
    try:
        _safecopy.copy_runs(dst, src, n)
    except _safecopy.FaultError as e:
        raise RunFault(e.run, e.side) from None


def copy_strided(dst: np.ndarray, src: np.ndarray, n: np.ndarray, count: np.ndarray, dst_step: np.ndarray,
                 src_step: np.ndarray) -> None:
    """`_safecopy.copy_strided` (uint64 arrays; a strided plan's entries at raw addresses): raises RunFault(run,
    side, repeat) when a page vanished; every entry before `run`, and its repetitions before `repeat`, landed."""
    assert _safecopy is not None
    try:
        _safecopy.copy_strided(dst, src, n, count, dst_step, src_step)
    except _safecopy.FaultError as e:
        raise RunFault(e.run, e.side, e.repeat) from None


class RunFault(Exception):
    def __init__(self, run: int, side: str, repeat: int = 0) -> None:
        super().__init__(f"the {side}'s memory vanished at run {run}")
        self.run, self.side, self.repeat = run, side, repeat


def small_enough_for_the_loop(plan: Plan) -> bool:
    return plan.total_bytes <= INLINE_MAX_BYTES and plan.num_copies <= INLINE_MAX_RUNS


def base_address(buffer: mmap.mmap) -> int:
    """Where a mapping starts in this process (read-only mappings too); valid while the mapping stays open."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def copy_plan(src: Endpoint, dst: Endpoint, plan: Plan, progress: Progress, deadline: float,
              executor: concurrent.futures.Executor, threads: int = 2, mark: Record | None = None) -> int:
    """Copies every run of `plan`; `mark(runs, nbytes, first_repeat)` (default `progress.mark_runs`) records what
    landed, a chunk of runs (or pieces of runs) at a time (`first_repeat`: None, or for a strided plan the
    repetition each piece starts at)."""
    src.check()
    dst.check()
    record = progress.mark_runs if mark is None else mark
    pieces = Pieces.of(plan)
    if threads < 2 or plan.total_bytes < PARALLEL_MIN_BYTES:
        _copy_pieces(src, dst, pieces, progress, deadline, record)
    else:
        run_parts(executor, lambda part: _copy_pieces(src, dst, part, progress, deadline, record),
                  pieces.split(threads))
    return plan.total_bytes


Record = Callable[[np.ndarray, np.ndarray, "np.ndarray | None"], None]


def _copy_pieces(src: Endpoint, dst: Endpoint, pieces: Pieces, progress: Progress, deadline: float,
                 record: Record) -> None:
    """Copies chunk by chunk (deadline and cancellation are checked between chunks) and records each chunk."""
    if pieces.count is not None and not (_safecopy is not None and src.addresses and dst.addresses):
        pieces = pieces.plain()  # only the fault-safe copy takes strided pieces: the others copy run by run
    pieces = pieces.bounded(CHUNK_BYTES)
    move = _mover(src, dst, pieces)
    nbytes, repeat = pieces.nbytes, pieces.first_repeat
    first, total = 0, len(pieces)
    one_chunk = total <= CHUNK_RUNS and int(nbytes.sum()) <= CHUNK_BYTES
    ends = None if one_chunk else np.cumsum(nbytes, dtype=np.uint64)
    while first < total:
        if time.monotonic() > deadline:
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed during the memory copy")
        if progress.cancelled:
            fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
        if ends is None:
            last = total
        else:
            reach = (int(ends[first - 1]) if first else 0) + CHUNK_BYTES
            last = min(max(int(np.searchsorted(ends, np.uint64(reach), side="right")), first + 1), first + CHUNK_RUNS,
                       total)
        chunk = slice(first, last)
        try:
            move(chunk)
        except _Landed as e:  # a fault: the pieces before it landed (and a strided one's first repetitions), then
            done = slice(first, first + e.pieces)  # the error
            record(pieces.run[done], nbytes[done], None if repeat is None else repeat[done])
            if e.repeats and repeat is not None:
                at = slice(first + e.pieces, first + e.pieces + 1)
                record(pieces.run[at], pieces.length[at] * np.uint64(e.repeats), repeat[at])
            raise e.error from None
        if time.monotonic() > deadline:  # the fence: bytes copied after the deadline never count as landed
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed during the memory copy")
        record(pieces.run[chunk], nbytes[chunk], None if repeat is None else repeat[chunk])
        first = last


def _mover(src: Endpoint, dst: Endpoint, pieces: Pieces) -> Callable[[slice], None]:
    """How a chunk of pieces is copied: the fault-safe copy in one call where it can, else run by run."""
    if _safecopy is not None and src.addresses and dst.addresses:
        src_at = np.asarray(src.addresses, dtype=np.uint64)[pieces.src_tensor] + pieces.src_offset
        dst_at = np.asarray(dst.addresses, dtype=np.uint64)[pieces.dst_tensor] + pieces.dst_offset
        count, src_step, dst_step = pieces.count, pieces.src_stride, pieces.dst_stride
        if count is not None and src_step is not None and dst_step is not None:
            return lambda c: _safe_copy_strided(src, dst, src_at[c], dst_at[c], pieces.length[c], count[c],
                                                src_step[c], dst_step[c])
        return lambda c: _safe_copy_runs(src, dst, src_at[c], dst_at[c], pieces.length[c])
    one = _memmove if src.stable and dst.stable else _kernel_copy
    runs = list(zip(pieces.src_tensor.tolist(), pieces.src_offset.tolist(), pieces.dst_tensor.tolist(),
                    pieces.dst_offset.tolist(), pieces.length.tolist(), strict=True))

    def move(c: slice) -> None:
        for k, (st, so, dt, do, n) in enumerate(runs[c]):
            try:
                one(src, st, so, dst, dt, do, n)
            except LlmError as err:
                raise _Landed(k, err) from None

    return move


class _Landed(Exception):
    """A chunk's copy stopped at a fault after `pieces` of its pieces (and `repeats` repetitions of the next, a
    strided one) had landed."""

    def __init__(self, pieces: int, error: LlmError, repeats: int = 0) -> None:
        self.pieces, self.error, self.repeats = pieces, error, repeats


def _safe_copy_runs(src: Endpoint, dst: Endpoint, src_at: np.ndarray, dst_at: np.ndarray, n: np.ndarray) -> None:
    try:
        copy_runs(dst_at, src_at, n)
        return
    except RunFault as e:
        fault = e
    _fault_error(src, dst, fault)


def _safe_copy_strided(src: Endpoint, dst: Endpoint, src_at: np.ndarray, dst_at: np.ndarray, n: np.ndarray,
                       count: np.ndarray, src_step: np.ndarray, dst_step: np.ndarray) -> None:
    try:
        copy_strided(dst_at, src_at, n, count, dst_step, src_step)
        return
    except RunFault as e:
        fault = e
    _fault_error(src, dst, fault)


def _fault_error(src: Endpoint, dst: Endpoint, fault: RunFault) -> NoReturn:
    try:
        (_source_shrank if fault.side == "source" else _destination_vanished)(src if fault.side == "source" else dst)
    except LlmError as err:
        raise _Landed(fault.run, err, fault.repeat) from None


def _memmove(src: Endpoint, st: int, so: int, dst: Endpoint, dt: int, do: int, n: int) -> None:
    ctypes.memmove(dst.addresses[dt] + do, src.addresses[st] + so, n)


def _source_shrank(src: Endpoint) -> NoReturn:
    fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{src.label}: its memory shrank during the copy (the model server that "
         "owns it truncated its segment)")


def _destination_vanished(dst: Endpoint) -> NoReturn:
    fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{dst.label}: its memory vanished during the copy (its segment was "
         "truncated, or its filesystem is full)")


def _kernel_copy(src: Endpoint, st: int, so: int, dst: Endpoint, dt: int, do: int, n: int) -> None:
    fd, offset, address = src.fds[st], src.offsets[st] + so, dst.addresses[dt] + do
    while n > 0:
        got = _pread(fd, address, n, offset)
        if got > 0:
            offset, address, n = offset + got, address + got, n - got
            continue
        if got == 0:
            _source_shrank(src)
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err == errno.EFAULT:
            _destination_vanished(dst)
        fail(LlmStatus.LLM_FAILED, f"reading {src.label}: {os.strerror(err)}")
