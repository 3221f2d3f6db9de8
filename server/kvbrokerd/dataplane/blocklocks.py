"""Serialises writes into the same destination blocks, so that no block ever mixes the bytes of two transfers.

Two pulls (copies, inbound tcp WRITEs) into the same destination blocks used to interleave: split over several
connections or copy threads, each wrote part of a block and the block ended up half one source, half the other.
Now every write claims its destination cells (one cell = one block of one tensor) before its first byte moves and
keeps them until its last byte has landed (or its worker has stopped); a later writer whose cells overlap waits,
bounded by its own deadline, and then fails with LLM_TIMEOUT having written nothing. Writes to disjoint cells never
wait on each other. A connector may legitimately pull the same blocks again: waiting, not refusing, keeps that
working.

Cheap by construction: a cache's busy cells are one numpy bool array, a claim is one array of slot indices. Caches
with more cells than `MAX_SLOTS` fold cells onto slots (cell % slots); two cells sharing a slot only make writers
wait that need not (never the reverse), and the memory per written cache stays bounded. A claim of cell ranges
(`Spans`: long runs, token units, ~10^6 cells) is held as its ranges, exact and never folded, and checked against the
other held ranges by search: taking, checking and releasing it costs per range, never per cell (a TP rank's share of
a remap is 256 interleaved ranges; marked in the table they cost ~0.5 ms a pull).

Thread-safe: claims come from the event loop (transfers) and from the tcp data server's threads. The table holds
caches weakly: a released cache's state goes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np

from kvbrokerd.dataplane.plan import Plan
from kvbrokerd.errors import LlmStatus, fail

MAX_SLOTS = 1 << 20
_FEW_RUNS = 16
_FEW_CELLS = 256


_Ranges = tuple[np.ndarray, np.ndarray]
"""Cell ranges [lo[i], hi[i]) (int64), sorted, apart and none empty."""


@dataclass(eq=False)
class _CacheCells:
    busy: np.ndarray
    num_blocks: int
    waiters: list[Callable[[], None]] = field(default_factory=list)
    cell_claims: int = 0
    """Claims held in `busy` (none: every slot is free, and a range claim need not look there)."""
    ranges: list[_Ranges] = field(default_factory=list)
    """The range claims held, each as its ranges."""


@dataclass(eq=False)
class Claim:
    """Cells held by one writer until `BlockLocks.release`: `slots` of the table, or `ranges` of cells."""

    cells: _CacheCells
    slots: np.ndarray
    ranges: _Ranges | None = None


@dataclass(frozen=True, slots=True)
class Spans:
    """Cells [lo[i], hi[i]): a claim of long runs (token units: ~10^6 cells) as a few slices, not a cell array."""

    lo: list[int]
    hi: list[int]


_MAX_SPANS = 1024


def run_spans(tensor: np.ndarray, offset: np.ndarray, length: np.ndarray, block_nbytes: int,
              num_blocks: int) -> Spans | None:
    """The cells of `run_cells` as one range per tensor, when each tensor's runs cover a gapless range (None
    otherwise, and for few runs, where the cells are cheap). A range never misses a cell the runs touch."""
    if len(tensor) <= _FEW_RUNS and int(length.sum()) <= _FEW_CELLS * block_nbytes:
        return None
    if bool((tensor[1:] < tensor[:-1]).any()):  # plans keep each tensor's runs together; else take the cells
        return None
    seg = np.concatenate(([0], np.flatnonzero(tensor[1:] != tensor[:-1]) + 1))
    if len(seg) > _MAX_SPANS:
        return None
    start, size = (a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64) for a in (offset, length))
    end = start + size - 1
    if block_nbytes & (block_nbytes - 1) == 0:  # a shift: int64 division costs ~10x more per run
        shift = block_nbytes.bit_length() - 1
        first, last = start >> shift, end >> shift
    else:
        first, last = start // block_nbytes, end // block_nbytes
    lo, hi = np.minimum.reduceat(first, seg), np.maximum.reduceat(last, seg) + 1
    if bool((hi - lo != np.add.reduceat(last - first + 1, seg)).any()):  # gaps (or overlaps): not one range
        return None
    base = tensor[seg].astype(np.int64) * np.int64(num_blocks)
    return Spans((base + lo).tolist(), (base + hi).tolist())


def strided_spans(tensor: np.ndarray, offset: np.ndarray, length: np.ndarray, count: np.ndarray, stride: np.ndarray,
                  block_nbytes: int, num_blocks: int) -> Spans | None:
    """The cells of a strided plan's entries (repetition k of entry i: `length[i]` bytes at offset[i] + k *
    stride[i]) as ranges, one pass per entry, never per repetition: the entries' bounding ranges, merged, when they
    leave no cell between them unclaimed (None otherwise: the caller claims the cells themselves).

    A range must never hold a cell that no entry writes: two pulls from two TP ranks into different heads of the same
    blocks write interleaved cells, and must not wait for each other. A block-size remap's entries each leave gaps
    (a source block fills every other half row of a destination block), but the same pull's other entries fill them:
    their union is gapless, and claiming it is exact."""
    if not len(length):
        return Spans([], [])
    start, size, times, step = (a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64)
                                for a in (offset, length, count, stride))
    if block_nbytes & (block_nbytes - 1) == 0:  # masks and shifts: int64 division costs ~10x more per entry
        if bool(((start | size | step) & (block_nbytes - 1)).any()):  # not whole blocks
            return None
        shift = block_nbytes.bit_length() - 1
        first, blocks, step_blocks = start >> shift, size >> shift, step >> shift
    else:  # (each apart: an OR of multiples of a block size that is not a power of two is not one)
        if bool((((start % block_nbytes) | (size % block_nbytes) | (step % block_nbytes)) != 0).any()):
            return None
        first, blocks, step_blocks = start // block_nbytes, size // block_nbytes, step // block_nbytes
    lo = tensor.astype(np.int64) * np.int64(num_blocks) + first
    hi = lo + (times - 1) * step_blocks + blocks
    cells = times * blocks  # no two entries share a cell: the planner refused duplicates
    order = np.argsort(lo, kind="stable")
    lo, hi, cells = lo[order], hi[order], cells[order]
    reach = np.maximum.accumulate(hi)
    new = np.flatnonzero(np.concatenate(([True], lo[1:] > reach[:-1])))  # not touching what came before
    ends = np.append(new[1:], len(lo)) - 1
    span_lo, span_hi = lo[new], reach[ends]
    if bool((np.add.reduceat(cells, new) != span_hi - span_lo).any()):  # a cell in a range that nobody writes
        return None
    return Spans(span_lo.tolist(), span_hi.tolist())


def run_cells(tensor: np.ndarray, offset: np.ndarray, length: np.ndarray, block_nbytes: int,
              num_blocks: int) -> np.ndarray:
    """Cells (tensor * num_blocks + block) that byte runs touch: run i covers bytes [offset, offset + length) of
    tensor `tensor[i]`. Runs must be non-empty (the planner and the data server check that first)."""
    if len(tensor) <= _FEW_RUNS and int(length.sum()) <= _FEW_CELLS * block_nbytes:
        # plain ints beat a dozen numpy calls on tiny arrays (small pulls' latency); not on a few long runs of
        # small blocks (token units), where the list would hold ~10^6 ints
        few: list[int] = []
        for t, off, n in zip(tensor.tolist(), offset.tolist(), length.tolist(), strict=True):
            first = t * num_blocks + off // block_nbytes
            few.extend(range(first, first + (off + n - 1) // block_nbytes - off // block_nbytes + 1))
        return np.array(few, dtype=np.int64)
    bpb = np.int64(block_nbytes)
    first = offset.astype(np.int64) // bpb
    last = (offset.astype(np.int64) + length.astype(np.int64) - 1) // bpb
    base = tensor.astype(np.int64) * np.int64(num_blocks) + first
    counts = last - first + 1
    if not len(counts) or bool(np.all(counts == 1)):  # one block per run: the common, scattered-blocks case
        return base
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    cells: np.ndarray = np.repeat(base, counts) + (np.arange(int(counts.sum()), dtype=np.int64) - starts)
    return cells


def plan_cells(plan: Plan, num_blocks: int) -> Spans | np.ndarray:
    """What a plan's claim holds: merged ranges of cells where the plan's entries fill them (strided or not), else
    the cells themselves, exactly (strided entries with gaps between them: their repetitions written out)."""
    if plan.count is not None and plan.dst_stride is not None:
        spans = strided_spans(plan.dst_tensor, plan.dst_offset, plan.length, plan.count, plan.dst_stride,
                              plan.block_nbytes, num_blocks)
        if spans is not None:
            return spans
        plan = plan.plain()
    return run_spans(plan.dst_tensor, plan.dst_offset, plan.length, plan.block_nbytes, num_blocks) or run_cells(
        plan.dst_tensor, plan.dst_offset, plan.length, plan.block_nbytes, num_blocks)


class BlockLocks:
    """Per-cache busy cells; `key` is the cache's object (a registry entry, a remote cache), held weakly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: weakref.WeakKeyDictionary[object, _CacheCells] = weakref.WeakKeyDictionary()

    def _try(self, key: object, num_tensors: int, num_blocks: int, cells: np.ndarray | Spans,
             wake: Callable[[], None] | None) -> Claim | None:
        """Claims `cells` if none is busy; otherwise registers `wake` (if any) for the next release (atomically,
        so that no release is missed) and returns None."""
        with self._lock:
            state = self._caches.get(key)
            if state is None:
                state = _CacheCells(np.zeros(max(1, min(num_tensors * num_blocks, MAX_SLOTS)), dtype=bool),
                                    num_blocks)
                self._caches[key] = state
            folded = len(state.busy) < num_tensors * num_blocks
            if isinstance(cells, Spans):
                ranges = _ranges(cells)
                # the table only where a cell claim is held in it (folded: maybe more waiting, never less)
                in_table = bool(state.cell_claims) and _any_busy(state.busy, _union(_slot_spans(
                    cells, len(state.busy) if folded else 0)))
                if in_table or any(_ranges_meet(ranges, held) for held in state.ranges):
                    if wake is not None:
                        state.waiters.append(wake)
                    return None
                state.ranges.append(ranges)
                return Claim(state, _NO_SLOTS, ranges)
            slots = cells % len(state.busy) if folded else cells
            if state.busy[slots].any() or any(_cells_in(cells, held) for held in state.ranges):
                if wake is not None:
                    state.waiters.append(wake)
                return None
            state.busy[slots] = True
            state.cell_claims += 1
            return Claim(state, slots)

    def release(self, claim: Claim) -> None:
        state = claim.cells
        with self._lock:
            if claim.ranges is None:
                state.busy[claim.slots] = False
                state.cell_claims -= 1
            else:
                state.ranges = [held for held in state.ranges if held is not claim.ranges]
            waiters, state.waiters = state.waiters, []
        for wake in waiters:
            wake()

    def claim(self, key: object, num_tensors: int, num_blocks: int, cells: np.ndarray | Spans, deadline: float,
              what: str) -> Claim:
        """Blocks (a data-server thread) until `cells` are free, at most until `deadline` (time.monotonic)."""
        while True:
            freed = threading.Event()
            held = self._try(key, num_tensors, num_blocks, cells, freed.set)
            if held is not None:
                return held
            if not freed.wait(max(0.0, deadline - time.monotonic())):
                _busy_past_deadline(what)

    async def claim_async(self, key: object, num_tensors: int, num_blocks: int, cells: np.ndarray | Spans,
                          deadline: float, what: str) -> Claim:
        """`claim` for the event loop: waits without blocking the loop."""
        held = self._try(key, num_tensors, num_blocks, cells, None)  # the common case: nobody else writes there
        if held is not None:
            return held
        loop = asyncio.get_running_loop()
        while True:
            freed: asyncio.Future[None] = loop.create_future()

            def wake(fut: asyncio.Future[None] = freed) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                    loop.call_soon_threadsafe(_resolve, fut)

            held = self._try(key, num_tensors, num_blocks, cells, wake)
            if held is not None:
                return held
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await freed
            except TimeoutError:
                _busy_past_deadline(what)


_NO_SLOTS = np.zeros(0, dtype=np.int64)


def _ranges(cells: Spans) -> _Ranges:
    """A claim's cell ranges as `_Ranges`: empty ones dropped, sorted, overlapping or touching ones joined."""
    lo, hi = np.asarray(cells.lo, dtype=np.int64), np.asarray(cells.hi, dtype=np.int64)
    if bool((hi <= lo).any()):
        keep = hi > lo
        lo, hi = lo[keep], hi[keep]
    if len(lo) > 1 and not bool((lo[1:] >= hi[:-1]).all()):  # (the planner's ranges come sorted and apart)
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        first = np.flatnonzero(np.concatenate(([True], lo[1:] > np.maximum.accumulate(hi)[:-1])))
        lo, hi = lo[first], np.maximum.reduceat(hi, first)
    return lo, hi


def _ranges_meet(ranges: _Ranges, held: _Ranges) -> bool:
    """Whether a cell lies in both: for each range, the first held range that ends past its start is the only one
    that can hold one of its cells (the held ranges are sorted and apart)."""
    lo, hi = ranges
    held_lo, held_hi = held
    if not len(lo) or not len(held_lo):
        return False
    after = np.searchsorted(held_hi, lo, side="right")
    there = after < len(held_hi)
    return bool((held_lo[np.minimum(after, len(held_hi) - 1)] < hi)[there].any())


def _cells_in(cells: np.ndarray, held: _Ranges) -> bool:
    """Whether one of `cells` lies in the held ranges."""
    held_lo, held_hi = held
    if not len(cells) or not len(held_lo):
        return False
    after = np.searchsorted(held_hi, cells, side="right")
    there = after < len(held_hi)
    return bool((held_lo[np.minimum(after, len(held_hi) - 1)] <= cells)[there].any())


def _slot_spans(cells: Spans, folded_to: int) -> list[tuple[int, int]]:
    """Slot ranges of cell ranges; with `folded_to` slots, cell c is slot c % folded_to (a range wraps at most
    once, or covers every slot)."""
    if not folded_to:
        return list(zip(cells.lo, cells.hi, strict=True))
    if len(cells.lo) > 8:  # a TP rank's share of a long pull: a range per block and tensor, folded at once
        first, past = np.asarray(cells.lo, dtype=np.int64), np.asarray(cells.hi, dtype=np.int64)
        if bool((past - first >= folded_to).any()):
            return [(0, folded_to)]
        start = first % folded_to
        end = start + (past - first)
        wraps = end > folded_to
        return list(zip(np.concatenate((start, np.zeros(int(wraps.sum()), dtype=np.int64))).tolist(),
                        np.concatenate((np.minimum(end, folded_to), end[wraps] - folded_to)).tolist(), strict=True))
    out = []
    for lo, hi in zip(cells.lo, cells.hi, strict=True):
        if hi - lo >= folded_to:
            return [(0, folded_to)]
        a = lo % folded_to
        b = a + (hi - lo)
        out.extend([(a, b)] if b <= folded_to else [(a, folded_to), (0, b - folded_to)])
    return out


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The slot ranges sorted, empty ones dropped, overlapping or touching ones joined: the same slots, and in the
    order `_any_busy` checks in one call (folded slots of a long claim wrap and may meet)."""
    if len(spans) <= 8:
        return spans
    arr = np.asarray(spans, dtype=np.int64)
    arr = arr[arr[:, 1] > arr[:, 0]]
    if not len(arr):
        return []
    arr = arr[np.argsort(arr[:, 0], kind="stable")]
    lo, hi = arr[:, 0], arr[:, 1]
    first = np.flatnonzero(np.concatenate(([True], lo[1:] > np.maximum.accumulate(hi)[:-1])))
    return list(zip(lo[first].tolist(), np.maximum.reduceat(hi, first).tolist(), strict=True))


def _any_busy(busy: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    """Whether a cell of the slot ranges is busy: one numpy call for many ordered ranges (a TP rank's share of a
    pull is a range per block and tensor: a loop over 256 of them cost ~0.3 ms), else a loop."""
    if len(spans) > 8:
        bounds = np.asarray(spans, dtype=np.int64).reshape(-1)
        if bool((bounds[1:] >= bounds[:-1]).all()):  # ordered and apart: [lo0, hi0, lo1, hi1, ...] splits busy
            cut = bounds[:-1] if bounds[-1] == len(busy) else bounds  # the last range then runs to the end
            return bool(np.logical_or.reduceat(busy, cut)[0::2].any())
    return any(busy[a:b].any() for a, b in spans)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _busy_past_deadline(what: str) -> NoReturn:
    fail(LlmStatus.LLM_TIMEOUT, f"{what}: another transfer was still writing the same destination blocks when the "
         "deadline passed (writes to the same blocks take turns); nothing was written")


DEFAULT = BlockLocks()
"""The daemon's table: transfers and the tcp data server must share one, so that their writes take turns."""
