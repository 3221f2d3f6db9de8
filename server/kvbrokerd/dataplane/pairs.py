"""A request's block pairs: one value, built once where the request arrives, that every later stage asks.

Pairs come as two plain lists (src_blocks, dst_blocks) or as runs (`BlockRuns` on the wire: a few numbers for ~10^5
pairs). Either way they become a `BlockPairs`, checked for what needs no cache (indices that fit, lists of one
length, runs bounded), which then answers: how many pairs, their bounds, whether a destination block repeats,
whether a grant covers their sources, their consecutive stretches, and, only when a stage must have them, the pairs
written out (computed once, kept). A plain list is runs of length one; runs are never written out unless asked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbroker import blockruns
from kvbrokerd.errors import param_invalid

MAX_BLOCKS_PER_REQUEST = 1 << 20
MAX_STRIDED_RUNS = 4096
"""Runs (as on the wire) that are checked and planned per run; more go through the per-block path. Bounds every
per-run pass, and a plan to this many entries per tensor."""
MAX_STRETCHES = 4096
"""Pairs that came as at most this many stretches are checked per stretch (sorting more would cost what the
per-block checks cost)."""

_NO_BLOCKS = np.zeros(0, dtype=np.uint64)


class TooLongForTheLoop(Exception):
    """The duplicate check would write out more repetitions than the event loop may spend time on
    (`loop_budget`): check off the loop."""


def block_array(blocks: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """uint64 array of block indices; refuses values that are negative or do not fit 64 bits."""
    if len(blocks) > MAX_BLOCKS_PER_REQUEST:
        param_invalid(f"{name} has {len(blocks)} entries; at most {MAX_BLOCKS_PER_REQUEST}")
    try:
        if isinstance(blocks, np.ndarray):
            return np.asarray(blocks, dtype=np.uint64) if len(blocks) else _NO_BLOCKS
        # fromiter: a protobuf repeated field or a list converts several times faster than through np.asarray.
        return np.fromiter(blocks, dtype=np.uint64, count=len(blocks))
    except (OverflowError, ValueError, TypeError):
        param_invalid(f"{name} holds a value that is not a block index in [0, 2^64)")


class BlockPairs:
    """(src, dst) block pairs, checked for what needs no cache. Build with `listed`, `of_runs` or `unsourced`."""

    __slots__ = ("_dst", "_runs", "_segments", "_src")

    def __init__(self, runs: blockruns.Runs | None, src: np.ndarray | None, dst: np.ndarray) -> None:
        self._runs = runs
        self._src = src
        self._dst = dst
        self._segments: blockruns.Segments | None = None

    # -- building ----------------------------------------------------------------------------------------------------
    @classmethod
    def listed(cls, src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray) -> BlockPairs:
        """Two plain lists (the pair i is src_blocks[i], dst_blocks[i]); LLM_PARAM_INVALID unless they are."""
        src = block_array(src_blocks, "src_blocks")
        dst = block_array(dst_blocks, "dst_blocks")
        if not len(src):
            param_invalid("src_blocks is empty")
        if len(src) != len(dst):
            param_invalid(f"src_blocks has {len(src)} entries but dst_blocks has {len(dst)}")
        return cls(None, src, dst)

    @classmethod
    def of_runs(cls, runs: blockruns.Runs) -> BlockPairs:
        """Runs bounded by `blockruns.check`."""
        return cls(runs, None, _NO_BLOCKS)

    @classmethod
    def unsourced(cls, dst_blocks: Sequence[int] | np.ndarray) -> BlockPairs:
        """Destination blocks only: a pull of a grant's blocks in order, whose sources the grant names
        (`with_sources`)."""
        dst = block_array(dst_blocks, "dst_blocks")
        if not len(dst):
            param_invalid("dst_blocks is empty")
        return cls(None, None, dst)

    def with_sources(self, src: np.ndarray) -> BlockPairs:
        assert self._src is None and self._runs is None and len(src) == len(self._dst)
        return BlockPairs(None, src, self._dst)

    @staticmethod
    def joined(parts: Sequence[BlockPairs]) -> BlockPairs:
        """Several requests' pairs as one's, in order (as runs when all came as runs)."""
        if len(parts) == 1:
            return parts[0]
        runs = [p._runs for p in parts if p._runs is not None]
        if len(runs) == len(parts):
            return BlockPairs.of_runs(blockruns.concatenated(runs))
        return BlockPairs(None, np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]))

    # -- what they are ---------------------------------------------------------------------------------------------
    @property
    def sourced(self) -> bool:
        return self._runs is not None or self._src is not None

    @property
    def runs(self) -> blockruns.Runs | None:
        """The runs, when the pairs came as runs."""
        return self._runs

    @property
    def num_pairs(self) -> int:
        return self._runs.num_pairs if self._runs is not None else len(self._dst)

    @property
    def strided(self) -> bool:
        """Runs of which some repeat, and few: checked and planned per run (one plan entry per run and tensor)."""
        r = self._runs
        return r is not None and 0 < len(r.length) <= MAX_STRIDED_RUNS and bool((r.count > 1).any())

    def stretches(self) -> blockruns.Segments | None:
        """(src starts, dst starts, lengths) of consecutive stretches when the pairs came as at most
        `MAX_STRETCHES` of them (runs); else None: look pair by pair."""
        if self._runs is None or self.strided:
            return None
        if self._segments is None:
            self._segments = blockruns.segments(self._runs)
        return self._segments if len(self._segments[2]) <= MAX_STRETCHES else None

    @property
    def src(self) -> np.ndarray:
        """Source blocks, pair by pair (written out from runs on first use)."""
        if self._src is None:
            self._write_out()
        assert self._src is not None
        return self._src

    @property
    def dst(self) -> np.ndarray:
        """Destination blocks, pair by pair (written out from runs on first use)."""
        if self._runs is not None and not len(self._dst):
            self._write_out()
        return self._dst

    def _write_out(self) -> None:
        assert self._runs is not None, "unsourced pairs have no sources until with_sources"
        if self._segments is None and not self.strided:
            self._segments = blockruns.segments(self._runs)
        self._src, self._dst = blockruns.expand(self._segments if self._segments is not None else self._runs)

    # -- checks against caches -------------------------------------------------------------------------------------
    def bounds(self) -> tuple[int, int]:
        """The largest source and destination block named."""
        r = self._runs
        if r is None:
            return int(self.src.max()), int(self._dst.max())
        first_s, first_d, size, times, s_step, d_step = (
            a.view(np.int64) for a in (r.src_first, r.dst_first, r.length, r.count, r.src_stride, r.dst_stride))
        # blockruns.check bounded every last index below 2^63: int64 is exact
        return (int((first_s + (times - 1) * s_step + size - 1).max()),
                int((first_d + (times - 1) * d_step + size - 1).max()))

    def checked_runs(self, src_num_blocks: int, dst_num_blocks: int, loop_budget: int | None = None
                     ) -> blockruns.Runs | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pairs checked against two caches' sizes (a block out of range, a destination block named twice:
        LLM_PARAM_INVALID, in that order), as what a plan is made of: the runs themselves when they are `strided`,
        else consecutive runs (uint64 src starts, dst starts, lengths in blocks). TooLongForTheLoop when the
        duplicate check would write out more than `loop_budget` repetitions."""
        src_max, dst_max = self.bounds()
        if src_max >= src_num_blocks:
            param_invalid(f"src block {src_max} is out of range: the source cache has {src_num_blocks} blocks")
        if dst_max >= dst_num_blocks:
            param_invalid(f"dst block {dst_max} is out of range: the destination cache has {dst_num_blocks} blocks")
        duplicates = "dst_blocks contains duplicates: two source blocks would land in one destination block"
        if self.strided:
            r = self._runs
            assert r is not None
            if _runs_overlap(r.dst_first.view(np.int64), r.length.view(np.int64), r.count.view(np.int64),
                             r.dst_stride.view(np.int64), loop_budget):
                param_invalid(duplicates)
            return r
        stretches = self.stretches()
        if stretches is None:
            if _has_duplicates(self.dst, dst_num_blocks):
                param_invalid(duplicates)
            return coalesce(self.src, self.dst)
        seg_src, seg_dst, seg_len = stretches
        order = np.argsort(seg_dst, kind="stable")
        if bool((seg_dst[order][1:] < (seg_dst + seg_len)[order][:-1]).any()):
            param_invalid(duplicates)
        # stretches that continue each other on both sides are one run, as `coalesce` merges consecutive pairs
        joined = (seg_src[1:] == seg_src[:-1] + seg_len[:-1]) & (seg_dst[1:] == seg_dst[:-1] + seg_len[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        return (seg_src[starts].astype(np.uint64), seg_dst[starts].astype(np.uint64),
                np.add.reduceat(seg_len, starts).astype(np.uint64))

    def checks_quickly(self, max_pairs: int) -> bool:
        """Whether checking and planning these pairs takes little time whatever their number: strided runs, a few
        stretches, or at most `max_pairs` pairs."""
        return self.num_pairs <= max_pairs or self.strided or self.stretches() is not None

    def outside_grant(self, blocks: np.ndarray, units: int) -> np.ndarray:
        """The source blocks of these pairs that a grant of `blocks` (each `units` source blocks) does not cover:
        judged per run or stretch where the pairs came so, and written out only to name the blocks outside."""
        if len(blocks) and self._runs is not None:
            r = self._runs
            first = r.src_first.view(np.int64)
            last = first + (r.count.view(np.int64) - 1) * r.src_stride.view(np.int64) + r.length.view(np.int64) - 1
            if len(first) <= max(MAX_STRIDED_RUNS, MAX_STRETCHES) and _ranges_granted(first, last, blocks, units):
                return _NO_BLOCKS
        owner = self.src // np.uint64(units)
        top = int(blocks.max()) + 1 if len(blocks) else 0
        if top > 4 * len(owner) + (1 << 16):  # a table would cost more than the list: search instead
            return self.src[~np.isin(owner, blocks)]
        granted = np.zeros(top + 1, dtype=bool)  # slot `top`: every owner past the grant's last block
        granted[blocks] = True
        return self.src[~granted[np.minimum(owner, np.uint64(top))]]


def coalesce(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merges consecutive pairs where both src and dst advance by one: (src starts, dst starts, run lengths)."""
    if len(src) == 1:
        return src.copy(), dst.copy(), np.ones(1, dtype=np.uint64)
    # Differences in int64 wrap for indices >= 2^63; those were refused by the bounds check before we get here.
    step_ok = (np.diff(src.astype(np.int64)) == 1) & (np.diff(dst.astype(np.int64)) == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~step_ok)))
    lengths = np.diff(np.append(starts, len(src))).astype(np.uint64)
    return src[starts], dst[starts], lengths


def _ranges_granted(first: np.ndarray, last: np.ndarray, blocks: np.ndarray, units: int) -> bool:
    """Whether the granted blocks cover every block of each [first, last] range (int64)."""
    owned = np.unique(blocks.astype(np.int64))
    lo, hi = first // units, last // units
    inside = np.searchsorted(owned, hi, side="right") - np.searchsorted(owned, lo, side="left")
    return bool((inside == hi - lo + 1).all())


def _has_duplicates(blocks: np.ndarray, num_blocks: int) -> bool:
    """Blocks must be < num_blocks."""
    if len(blocks) < 64:  # a sort costs more than a set for the common short lists
        return len(set(blocks.tolist())) != len(blocks)
    if num_blocks <= 8 * len(blocks):  # a list covering much of the cache (token units): counting beats sorting
        return bool(np.bincount(blocks.astype(np.int64)).max() > 1)
    ordered = np.sort(blocks)  # not np.unique: it costs ~50x more on 2^20 blocks
    return bool((ordered[1:] == ordered[:-1]).any())


def _runs_overlap(first: np.ndarray, size: np.ndarray, times: np.ndarray, step: np.ndarray,
                  loop_budget: int | None = None) -> bool:
    """Whether two pairs of these runs (int64: first, length, count, stride) name one block: exact.

    A run meets itself when it repeats at a step shorter than its length. Two runs can only meet where their bounding
    ranges overlap; runs that overlap so and share one step (no shorter than their lengths) meet only where their
    residues modulo the step do (a run covers the residues [first, first + length) mod step, every repetition alike).
    Anything else (interleaved runs of different steps) is written out and counted."""
    repeats = times > 1
    if bool((repeats & (step < size)).any()):
        return True
    lo = first
    hi = first + (times - 1) * step + size  # past the last block
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    meets = np.flatnonzero(lo[1:] < reach[:-1]) + 1  # starts inside an earlier run's bounding range
    if not len(meets):
        return False
    # clusters of runs whose bounding ranges chain into each other
    new_cluster = np.ones(len(lo), dtype=bool)
    new_cluster[meets] = False
    cluster = np.cumsum(new_cluster) - 1
    in_cluster = np.bincount(cluster)[cluster] > 1
    members = order[in_cluster]
    c = cluster[in_cluster]
    m_step, m_size, m_times, m_first = step[members], size[members], times[members], first[members]
    starts = np.flatnonzero(np.concatenate(([True], c[1:] != c[:-1])))
    same_step = (m_step == np.repeat(m_step[starts], np.diff(np.append(starts, len(c))))) & (m_times > 1)
    if not bool(same_step.all()):
        return _written_out_overlaps(m_first, m_size, m_times, m_step, loop_budget)
    residue = m_first % m_step
    by = np.lexsort((residue, c))
    c, residue, m_size, m_step = c[by], residue[by], m_size[by], m_step[by]
    same = c[1:] == c[:-1]
    shared = bool((same & (residue[1:] < residue[:-1] + m_size[:-1])).any())
    # the last residue range of a cluster may wrap round onto its first
    first_of = np.flatnonzero(np.concatenate(([True], ~same)))
    last_of = np.append(first_of[1:] - 1, len(c) - 1)
    wraps = (first_of != last_of) & (residue[last_of] + m_size[last_of] > residue[first_of] + m_step[first_of])
    if shared or bool(wraps.any()):  # sharing residues, they may still miss each other: count
        return _written_out_overlaps(first[members], size[members], times[members], step[members], loop_budget)
    return False


def _written_out_overlaps(first: np.ndarray, size: np.ndarray, times: np.ndarray, step: np.ndarray,
                          loop_budget: int | None = None) -> bool:
    """Exact, per stretch: the runs' repetitions written out (bounded: at most the request's pairs) and sorted.
    TooLongForTheLoop when they are more than `loop_budget`."""
    if loop_budget is not None and int(times.sum()) > loop_budget:
        raise TooLongForTheLoop
    k = np.arange(int(times.sum()), dtype=np.int64) - np.repeat(np.cumsum(times) - times, times)
    lo = np.repeat(first, times) + k * np.repeat(step, times)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], (lo + np.repeat(size, times))[order]
    return bool((lo[1:] < np.maximum.accumulate(hi)[:-1]).any())
