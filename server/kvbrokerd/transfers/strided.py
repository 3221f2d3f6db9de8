"""Block runs repeated at a stride (`BlockRuns` with counts), checked and planned as they came: one plan entry per run
and tensor, never one per repetition.

A block-size remap of vLLM's CPU cache (K dimension-major) names ~10^5 unit pairs as a few hundred runs of a few
units repeated ~128 times at a fixed step; written out they are ~33,000 stretches per layer, and every per-stretch
pass (checks, plan, claims, split, addresses, progress) cost more than the copy. Here every check is per run:
ranges from each run's last index, duplicates from the runs' bounding ranges and their residues modulo the stride
(written out only where runs of different shapes interleave, which no remap does), grant coverage from bounding
ranges. Same refusals and messages as `planner.plan_blocks`.
"""

from __future__ import annotations

import numpy as np

from kvbroker import blockruns
from kvbroker.types import CacheDesc
from kvbrokerd.dataplane.plan import Plan
from kvbrokerd.errors import param_invalid
from kvbrokerd.transfers.planner import LayerSelection, check_compatible, select_tensors

MAX_STRIDED_RUNS = 4096
"""Runs (as on the wire) planned this way; a request of more goes through the per-block path. Bounds every
per-run pass, and the plan to this many entries per tensor."""


class TooLongForTheLoop(Exception):
    """The duplicate check would write out more repetitions than the event loop may spend time on
    (`plan_runs(..., loop_budget=...)`): plan off the loop."""


def worth_it(runs: blockruns.Runs | None) -> bool:
    """Whether a request's runs are planned here: some repeat, and they are few."""
    return runs is not None and 0 < len(runs.length) <= MAX_STRIDED_RUNS and bool((runs.count > 1).any())


def plan_runs(src: CacheDesc, dst: CacheDesc, runs: blockruns.Runs, dst_blocks: np.ndarray | None,
              layers: LayerSelection, loop_budget: int | None = None) -> Plan:
    """`plan_blocks` of checked runs (`worth_it`), without writing their repetitions out: the same checks, in the
    same order, with the same messages. `dst_blocks`: the pairs' destination blocks if written out already (for
    failure reports); None: the plan keeps the runs (`Plan.dst_runs`) instead."""
    s_first, d_first, size, times, s_step, d_step = (
        a.view(np.int64) for a in (runs.src_first, runs.dst_first, runs.length, runs.count, runs.src_stride,
                                   runs.dst_stride))
    # blockruns.check bounded every last index below 2^63: int64 is exact
    src_max = int((s_first + (times - 1) * s_step + size - 1).max())
    dst_max = int((d_first + (times - 1) * d_step + size - 1).max())
    if src_max >= src.num_blocks:
        param_invalid(f"src block {src_max} is out of range: the source cache has {src.num_blocks} blocks")
    if dst_max >= dst.num_blocks:
        param_invalid(f"dst block {dst_max} is out of range: the destination cache has {dst.num_blocks} blocks")
    if dst_overlaps(d_first, size, times, d_step, loop_budget):
        param_invalid("dst_blocks contains duplicates: two source blocks would land in one destination block")
    if src.block_nbytes != dst.block_nbytes:
        param_invalid(f"bytes per block differ: source {src.block_nbytes}, destination {dst.block_nbytes}")
    check_compatible(src, dst)
    s0, d0, tensors = select_tensors(src, dst, layers)
    unit = np.uint64(dst.block_nbytes)
    n = len(size)
    ones = np.ones(n, dtype=np.uint64)
    count = runs.count.copy()
    # a run done once has no stride (the copy then sees one plain run)
    src_stride = np.where(count > 1, runs.src_stride, 0).astype(np.uint64) * unit
    dst_stride = np.where(count > 1, runs.dst_stride, 0).astype(np.uint64) * unit
    as_sent = (runs.src_first * unit, runs.dst_first * unit, runs.length * unit, count, src_stride, dst_stride)
    # In source order: the runs that read the two halves of one source row (a 64 -> 32 remap: every other 64 bytes
    # each) then copy one after the other, while the row is in cache; as they came, ~16 runs apart, the copy took
    # ~1.4x as long (in-process, one thread, 32 MiB: 2.9 against 4.1 ms; large runs 2.8).
    by_src = np.argsort(runs.src_first, kind="stable")
    columns = tuple(c[by_src] for c in as_sent)
    blocks, keep = (_NONE, runs) if dst_blocks is None else (dst_blocks, None)
    if tensors == 1:
        so, do, ln, ct, ss, ds = columns
        return Plan(src_tensor=ones.astype(np.uint32) * np.uint32(s0), src_offset=so,
                    dst_tensor=ones.astype(np.uint32) * np.uint32(d0), dst_offset=do, length=ln, dst_blocks=blocks,
                    block_nbytes=dst.block_nbytes, count=ct, src_stride=ss, dst_stride=ds, dst_runs=keep)
    so, do, ln, ct, ss, ds = (np.tile(c, tensors) for c in columns)
    tensor_idx = np.arange(tensors, dtype=np.uint32)
    return Plan(src_tensor=np.repeat(tensor_idx + s0, n), src_offset=so, dst_tensor=np.repeat(tensor_idx + d0, n),
                dst_offset=do, length=ln, dst_blocks=blocks, block_nbytes=dst.block_nbytes, count=ct,
                src_stride=ss, dst_stride=ds, dst_runs=keep)


_NONE = np.zeros(0, dtype=np.uint64)


def dst_overlaps(first: np.ndarray, size: np.ndarray, times: np.ndarray, step: np.ndarray,
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


def runs_granted(runs: blockruns.Runs, blocks: np.ndarray, units: int) -> bool:
    """Whether a grant of `blocks` (each `units` source blocks) covers every source block of the runs, judged by each
    run's bounding range (False: not provably covered so; the caller then looks pair by pair and names the
    blocks)."""
    if not len(blocks):
        return False
    first = runs.src_first.view(np.int64)
    last = first + (runs.count.view(np.int64) - 1) * runs.src_stride.view(np.int64) + runs.length.view(np.int64) - 1
    owned = np.unique(blocks.astype(np.int64))
    lo, hi = first // units, last // units
    inside = np.searchsorted(owned, hi, side="right") - np.searchsorted(owned, lo, side="left")
    return bool((inside == hi - lo + 1).all())
