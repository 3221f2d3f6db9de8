"""Copies planned byte runs between two mapped caches: the engine of the `shm` backend and of local copies.

Runs are copied with `ctypes.memmove` on raw addresses: the planner has checked every run against both caches'
sizes, callers keep the mappings alive (pins, arrays), and memmove releases the GIL, so two copiers really run in
parallel on large plans.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import time
from collections.abc import Sequence

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


def small_enough_for_the_loop(plan: Plan) -> bool:
    return plan.total_bytes <= INLINE_MAX_BYTES and plan.num_runs <= INLINE_MAX_RUNS
_DEADLINE_CHECK_EVERY = 256


def addresses(views: Sequence[memoryview | np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """(uint8 arrays over the buffers, their base addresses). The addresses stay valid while the underlying
    mappings stay open (pinned caches, held segment maps), whether or not the arrays are kept."""
    arrays = [v if isinstance(v, np.ndarray) else np.frombuffer(v, np.uint8) for v in views]
    return arrays, [int(a.ctypes.data) for a in arrays]


def copy_plan(src_addr: list[int], dst_addr: list[int], plan: Plan, progress: Progress, deadline: float,
              executor: concurrent.futures.Executor, threads: int = 2) -> int:
    runs = plan.runs()

    def copy(chunk: list[Run]) -> None:
        for i, (idx, st, so, dt, do, n) in enumerate(chunk):
            if i % _DEADLINE_CHECK_EVERY == 0:
                if time.monotonic() > deadline:
                    fail(LlmStatus.LLM_TIMEOUT, "deadline passed during the memory copy")
                if progress.cancelled:
                    fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
            ctypes.memmove(dst_addr[dt] + do, src_addr[st] + so, n)
            progress.mark(idx, n)

    if threads < 2 or plan.total_bytes < PARALLEL_MIN_BYTES or len(runs) < 2:
        copy(runs)
        return plan.total_bytes
    run_parts(executor, copy, split_runs(runs, threads))
    return plan.total_bytes
