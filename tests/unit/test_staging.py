"""The tcp plane's staged path for small runs (backends/staging.py): the reader and the server of a READ over a
socket pair, with real mappings, including a source whose memory vanishes in the middle of a read."""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from kvbroker.status import LlmError, LlmStatus
from kvbrokerd.backends.common import memcopy, sockio, staging
from kvbrokerd.backends.tcp import channel as tcp_channel
from kvbrokerd.backends.tcp import server as tcp_server
from kvbrokerd.backends.tcp import wire as tcp_wire
from kvbrokerd.dataplane.plan import Pieces, Plan, Progress

pytestmark = pytest.mark.skipif(not memcopy.copy_runs_available(), reason="kvbrokerd._safecopy is not built here")
RUN = 3000  # bytes a run: small, odd, and a chunk ends inside no run
COUNT = 1000  # ~3 MB: several staging chunks


class Side:
    """A one-tensor cache in a tmpfs file, mapped read-write: what `tcp` needs of a CacheEntry."""

    def __init__(self, path: Path, size: int, fill: int | None) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self.map, np.uint8)
        if fill is not None:
            self.array[:] = np.random.default_rng(fill).integers(0, 256, size, dtype=np.uint8)
        self.entry = SimpleNamespace(cache_id=7, addresses=[int(self.array.ctypes.data)], views=[memoryview(self.map)])

    def close(self) -> None:
        del self.array
        self.entry.views[0].release()
        self.map.close()
        os.close(self.fd)


def _pieces(src_order: np.ndarray, dst_order: np.ndarray) -> tuple[Pieces, Plan, np.ndarray]:
    n = np.full(len(src_order), RUN, dtype=np.uint64)
    zeros = np.zeros(len(n), dtype=np.uint32)
    plan = Plan(zeros, src_order.astype(np.uint64) * np.uint64(RUN), zeros,
                dst_order.astype(np.uint64) * np.uint64(RUN), n, dst_order.astype(np.uint64), RUN)
    runs = np.zeros(len(n), dtype=tcp_wire.RUN)
    runs["tensor"], runs["offset"], runs["length"] = 0, plan.src_offset, n
    return Pieces.of(plan), plan, runs


def _read(tmp_path: Path, truncate_to: int | None) -> tuple[Side, Side, Progress, LlmError | None, np.ndarray]:
    rng = np.random.default_rng(5)
    src_order, dst_order = rng.permutation(COUNT), rng.permutation(COUNT)
    src, dst = Side(tmp_path / "src", COUNT * RUN, 1), Side(tmp_path / "dst", COUNT * RUN, None)
    pieces, plan, runs = _pieces(src_order, dst_order)
    assert staging.worth_it(pieces.length) and staging.worth_it(runs["length"])
    if truncate_to is not None:
        os.ftruncate(src.fd, truncate_to)  # the model server frees memory the read is about to copy
    client, server = socket.socketpair()
    total = int(pieces.length.sum())
    watch = sockio.Watch(time.monotonic() + 20)

    def serve() -> None:
        reply = memoryview(tcp_wire.REPLY.pack(b"KVRS", 0, total))
        tcp_server.DataServer._serve_read_staged(server, cast(Any, src.entry), runs, reply, total, watch)

    thread = threading.Thread(target=serve)
    thread.start()
    progress = Progress(plan)
    error = None
    try:
        tcp_channel._expect_ok(client, "read", watch)
        tcp_channel._read_staged(client, cast(Any, dst.entry), pieces, progress, watch)
        trailer = bytearray(tcp_wire.TRAILER.size)
        sockio.recv_exact(client, memoryview(trailer), watch)
        tcp_channel._check_trailer(trailer, pieces, progress, 7)
    except LlmError as e:
        error = e
    finally:
        thread.join(10)
        client.close()
        server.close()
    return src, dst, progress, error, src_order


def test_a_staged_read_lands_every_run_where_it_belongs(tmp_path: Path) -> None:
    src, dst, progress, error, _ = _read(tmp_path, None)
    try:
        assert error is None
        plan = progress.plan
        for so, do in zip(plan.src_offset.tolist(), plan.dst_offset.tolist(), strict=True):
            assert np.array_equal(dst.array[do : do + RUN], src.array[so : so + RUN])
        assert progress.bytes_moved == COUNT * RUN and not len(progress.failed_dst_blocks())
    finally:
        src.close()
        dst.close()


def test_source_memory_that_vanishes_mid_read_fails_exactly_the_runs_read_after_it(tmp_path: Path) -> None:
    keep = (COUNT * RUN // 2) // 4096 * 4096  # pages past this are gone when the server copies them
    src, dst, progress, error, _ = _read(tmp_path, keep)
    try:
        assert error is not None and error.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST, error
        plan = progress.plan
        # The server stops at the first run (in stream order) that touches a vanished page; every run before it is
        # the source's, every run from it on is reported failed (the stream carried zeros for them).
        first_bad = int(np.flatnonzero(plan.src_offset + plan.length > np.uint64(keep))[0])
        failed = set(progress.failed_dst_blocks().tolist())
        assert failed == set(plan.dst_blocks[first_bad:].tolist())
        for i in range(first_bad):
            so, do = int(plan.src_offset[i]), int(plan.dst_offset[i])
            assert np.array_equal(dst.array[do : do + RUN], src.array[so : so + RUN])
    finally:
        src.close()
        dst.close()


def _write(tmp_path: Path, truncate_to: int | None) -> tuple[Side, np.ndarray, Plan, Exception | None, bool]:
    """The server's half of a WRITE of small runs (`_recv_staged`) fed over a socket pair."""
    rng = np.random.default_rng(9)
    dst = Side(tmp_path / "dst", COUNT * RUN, None)
    payload = rng.integers(0, 256, COUNT * RUN, dtype=np.uint8)
    _, plan, runs = _pieces(np.arange(COUNT), rng.permutation(COUNT))
    runs["offset"] = plan.dst_offset  # the server writes into the destination's offsets
    if truncate_to is not None:
        os.ftruncate(dst.fd, truncate_to)
    client, server = socket.socketpair()
    sender = threading.Thread(target=lambda: client.sendall(payload.tobytes() + b"after"))
    sender.start()
    error: Exception | None = None
    try:
        watch = sockio.Watch(time.monotonic() + 20)
        try:
            tcp_server._recv_staged(server, cast(Any, dst.entry), runs, watch)
        except sockio.MemoryFault as fault:
            error = fault
            sockio.drain(server, COUNT * RUN - fault.done, watch)
        in_step = sockio.recv_bytes(server, 5, watch) == b"after"  # the stream is still in step
    finally:
        sender.join(10)
        client.close()
        server.close()
    return dst, payload, plan, error, in_step


def test_a_staged_write_lands_every_run_where_it_belongs(tmp_path: Path) -> None:
    dst, payload, plan, error, in_step = _write(tmp_path, None)
    try:
        assert error is None and in_step
        for i, do in enumerate(plan.dst_offset.tolist()):
            assert np.array_equal(dst.array[do : do + RUN], payload[i * RUN : (i + 1) * RUN])
    finally:
        dst.close()


def test_destination_memory_that_vanishes_mid_write_fails_it_and_keeps_the_stream_in_step(tmp_path: Path) -> None:
    dst, _, _, error, in_step = _write(tmp_path, (COUNT * RUN // 3) // 4096 * 4096)
    try:
        assert isinstance(error, sockio.MemoryFault) and 0 < error.done <= COUNT * RUN, error
        assert in_step, "the payload after the fault was not drained: the next request would be misread"
    finally:
        dst.close()
