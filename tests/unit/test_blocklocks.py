"""Destination-block claims (kvbrokerd.dataplane.blocklocks): overlapping writers take turns, disjoint ones
never wait."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker import LlmError, LlmStatus
from kvbrokerd.dataplane import blocklocks
from kvbrokerd.dataplane.blocklocks import BlockLocks, run_cells

BLOCK = 64
TENSORS, BLOCKS = 4, 32


class _Cache:
    """Stands in for a registry entry: the table keys caches by object identity, weakly."""


def _cells(blocks: list[int], tensors: range = range(TENSORS)) -> np.ndarray:
    t = np.repeat(np.asarray(list(tensors), dtype=np.uint32), len(blocks))
    off = np.tile(np.asarray(blocks, dtype=np.uint64) * np.uint64(BLOCK), len(tensors))
    return run_cells(t, off, np.full(len(t), BLOCK, dtype=np.uint64), BLOCK, BLOCKS)


@given(st.lists(st.tuples(st.integers(0, TENSORS - 1), st.integers(0, BLOCKS * BLOCK - 1),
                          st.integers(1, 4 * BLOCK)), min_size=1, max_size=20))
def test_run_cells_are_the_blocks_each_run_touches(runs: list[tuple[int, int, int]]) -> None:
    runs = [(t, off, min(n, BLOCKS * BLOCK - off)) for t, off, n in runs]
    expected = {t * BLOCKS + b for t, off, n in runs for b in range(off // BLOCK, (off + n - 1) // BLOCK + 1)}
    t, off, n = (np.asarray(c, dtype=np.uint64) for c in zip(*runs, strict=True))
    got = run_cells(t, off, n, BLOCK, BLOCKS)
    assert set(got.tolist()) == expected
    assert len(got) == sum((off + n - 1) // BLOCK - off // BLOCK + 1 for _, off, n in runs)


def test_disjoint_claims_never_wait() -> None:
    """Each claim's deadline has passed already: one that had to wait would fail at once. The claims are really held
    (an overlapping one fails), and their release frees the blocks."""
    locks, cache, other = BlockLocks(), _Cache(), _Cache()
    a = locks.claim(cache, TENSORS, BLOCKS, _cells([0, 1, 2]), time.monotonic(), "a")
    b = locks.claim(cache, TENSORS, BLOCKS, _cells([3, 4]), time.monotonic(), "b")
    c = locks.claim(other, TENSORS, BLOCKS, _cells([0, 1, 2]), time.monotonic(), "another cache")
    d = locks.claim(cache, TENSORS, BLOCKS, _cells([0], range(0)), time.monotonic(), "no tensor")
    for held, block in ((cache, 2), (cache, 3), (other, 1)):
        with pytest.raises(LlmError) as info:
            locks.claim(held, TENSORS, BLOCKS, _cells([block]), time.monotonic(), "overlapping")
        assert info.value.status == LlmStatus.LLM_TIMEOUT
    for claim in (a, b, c, d):
        locks.release(claim)
    locks.release(locks.claim(cache, TENSORS, BLOCKS, _cells([1, 2, 3]), time.monotonic(), "after the release"))


def test_an_overlapping_claim_waits_for_the_release() -> None:
    locks, cache = BlockLocks(), _Cache()
    first = locks.claim(cache, TENSORS, BLOCKS, _cells([5, 6]), time.monotonic(), "first")
    released = threading.Event()

    def release_first() -> None:
        released.set()
        locks.release(first)

    threading.Timer(0.3, release_first).start()
    second = locks.claim(cache, TENSORS, BLOCKS, _cells([6, 7], range(1, 2)), time.monotonic() + 10, "second")
    assert released.is_set(), "the overlapping claim was granted while the first one still held block 6"
    locks.release(second)


def test_an_overlapping_claim_gives_up_at_its_deadline_having_claimed_nothing() -> None:
    locks, cache = BlockLocks(), _Cache()
    first = locks.claim(cache, TENSORS, BLOCKS, _cells([5]), time.monotonic(), "first")
    with pytest.raises(LlmError) as info:
        locks.claim(cache, TENSORS, BLOCKS, _cells([4, 5]), time.monotonic() + 0.2, "transfer x")
    assert info.value.status == LlmStatus.LLM_TIMEOUT and "transfer x" in info.value.message
    # Block 4 was not taken by the failed claim.
    locks.release(locks.claim(cache, TENSORS, BLOCKS, _cells([4]), time.monotonic(), "third"))
    locks.release(first)


async def test_async_claims_wait_without_blocking_the_loop() -> None:
    locks, cache = BlockLocks(), _Cache()
    first = locks.claim(cache, TENSORS, BLOCKS, _cells([1]), time.monotonic(), "first")
    loop_ran = threading.Event()

    def release_once_the_loop_ran() -> None:  # released from another thread, only once the loop ran on
        if loop_ran.wait(30):
            locks.release(first)

    releaser = threading.Thread(target=release_once_the_loop_ran)
    releaser.start()
    claim = asyncio.ensure_future(locks.claim_async(cache, TENSORS, BLOCKS, _cells([1]), time.monotonic() + 10,
                                                    "second"))
    await asyncio.sleep(0)  # one turn of the loop: the claim starts and waits for the release
    # The loop kept running while the claim waited. A claim that blocked the loop would have run to its deadline
    # before this line (nobody releases block 1 before it), and be done.
    assert not claim.done()
    loop_ran.set()
    second = await claim
    releaser.join()
    locks.release(second)
    held = locks.claim(cache, TENSORS, BLOCKS, _cells([2]), time.monotonic(), "held")
    with pytest.raises(LlmError):
        await locks.claim_async(cache, TENSORS, BLOCKS, _cells([2]), time.monotonic() + 0.1, "late")
    locks.release(held)


def test_folded_slots_stay_exclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache with more cells than MAX_SLOTS shares slots between cells: more waiting, never a missed overlap."""
    monkeypatch.setattr(blocklocks, "MAX_SLOTS", 7)
    locks, cache = BlockLocks(), _Cache()
    first = locks.claim(cache, TENSORS, BLOCKS, _cells([9], range(1)), time.monotonic(), "first")  # slot 9 % 7
    with pytest.raises(LlmError):  # cell 16 is another block, but it shares slot 2 with cell 9
        locks.claim(cache, TENSORS, BLOCKS, _cells([16], range(1)), time.monotonic() + 0.05, "same slot")
    locks.release(locks.claim(cache, TENSORS, BLOCKS, _cells([10], range(1)), time.monotonic(), "other slot"))
    locks.release(first)
    locks.release(locks.claim(cache, TENSORS, BLOCKS, _cells([16], range(1)), time.monotonic(), "after"))


def test_concurrent_writers_never_tear_a_block() -> None:
    """Eight threads each write their id into the same blocks, a piece at a time, under claims: every block
    ends up one writer's, whole."""
    locks, cache = BlockLocks(), _Cache()
    memory = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
    blocks = list(range(0, BLOCKS, 3))

    def writer(me: int) -> None:
        for _ in range(5):
            claim = locks.claim(cache, 1, BLOCKS, _cells(blocks, range(1)), time.monotonic() + 30, f"w{me}")
            try:
                for b in blocks:
                    memory[b, : BLOCK // 2] = me
                    time.sleep(0.0005)  # the scenario, not a wait: a write slow enough to be torn if unguarded
                    memory[b, BLOCK // 2 :] = me
            finally:
                locks.release(claim)

    threads = [threading.Thread(target=writer, args=(i + 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in blocks:
        assert len(set(memory[b].tolist())) == 1, f"block {b} mixes writers: {set(memory[b].tolist())}"
    assert len({int(memory[b, 0]) for b in blocks}) == 1  # one claim covers all the blocks: one writer won all


@given(st.lists(st.tuples(st.integers(0, TENSORS - 1), st.integers(0, BLOCKS * BLOCK - 1),
                          st.integers(1, 4 * BLOCK)), min_size=1, max_size=40), st.integers(0, 40))
def test_spans_cover_every_cell_the_runs_touch(runs: list[tuple[int, int, int]], long: int) -> None:
    """Long runs (token units) are claimed as one range per tensor: never a cell less than `run_cells` (more only
    where runs overlap, which a plan's never do: more waiting, never a missed overlap)."""
    runs = sorted((t, off, min(n, BLOCKS * BLOCK - off)) for t, off, n in runs)
    runs += [(TENSORS - 1, 0, BLOCKS * BLOCK)] * (long > 30)  # one tensor whole: a gapless range
    t, off, n = (np.asarray(c, dtype=np.uint64) for c in zip(*runs, strict=True))
    cells = set(run_cells(t, off, n, BLOCK, BLOCKS).tolist())
    spans = blocklocks.run_spans(t, off, n, BLOCK, BLOCKS)
    if spans is None:
        return
    covered = {c for lo, hi in zip(spans.lo, spans.hi, strict=True) for c in range(lo, hi)}
    assert cells <= covered
    assert len(covered) <= len(run_cells(t, off, n, BLOCK, BLOCKS))


@pytest.mark.parametrize("slots", [7, 1 << 20])
def test_span_claims_and_cell_claims_exclude_each_other(monkeypatch: pytest.MonkeyPatch, slots: int) -> None:
    monkeypatch.setattr(blocklocks, "MAX_SLOTS", slots)
    locks, cache = BlockLocks(), _Cache()
    whole = blocklocks.Spans([BLOCKS + 3], [BLOCKS + 20])  # tensor 1, blocks 3..19
    held = locks.claim(cache, TENSORS, BLOCKS, whole, time.monotonic(), "span")
    with pytest.raises(LlmError):
        locks.claim(cache, TENSORS, BLOCKS, _cells([19], range(1, 2)), time.monotonic() + 0.05, "inside")
    with pytest.raises(LlmError):
        locks.claim(cache, TENSORS, BLOCKS, blocklocks.Spans([BLOCKS + 19], [BLOCKS + 25]),
                    time.monotonic() + 0.05, "overlapping span")
    if slots > TENSORS * BLOCKS:  # unfolded: the neighbours are free
        locks.release(locks.claim(cache, TENSORS, BLOCKS, _cells([20, 2], range(1, 2)), time.monotonic(), "next"))
    locks.release(held)
    locks.release(locks.claim(cache, TENSORS, BLOCKS, _cells([19], range(1, 2)), time.monotonic(), "after"))


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), min_size=1, max_size=40),
       st.lists(st.integers(0, 319), max_size=5))
def test_many_ranges_are_seen_busy_exactly_when_a_cell_is(ranges: list[tuple[int, int]], taken: list[int]) -> None:
    busy = np.zeros(320, dtype=bool)
    busy[taken] = True
    spans = [(a, min(a + n, 320)) for a, n in ranges]
    ordered = sorted(set(spans))
    apart = [s for i, s in enumerate(ordered) if i == 0 or s[0] >= ordered[i - 1][1]]
    for case in (spans, apart):
        assert blocklocks._any_busy(busy, case) == any(busy[a:b].any() for a, b in case)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 300)), min_size=1, max_size=60),
       st.integers(50, 1000), st.lists(st.integers(0, 999), max_size=5))
def test_folded_and_joined_ranges_hold_exactly_the_slots_of_the_cells(
        ranges: list[tuple[int, int]], folded_to: int, taken: list[int]) -> None:
    """A claim's cell ranges as slots: folded onto a smaller table (wrapping), sorted and joined, they cover the same
    slots as folding each cell, and are seen busy exactly when one of those slots is."""
    cells = blocklocks.Spans([a for a, _ in ranges], [a + n for a, n in ranges])
    want = {c % folded_to for a, n in ranges for c in range(a, a + n)}
    for folded in (blocklocks._slot_spans(cells, folded_to), blocklocks._union(blocklocks._slot_spans(cells,
                                                                                                     folded_to))):
        assert {s for a, b in folded for s in range(a, b)} == want
    folded = blocklocks._slot_spans(cells, folded_to)
    joined = blocklocks._union(folded)
    if len(folded) > 8:  # (a few ranges are checked one by one, as they are)
        assert all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(joined))
    busy = np.zeros(folded_to, dtype=bool)
    busy[[t % folded_to for t in taken]] = True
    assert blocklocks._any_busy(busy, joined) == bool(want & {t % folded_to for t in taken})


def test_interleaved_range_claims_on_a_folded_table_never_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two TP ranks' shares of a remap into a token view (~10^6 cells, more than the table's slots): interleaved
    ranges, no cell in common. Held as ranges, exact: neither waits for the other (folded onto the table, the second
    waited for cells it shares only a slot with), and a range over a cell of either still does."""
    monkeypatch.setattr(blocklocks, "MAX_SLOTS", 7)
    locks, cache = BlockLocks(), _Cache()
    rank = [blocklocks.Spans([b * 8 + 4 * r for b in range(TENSORS * BLOCKS // 8)],
                             [b * 8 + 4 * r + 4 for b in range(TENSORS * BLOCKS // 8)]) for r in (0, 1)]
    first = locks.claim(cache, TENSORS, BLOCKS, rank[0], time.monotonic(), "rank 0")
    second = locks.claim(cache, TENSORS, BLOCKS, rank[1], time.monotonic(), "rank 1")
    with pytest.raises(LlmError):
        locks.claim(cache, TENSORS, BLOCKS, blocklocks.Spans([9], [11]), time.monotonic() + 0.05, "over rank 0")
    with pytest.raises(LlmError):
        locks.claim(cache, TENSORS, BLOCKS, _cells([5], range(1)), time.monotonic() + 0.05, "a cell of rank 1")
    locks.release(first)
    locks.release(locks.claim(cache, TENSORS, BLOCKS, blocklocks.Spans([9], [11]), time.monotonic(), "after"))
    locks.release(second)


_CLAIM = st.one_of(
    st.lists(st.tuples(st.integers(0, TENSORS * BLOCKS - 1), st.integers(0, 12)), min_size=1, max_size=12).map(
        lambda r: blocklocks.Spans([a for a, _ in r], [min(a + n, TENSORS * BLOCKS) for a, n in r])),
    st.lists(st.integers(0, TENSORS * BLOCKS - 1), min_size=1, max_size=12).map(
        lambda c: np.asarray(sorted(set(c)), dtype=np.int64)))


def _named(claim: np.ndarray | blocklocks.Spans) -> set[int]:
    if isinstance(claim, blocklocks.Spans):
        return {c for lo, hi in zip(claim.lo, claim.hi, strict=True) for c in range(lo, hi)}
    return set(claim.tolist())


@given(st.lists(st.tuples(_CLAIM, st.booleans()), min_size=1, max_size=12))
def test_claims_are_granted_exactly_when_no_held_claim_names_one_of_their_cells(
        steps: list[tuple[np.ndarray | blocklocks.Spans, bool]]) -> None:
    """Range claims and cell claims in any mix (unfolded): a claim is granted iff no cell it names is held, and a
    release frees exactly its cells. Each step claims, then maybe releases the oldest claim held."""
    locks, cache = BlockLocks(), _Cache()
    held: list[tuple[blocklocks.Claim, set[int]]] = []
    for claim, release in steps:
        busy = set().union(*(cells for _, cells in held))
        got = locks._try(cache, TENSORS, BLOCKS, claim, None)
        assert (got is not None) == (not _named(claim) & busy)
        if got is not None:
            held.append((got, _named(claim)))
        if release and held:
            locks.release(held.pop(0)[0])
    for got, _ in held:
        locks.release(got)
    whole = locks._try(cache, TENSORS, BLOCKS, blocklocks.Spans([0], [TENSORS * BLOCKS]), None)
    assert whole is not None  # everything released: nothing left held


@pytest.mark.parametrize("block_nbytes", [64, 48])  # shifts and masks, and division
@given(st.lists(st.tuples(st.integers(0, TENSORS - 1), st.integers(0, 40), st.integers(1, 3), st.integers(1, 5),
                          st.integers(1, 6), st.booleans()), min_size=1, max_size=8))
def test_strided_spans_hold_exactly_the_cells_the_repetitions_write(
        block_nbytes: int, entries: list[tuple[int, int, int, int, int, bool]]) -> None:
    """Entries (tensor, first block, blocks, count, step in blocks, whole): when `strided_spans` gives ranges, they
    hold exactly the cells written; an entry that is not whole blocks gives none."""
    written: list[int] = []
    for t, first, size, count, step, _ in entries:
        written += [t * 10_000 + first + k * max(step, size) + j for k in range(count) for j in range(size)]
    if len(set(written)) != len(written):
        return  # a plan never writes a cell twice (the planner refused it)
    tensor, offset, length, times, stride = (np.asarray(c, dtype=np.uint64) for c in zip(*(
        (t, first * block_nbytes + (0 if whole else 1), size * block_nbytes, count, max(step, size) * block_nbytes)
        for t, first, size, count, step, whole in entries), strict=True))
    spans = blocklocks.strided_spans(tensor.astype(np.uint32), offset, length, times, stride, block_nbytes, 10_000)
    if not all(whole for *_, whole in entries):
        assert spans is None
    elif spans is not None:
        assert {c for lo, hi in zip(spans.lo, spans.hi, strict=True) for c in range(lo, hi)} == set(written)
