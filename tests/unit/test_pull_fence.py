"""The fence of a copy (issue 30, finding 3): bytes that land after the request's deadline never count as landed, and
a copy that resumes past its deadline (a daemon frozen mid-copy) writes at most the chunk it was in. The freeze is
a jump of the copy's clock, so the test does not depend on the machine's speed."""

from __future__ import annotations

import concurrent.futures
import itertools
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbrokerd.backends.common import memcopy, sockio
from kvbrokerd.dataplane.plan import Pieces, Plan, Progress
from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.registry.endpoint import Endpoint

CHUNK = memcopy.CHUNK_BYTES


def _one_run(nbytes: int) -> Plan:
    zero32, zero64 = np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint64)
    return Plan(zero32, zero64, zero32, zero64.copy(), np.asarray([nbytes], dtype=np.uint64),
                np.zeros(1, dtype=np.uint64), nbytes)


def _endpoint(buf: np.ndarray, label: str) -> Endpoint:
    return Endpoint(label, [buf.ctypes.data], [], [], True, lambda: None)


class _Clock:
    """time.monotonic as a frozen daemon sees it: after `calls` reads, it is suddenly far past any deadline."""

    def __init__(self, calls: int) -> None:
        self._reads = itertools.count()
        self._calls = calls

    def __call__(self) -> float:
        return 0.0 if next(self._reads) < self._calls else 1e9


def test_a_run_larger_than_a_chunk_is_copied_in_pieces_and_the_late_one_never_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One 4-chunk run; the daemon "freezes" during the first chunk and resumes past the deadline: the chunk it was
    in may land, it is not reported as landed, and nothing after it is written."""
    nbytes = 4 * CHUNK
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    plan = _one_run(nbytes)
    progress = Progress(plan)
    monkeypatch.setattr(time, "monotonic", _Clock(1))  # the check before the first chunk passes, no other
    with concurrent.futures.ThreadPoolExecutor(1) as pool, pytest.raises(LlmError) as err:
        memcopy.copy_plan(_endpoint(src, "src"), _endpoint(dst, "dst"), plan, progress, 100.0, pool, threads=1)
    assert err.value.status == LlmStatus.LLM_TIMEOUT
    assert progress.bytes_moved == 0, "bytes copied after the deadline were counted as landed"
    assert not dst[CHUNK:].any(), "the copy went on writing after it found its deadline passed"


def test_chunks_that_ended_before_the_deadline_count_and_the_rest_is_reported() -> None:
    nbytes = 3 * CHUNK
    src = np.full(nbytes, 9, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    plan = _one_run(nbytes)
    progress = Progress(plan)
    clock = _Clock(4)  # before chunk 1, after it, before chunk 2, after it: then frozen past the deadline
    with pytest.MonkeyPatch.context() as mp, concurrent.futures.ThreadPoolExecutor(1) as pool, \
            pytest.raises(LlmError):
        mp.setattr(time, "monotonic", clock)
        memcopy.copy_plan(_endpoint(src, "src"), _endpoint(dst, "dst"), plan, progress, 100.0, pool, threads=1)
    assert progress.bytes_moved == 2 * CHUNK
    assert (dst[: 2 * CHUNK] == 9).all() and not dst[2 * CHUNK:].any()
    assert list(progress.failed_dst_blocks()) == [0]  # the run's block did not land whole


@given(st.lists(st.integers(1, 5 * 1024), min_size=1, max_size=20), st.integers(1, 3 * 1024))
def test_bounded_pieces_cover_every_byte_once_and_none_is_larger_than_the_bound(lengths: list[int],
                                                                                 bound: int) -> None:
    n = np.asarray(lengths, dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.uint64)
    zeros = np.zeros(len(n), dtype=np.uint32)
    plan = Plan(zeros, offsets, zeros, offsets + np.uint64(7), n, np.arange(len(n), dtype=np.uint64), 1)
    pieces = Pieces.of(plan).bounded(bound)
    assert int(pieces.length.max()) <= bound
    for run, length in enumerate(lengths):
        mine = np.flatnonzero(pieces.run == run)
        starts = pieces.src_offset[mine] - plan.src_offset[run]
        assert list(starts) == list(np.cumsum([0, *pieces.length[mine][:-1].tolist()]))
        assert int(pieces.length[mine].sum()) == length
        assert (pieces.dst_offset[mine] - pieces.src_offset[mine] == 7).all()


def test_strided_pieces_are_bounded_between_repetitions() -> None:
    one = np.ones(1, dtype=np.uint64)
    plan = Plan(np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint32),
                np.zeros(1, dtype=np.uint64), np.asarray([1000], dtype=np.uint64), one, 1000,
                count=np.asarray([10], dtype=np.uint64), src_stride=np.asarray([4000], dtype=np.uint64),
                dst_stride=np.asarray([2000], dtype=np.uint64))
    pieces = Pieces.of(plan).bounded(3000)
    assert pieces.count is not None and pieces.first_repeat is not None
    assert pieces.count.tolist() == [3, 3, 3, 1] and pieces.first_repeat.tolist() == [0, 3, 6, 9]
    assert pieces.src_offset.tolist() == [0, 12000, 24000, 36000]
    assert pieces.dst_offset.tolist() == [0, 6000, 12000, 18000]


def test_a_receive_that_ends_after_the_deadline_marks_no_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """tcp: the bytes of a receive that returned after the deadline are not reported as landed."""
    left, right = socket.socketpair()
    try:
        payload = bytes(range(256)) * 64
        sender = threading.Thread(target=left.sendall, args=(payload,))
        sender.start()
        sender.join()
        target = bytearray(len(payload))
        views = [memoryview(target)[i : i + 4096] for i in range(0, len(payload), 4096)]
        landed: list[int] = []
        monkeypatch.setattr(time, "monotonic", _Clock(2))  # the watch, the check; frozen in the receive
        with pytest.raises(TimeoutError):
            sockio.recv_views(right, views, landed.append, sockio.Watch(100.0))
        assert landed == []
    finally:
        left.close()
        right.close()
