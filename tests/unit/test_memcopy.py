"""The vectorised plan handling of copies: pieces cover every run exactly once, parts stay balanced, and a copy
moves exactly the plan's bytes whichever way it is cut (two threads, chunks)."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.types import CacheDesc, DataType
from kvbrokerd.backends.common import memcopy
from kvbrokerd.dataplane.plan import Pieces, Plan, Progress
from kvbrokerd.registry.endpoint import Endpoint
from kvbrokerd.transfers.planner import LayerSelection, plan_blocks


def _plan(lengths: list[int]) -> Plan:
    n = np.asarray(lengths, dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.uint64)
    zeros = np.zeros(len(n), dtype=np.uint32)
    return Plan(zeros, offsets, zeros, offsets[::-1].copy(), n, np.arange(len(n), dtype=np.uint64), 1)


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 8))
def test_split_covers_every_byte_of_every_run_once_in_balanced_parts(lengths: list[int], parts: int) -> None:
    plan = _plan(lengths)
    pieces = Pieces.of(plan)
    split = pieces.split(parts)
    assert 1 <= len(split) <= parts
    total = sum(lengths)
    for part in split:  # balanced: no part is more than a fair share plus less than one byte
        assert int(part.length.sum()) <= -(-total // parts) + 1
    for run, n in enumerate(lengths):
        got = [(int(p.src_offset[i]) - int(plan.src_offset[run]), int(p.dst_offset[i]) - int(plan.dst_offset[run]),
                int(p.length[i])) for p in split for i in np.flatnonzero(p.run == run)]
        got.sort()
        assert all(src == dst for src, dst, _ in got), "a piece's source and destination moved apart"
        assert [g[0] for g in got] == list(np.cumsum([0] + [g[2] for g in got])[:-1]), "gaps or overlaps"
        assert sum(g[2] for g in got) == n


def _endpoint(buf: np.ndarray, desc: CacheDesc, label: str) -> Endpoint:
    base = buf.ctypes.data
    return Endpoint(label, [base + i * desc.tensor_nbytes for i in range(desc.num_tensors)], [], [], True,
                            lambda: None)


@given(st.lists(st.integers(0, 63), min_size=1, max_size=64, unique=True), st.integers(1, 3),
       st.sampled_from([1 << 10, 1 << 20]))
def test_a_copy_moves_exactly_the_plans_bytes_however_it_is_cut(blocks: list[int], threads: int,
                                                                 chunk: int) -> None:
    desc = CacheDesc(num_tensors=2, shape=(64, 4096), data_type=DataType.UINT8)
    rng = np.random.default_rng(len(blocks))
    src = rng.integers(0, 256, desc.num_tensors * desc.tensor_nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_blocks = np.asarray(blocks, dtype=np.uint64)
    dst_blocks = np.asarray(sorted(blocks), dtype=np.uint64)
    plan = plan_blocks(desc, desc, src_blocks, dst_blocks, LayerSelection())
    progress = Progress(plan)
    old = memcopy.CHUNK_BYTES, memcopy.PARALLEL_MIN_BYTES
    memcopy.CHUNK_BYTES, memcopy.PARALLEL_MIN_BYTES = chunk, 1  # many chunks, and parts even for small plans
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            memcopy.copy_plan(_endpoint(src, desc, "src"), _endpoint(dst, desc, "dst"), plan, progress,
                              time.monotonic() + 30, pool, threads=threads)
    finally:
        memcopy.CHUNK_BYTES, memcopy.PARALLEL_MIN_BYTES = old
    expected = np.zeros_like(src)
    bpb = desc.block_nbytes
    for t in range(desc.num_tensors):
        for s, d in zip(src_blocks.tolist(), dst_blocks.tolist(), strict=True):
            at = t * desc.tensor_nbytes
            expected[at + d * bpb : at + (d + 1) * bpb] = src[at + s * bpb : at + (s + 1) * bpb]
    assert np.array_equal(dst, expected)
    assert progress.bytes_moved == plan.total_bytes
    assert len(progress.failed_dst_blocks()) == 0


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5), st.integers(0, 2)), min_size=1, max_size=30),
       st.data())
def test_failed_blocks_are_exactly_those_an_incomplete_run_covers(runs: list[tuple[int, int, int]],
                                                                  data: st.DataObject) -> None:
    """Against a plain reference: runs of whole blocks (first block, block count, tensor), some landed whole, some
    in part (or retracted), the rest not at all."""
    bpb = 16
    first = np.asarray([r[0] for r in runs], dtype=np.uint64)
    count = np.asarray([r[1] for r in runs], dtype=np.uint64)
    tensor = np.asarray([r[2] for r in runs], dtype=np.uint32)
    plan = Plan(tensor, first * np.uint64(bpb), tensor, first * np.uint64(bpb), count * np.uint64(bpb),
                np.zeros(0, dtype=np.uint64), bpb)
    progress = Progress(plan)
    expected: set[int] = set()
    for i, (b, n, _) in enumerate(runs):
        how = data.draw(st.sampled_from(["whole", "part", "none", "retracted", "array"]))
        length = n * bpb
        if how == "whole":
            progress.mark(i, length)
        elif how == "array":
            progress.mark_runs(np.asarray([i, i]), np.asarray([length - 1, 1], dtype=np.uint64))
        elif how == "part":
            progress.mark(i, length - 1)
        elif how == "retracted":
            progress.mark(i, length)
            progress.mark_runs(np.asarray([i]), np.asarray([-length]))  # taken back: not the source's bytes
        if how in ("part", "none", "retracted"):
            expected.update(range(b, b + n))
    assert progress.failed_dst_blocks().tolist() == sorted(expected)
