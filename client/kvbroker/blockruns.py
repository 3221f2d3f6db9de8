"""Block pairs as runs (`BlockRuns` on the wire): long block lists in a few numbers, and back.

A pull of token units names ~10^5 (src, dst) pairs that are nearly all consecutive: as runs (and runs repeated at a
fixed stride) they are a few dozen numbers, so neither side builds, sends or parses 10^5 Python ints. The daemon
expands them with `expand`, after `check` has bounded everything, into the arrays a plain list would have given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_PAIRS = 1 << 20
"""As the daemon's MAX_BLOCKS_PER_REQUEST: no message expands to more."""
MAX_INDEX = (1 << 63) - 1
"""Block indices past this are refused in runs (no cache has that many blocks; int64 arithmetic stays exact)."""
MIN_PAIRS = 1024
"""Shorter lists go as plain lists: their runs would save little."""
_MAX_STRIDE_GROUPS = 4096
"""Finding strided repetitions loops over candidate groups in Python; past this many it is not worth it."""


@dataclass(frozen=True, slots=True)
class Runs:
    """Run i, repetition k pairs src_first[i] + k * src_stride[i] + j with dst_first[i] + k * dst_stride[i] + j, for
    j < length[i] and k < count[i]. uint64 arrays of one length."""

    src_first: np.ndarray
    dst_first: np.ndarray
    length: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray

    @property
    def num_pairs(self) -> int:
        return int((self.length * self.count).sum())


def concatenated(runs: Sequence[Runs]) -> Runs:
    """Several requests' runs as one's (their pairs, all of them)."""
    return Runs(*(np.concatenate([getattr(r, f) for r in runs]) for f in Runs.__slots__))


def pairs_named(length: Sequence[int] | np.ndarray, count: Sequence[int] | np.ndarray = ()) -> int:
    """How many pairs runs of these lengths (and repetitions, where `count` has one per run) name, from their sizes
    alone: before `check`, and without writing a pair out. Exact for runs that `check` would take; a run over its
    bounds counts as MAX_PAIRS + 1, which is over every budget anyway."""
    cap = float(MAX_PAIRS + 1)
    sizes = np.minimum(np.fromiter(length, dtype=np.float64, count=len(length)), cap)
    if len(count) == len(length):
        sizes *= np.minimum(np.fromiter(count, dtype=np.float64, count=len(count)), cap)
    return int(sizes.sum())  # float64: exact far past any budget (each term <= 2^42)


class RunsError(ValueError):
    """Malformed runs (the daemon answers LLM_PARAM_INVALID)."""


def _u64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values.astype(np.uint64, copy=False)
    return np.fromiter(values, dtype=np.uint64, count=len(values))


def check(src_first: Sequence[int] | np.ndarray, dst_first: Sequence[int] | np.ndarray,
          length: Sequence[int] | np.ndarray, count: Sequence[int] | np.ndarray = (),
          src_stride: Sequence[int] | np.ndarray = (), dst_stride: Sequence[int] | np.ndarray = ()) -> Runs:
    """Bounded runs, or RunsError: nothing here allocates more than the message's own size, and every later sum
    fits int64."""
    n = len(src_first)
    if n == 0:
        raise RunsError("block_runs has no runs")
    if n > MAX_PAIRS:
        raise RunsError(f"block_runs has {n} runs; at most {MAX_PAIRS}")
    if len(dst_first) != n or len(length) != n:
        raise RunsError(f"block_runs: src_first has {n} entries, dst_first {len(dst_first)}, length {len(length)}; "
                        "they must be equal")
    repeated = (len(count), len(src_stride), len(dst_stride))
    if repeated not in ((0, 0, 0), (n, n, n)):
        raise RunsError(f"block_runs: count, src_stride and dst_stride have {repeated} entries; all must be empty or "
                        f"have {n}")
    src, dst, size = _u64(src_first), _u64(dst_first), _u64(length)
    ones, zeros = np.ones(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    times = _u64(count) if len(count) else ones
    s_step = _u64(src_stride) if len(src_stride) else zeros
    d_step = _u64(dst_stride) if len(dst_stride) else zeros
    for name, values in (("length", size), ("count", times)):
        if (values == 0).any() or (values > MAX_PAIRS).any():
            raise RunsError(f"block_runs: every {name} must be in [1, {MAX_PAIRS}]")
    total = int((size * times).sum())  # each product <= 2^40, n <= 2^20: no wrap
    if total > MAX_PAIRS:
        raise RunsError(f"block_runs expand to {total} block pairs; at most {MAX_PAIRS}")
    top = np.uint64(MAX_INDEX)
    for name, first, step in (("src", src, s_step), ("dst", dst, d_step)):
        # The last block of run i is first + (count - 1) * stride + length - 1; checked without computing it where
        # it could wrap.
        if (first > top - (size - np.uint64(1))).any():
            raise RunsError(f"block_runs: a {name} run ends past block {MAX_INDEX}")
        room = top - first - (size - np.uint64(1))
        reps = times - np.uint64(1)
        over = (reps > 0) & (step > room // np.maximum(reps, np.uint64(1)))
        if over.any():
            raise RunsError(f"block_runs: a repeated {name} run ends past block {MAX_INDEX}")
    return Runs(src, dst, size, times, s_step, d_step)


Segments = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(src starts, dst starts, lengths) as int64 arrays: the runs with every repetition written out."""


def segments(runs: Runs) -> Segments:
    """The consecutive stretches of checked runs (at most as many as their pairs)."""
    if bool((runs.count == 1).all()):  # no repetitions (the common, consecutive case): the runs themselves
        return runs.src_first.view(np.int64), runs.dst_first.view(np.int64), runs.length.view(np.int64)
    rep = runs.count.view(np.int64)
    index = np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)
    return (np.repeat(runs.src_first.view(np.int64), rep) + index * np.repeat(runs.src_stride.view(np.int64), rep),
            np.repeat(runs.dst_first.view(np.int64), rep) + index * np.repeat(runs.dst_stride.view(np.int64), rep),
            np.repeat(runs.length.view(np.int64), rep))


def expand(runs: Runs | Segments) -> tuple[np.ndarray, np.ndarray]:
    """The (src, dst) pairs of checked runs, as uint64 arrays, run by run, repetition by repetition."""
    seg_src, seg_dst, seg_len = segments(runs) if isinstance(runs, Runs) else runs
    if len(seg_len) == 1:
        within = np.arange(int(seg_len[0]), dtype=np.int64)
        return (within + seg_src[0]).view(np.uint64), (within + seg_dst[0]).view(np.uint64)
    # checked: every index < 2^63, so the int64 views and sums are exact
    within = np.arange(int(seg_len.sum()), dtype=np.int64) - np.repeat(np.cumsum(seg_len) - seg_len, seg_len)
    return (np.repeat(seg_src, seg_len) + within).view(np.uint64), (np.repeat(seg_dst, seg_len) + within).view(
        np.uint64)


def find(src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray, *,
         min_pairs: int = MIN_PAIRS) -> Runs | None:
    """The pairs as runs when that is worth sending instead of the lists (long lists, mostly consecutive), else
    None. The lists must be as long as each other."""
    n = len(src_blocks)
    if n < max(1, min_pairs) or n != len(dst_blocks) or n > MAX_PAIRS:
        return None
    try:
        src, dst = _u64(src_blocks), _u64(dst_blocks)
    except (OverflowError, ValueError, TypeError):
        return None  # the plain lists carry the daemon's own refusal
    if max(int(src.max()), int(dst.max())) > MAX_INDEX:
        return None
    s, d = src.view(np.int64), dst.view(np.int64)  # every index <= MAX_INDEX: the views are exact
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.append(starts, n))
    first_s, first_d = s[starts], d[starts]
    best = _strided(first_s, first_d, lengths)
    good_enough = best is not None and len(best.length) * 64 <= n
    if len(starts) > 1 and not good_enough:  # dst-ordered runs may interleave two sources; by source they repeat
        order = np.argsort(first_s, kind="stable")
        by_src = _strided(first_s[order], first_d[order], lengths[order])
        if by_src is not None and (best is None or len(by_src.length) < len(best.length)):
            best = by_src
    if best is None:
        ones = np.ones(len(starts), dtype=np.uint64)
        best = Runs(first_s.astype(np.uint64), first_d.astype(np.uint64), lengths.astype(np.uint64), ones, ones * 0,
                    ones * 0)
    return best if 3 * len(best.length) < n else None


def _strided(s: np.ndarray, d: np.ndarray, lengths: np.ndarray) -> Runs | None:
    """Consecutive runs of one length at one (src, dst) step, grouped greedily; None when there are too many groups
    to be worth it."""
    n = len(s)
    if n < 3:
        return None
    ds, dd = np.diff(s), np.diff(d)
    ok = (lengths[1:] == lengths[:-1]) & (ds >= 0) & (dd >= 0)  # wire strides are unsigned
    # links i and i-1 belong to one segment when both are ok and step alike
    same = ok[1:] & ok[:-1] & (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
    seg_a = np.flatnonzero(np.concatenate(([True], ~same)))
    if len(seg_a) > _MAX_STRIDE_GROUPS:
        return None
    seg_b = np.append(seg_a[1:], len(ok))  # links [a, b) of each segment: runs a..b
    # Greedy, left to right: a segment of ok links becomes a group of runs unless the group before took its first
    # run (the run it shares with that group); then it starts one run later, and a segment of one link is left
    # with nothing. Whether a one-link segment is a group so alternates along a chain of them, from the last
    # longer (always a group) or not-ok (never) segment before the chain.
    seg_ok = ok[seg_a]
    longer = seg_ok & (seg_b - seg_a >= 2)
    single = seg_ok & ~longer
    at = np.arange(len(seg_a))
    before = np.maximum.accumulate(np.where(single, -1, at))  # the last segment up to here that is not `single`
    before_chain = np.where(single, np.concatenate(([-1], before[:-1])), before)
    took = np.where(before_chain >= 0, longer[np.maximum(before_chain, 0)], False)
    grouped = longer | (single & ((at - before_chain - 1 + took) % 2 == 0))
    shifted = np.concatenate(([False], grouped[:-1]))  # the previous segment took this one's first run
    first_run = (seg_a + shifted)[grouped]
    last_run = seg_b[grouped]  # a group runs [first_run, last_run]
    link = first_run
    # before each group, the runs since the previous group (or the start) go one by one; after the last, the rest
    pos = np.concatenate(([0], last_run + 1))[:-1]
    gap = first_run - pos
    per = gap + 1
    total = int(per.sum())
    offsets = np.cumsum(per) - per
    first = np.repeat(pos, per) + (np.arange(total) - np.repeat(offsets, per))
    reps = np.ones(total, dtype=np.int64)
    at_link = np.full(total, -1, dtype=np.int64)
    ends = offsets + gap
    reps[ends] = last_run - first_run + 1
    at_link[ends] = link
    tail = np.arange(int(last_run[-1]) + 1 if len(last_run) else 0, n)
    idx = np.concatenate((first, tail)).astype(np.int64)
    reps = np.concatenate((reps, np.ones(len(tail), dtype=np.int64)))
    at_link = np.concatenate((at_link, np.full(len(tail), -1, dtype=np.int64)))
    has = at_link >= 0
    safe = np.where(has, at_link, 0)
    return Runs(s[idx].astype(np.uint64), d[idx].astype(np.uint64), lengths[idx].astype(np.uint64),
                reps.astype(np.uint64), np.where(has, ds[safe], 0).astype(np.uint64),
                np.where(has, dd[safe], 0).astype(np.uint64))
