"""Validation rules of block transfers (LLM-DataDist V2 semantics) and the transfer plan: arrays of byte runs.

A plan never holds per-block Python objects: a request's pairs (`BlockPairs`, dataplane/pairs.py, which checks them)
become runs of consecutive blocks, and runs are crossed with the selected tensor pairs into flat arrays of byte
ranges. A run may be strided (a block-size remap's dimension-major K: the same short run repeated at a fixed step):
it then stays one entry, from the wire's `BlockRuns` down to the copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker import blockruns
from kvbroker.types import CacheDesc
from kvbrokerd.dataplane.pairs import BlockPairs
from kvbrokerd.dataplane.plan import Plan
from kvbrokerd.errors import param_invalid

DEFAULT_TENSOR_NUM_PER_LAYER = 2
ALL_LAYERS = (-1, -1)
_NO_BLOCKS = np.zeros(0, dtype=np.uint64)



@dataclass(frozen=True, slots=True)
class LayerSelection:
    src_layer_range: tuple[int, int] = ALL_LAYERS
    dst_layer_range: tuple[int, int] = ALL_LAYERS
    tensor_num_per_layer: int = DEFAULT_TENSOR_NUM_PER_LAYER


def _tensor_range(desc: CacheDesc, layer_range: tuple[int, int], per_layer: int, side: str) -> tuple[int, int]:
    """[first, last) tensor indices selected by an inclusive layer range."""
    first, second = layer_range
    if (first, second) == ALL_LAYERS:
        return 0, desc.num_tensors
    if first < 0 or second < 0:
        param_invalid(f"{side}_layer_range ({first}, {second}): use (-1, -1) for all layers or two indices >= 0")
    if first > second:
        param_invalid(f"{side}_layer_range ({first}, {second}): first must be <= second")
    if desc.num_tensors % per_layer != 0:
        param_invalid(f"tensor_num_per_layer={per_layer} does not divide the {side} cache's "
                      f"num_tensors={desc.num_tensors}")
    max_layer = desc.num_tensors // per_layer - 1
    if second > max_layer:
        param_invalid(f"{side}_layer_range ({first}, {second}) exceeds the last layer {max_layer} "
                      f"({desc.num_tensors} tensors / {per_layer} per layer)")
    return first * per_layer, (second + 1) * per_layer


def select_tensors(src: CacheDesc, dst: CacheDesc, layers: LayerSelection) -> tuple[int, int, int]:
    """(first src tensor, first dst tensor, count) after every layer-range rule."""
    per_layer = layers.tensor_num_per_layer
    ranged = layers.src_layer_range != ALL_LAYERS or layers.dst_layer_range != ALL_LAYERS
    if ranged and not 1 <= per_layer <= min(src.num_tensors, dst.num_tensors):
        param_invalid(f"tensor_num_per_layer={per_layer} must be in [1, num_tensors]")
    s0, s1 = _tensor_range(src, layers.src_layer_range, per_layer, "src")
    d0, d1 = _tensor_range(dst, layers.dst_layer_range, per_layer, "dst")
    if s1 - s0 != d1 - d0:
        if ranged:
            param_invalid(f"layer ranges select {s1 - s0} source tensors but {d1 - d0} destination tensors "
                          f"(src {layers.src_layer_range}, dst {layers.dst_layer_range}); spans must be equal")
        param_invalid(f"source cache has {src.num_tensors} tensors, destination has {dst.num_tensors}")
    return s0, d0, s1 - s0


def check_compatible(src: CacheDesc, dst: CacheDesc) -> None:
    """Caches that both carry a layout tag must carry the same one (model, dtype, block layout, tp rank...)."""
    if src.layout_tag and dst.layout_tag and src.layout_tag != dst.layout_tag:
        param_invalid(f"incompatible caches: source layout {src.layout_tag!r}, destination layout {dst.layout_tag!r}")


def _plan(src: CacheDesc, dst: CacheDesc, layers: LayerSelection, run_src: np.ndarray, run_dst: np.ndarray,
          run_len: np.ndarray, dst_blocks: np.ndarray, unit: int) -> Plan:
    """Crosses runs (in units of `unit` bytes: a block or a batch row) with the selected tensor pairs."""
    check_compatible(src, dst)
    s0, d0, count = select_tensors(src, dst, layers)
    n_runs = len(run_len)
    stride = np.uint64(unit)
    if count == 1:  # one tensor: the runs are the plan (no crossing; saves a third of a small pull's planning)
        return Plan(src_tensor=np.full(n_runs, s0, dtype=np.uint32), src_offset=run_src * stride,
                    dst_tensor=np.full(n_runs, d0, dtype=np.uint32), dst_offset=run_dst * stride, length=run_len,
                    dst_blocks=dst_blocks, block_nbytes=unit)
    tensor_idx = np.arange(count, dtype=np.uint32)
    return Plan(
        src_tensor=np.repeat(tensor_idx + s0, n_runs),
        src_offset=np.tile(run_src * stride, count),
        dst_tensor=np.repeat(tensor_idx + d0, n_runs),
        dst_offset=np.tile(run_dst * stride, count),
        length=np.tile(run_len, count),
        dst_blocks=dst_blocks,
        block_nbytes=unit,
    )


def plan_pairs(src: CacheDesc, dst: CacheDesc, pairs: BlockPairs, layers: LayerSelection,
               loop_budget: int | None = None) -> Plan:
    """Validates a block transfer between two caches and returns its plan. Raises LLM_PARAM_INVALID, or
    TooLongForTheLoop when checking would write out more than `loop_budget` repetitions (then plan off the loop).

    Runs that repeat stay one entry per run and tensor (`_strided_plan`); a few stretches are planned per stretch;
    anything else pair by pair, consecutive pairs merged."""
    runs = pairs.checked_runs(src.num_blocks, dst.num_blocks, loop_budget)
    if src.block_nbytes != dst.block_nbytes:
        param_invalid(f"bytes per block differ: source {src.block_nbytes}, destination {dst.block_nbytes}")
    if isinstance(runs, blockruns.Runs):
        return _strided_plan(src, dst, pairs, runs, layers)
    run_src, run_dst, run_len = runs
    # runs keep their destination blocks unwritten (a report writes them out if it needs them)
    came_as_runs = pairs.runs is not None
    plan = _plan(src, dst, layers, run_src, run_dst, run_len * np.uint64(dst.block_nbytes),
                 _NO_BLOCKS if came_as_runs else pairs.dst, dst.block_nbytes)
    return dataclasses.replace(plan, dst_pairs=pairs) if came_as_runs else plan


def plan_blocks(src: CacheDesc, dst: CacheDesc, src_blocks: Sequence[int] | np.ndarray,
                dst_blocks: Sequence[int] | np.ndarray, layers: LayerSelection) -> Plan:
    """`plan_pairs` of two plain lists."""
    return plan_pairs(src, dst, BlockPairs.listed(src_blocks, dst_blocks), layers)


def _strided_plan(src: CacheDesc, dst: CacheDesc, pairs: BlockPairs, runs: blockruns.Runs,
                  layers: LayerSelection) -> Plan:
    """Checked runs that repeat, planned as they came: one plan entry per run and tensor, never one per repetition
    (a block-size remap of vLLM's CPU cache names ~10^5 unit pairs as a few hundred runs repeated ~128 times; written
    out, every per-stretch pass cost more than the copy)."""
    check_compatible(src, dst)
    s0, d0, tensors = select_tensors(src, dst, layers)
    unit = np.uint64(dst.block_nbytes)
    n = len(runs.length)
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
    if tensors == 1:
        so, do, ln, ct, ss, ds = columns
        return Plan(src_tensor=ones.astype(np.uint32) * np.uint32(s0), src_offset=so,
                    dst_tensor=ones.astype(np.uint32) * np.uint32(d0), dst_offset=do, length=ln,
                    dst_blocks=_NO_BLOCKS, block_nbytes=dst.block_nbytes, count=ct, src_stride=ss, dst_stride=ds,
                    dst_pairs=pairs)
    so, do, ln, ct, ss, ds = (np.tile(c, tensors) for c in columns)
    tensor_idx = np.arange(tensors, dtype=np.uint32)
    return Plan(src_tensor=np.repeat(tensor_idx + s0, n), src_offset=so, dst_tensor=np.repeat(tensor_idx + d0, n),
                dst_offset=do, length=ln, dst_blocks=_NO_BLOCKS, block_nbytes=dst.block_nbytes, count=ct,
                src_stride=ss, dst_stride=ds, dst_pairs=pairs)


def plan_cache(src: CacheDesc, dst: CacheDesc, src_batch: int, dst_batch: int, size: int,
               layers: LayerSelection) -> Plan:
    """A whole-cache / per-batch transfer (PullKvCache, PushKvCache): `size` bytes per tensor (-1 = the whole batch
    row) from the start of batch row `src_batch` into batch row `dst_batch`. The batch dimension is shape[0]."""
    if not 0 <= src_batch < src.num_blocks:
        param_invalid(f"source batch index {src_batch} is out of range: the source cache has {src.num_blocks} rows")
    if not 0 <= dst_batch < dst.num_blocks:
        param_invalid(f"destination batch index {dst_batch} is out of range: the destination cache has "
                      f"{dst.num_blocks} rows")
    if size == -1:
        if src.block_nbytes != dst.block_nbytes:
            param_invalid(f"size=-1 needs equal batch rows: source {src.block_nbytes} bytes, destination "
                          f"{dst.block_nbytes}; pass an explicit size")
        size = dst.block_nbytes
    elif not 0 < size <= min(src.block_nbytes, dst.block_nbytes):
        param_invalid(f"size must be -1 or in [1, {min(src.block_nbytes, dst.block_nbytes)}] bytes per tensor, "
                      f"got {size}")
    one = np.ones(1, dtype=np.uint64)
    src_row = np.asarray([src_batch], dtype=np.uint64)
    dst_row = np.asarray([dst_batch], dtype=np.uint64)
    plan = _plan(src, dst, layers, src_row, dst_row, one * np.uint64(size), dst_row, dst.block_nbytes)
    # Rows of different strides: offsets follow each side's own stride.
    return dataclasses.replace(plan, src_offset=np.full_like(plan.src_offset, src_batch * src.block_nbytes))


def concatenated(plans: Sequence[Plan]) -> Plan:
    """The plans' runs one after the other (strided ones written out), and their destination blocks."""
    plain = [p.plain() for p in plans]

    def column(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in plain])

    return Plan(src_tensor=column("src_tensor"), src_offset=column("src_offset"), dst_tensor=column("dst_tensor"),
                dst_offset=column("dst_offset"), length=column("length"),
                dst_blocks=np.concatenate([p.destination_blocks() for p in plans]),
                block_nbytes=plans[0].block_nbytes)


def side_by_side(plans: Sequence[Plan], first_tensors: Sequence[int]) -> Plan:
    """Plans from several source caches into one destination as one plan over their tensors side by side (plan i's
    source tensors shifted by `first_tensors[i]`; `PeerChannel.pull_several`). Strided plans stay strided; their
    destination blocks stay unwritten when every plan's are."""
    if not all(p.strided for p in plans):
        plans = [p.plain() for p in plans]

    def column(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in plans])

    src_tensor = np.concatenate([p.src_tensor + np.uint32(first) for p, first in zip(plans, first_tensors,
                                                                                    strict=True)])
    strided = plans[0].strided
    pairs = [p.dst_pairs for p in plans]
    unwritten = all(q is not None for q in pairs)
    return Plan(src_tensor=src_tensor, src_offset=column("src_offset"), dst_tensor=column("dst_tensor"),
                dst_offset=column("dst_offset"), length=column("length"),
                dst_blocks=_NO_BLOCKS if unwritten else np.concatenate([p.destination_blocks() for p in plans]),
                block_nbytes=plans[0].block_nbytes, count=column("count") if strided else None,
                src_stride=column("src_stride") if strided else None,
                dst_stride=column("dst_stride") if strided else None,
                dst_pairs=BlockPairs.joined([q for q in pairs if q is not None]) if unwritten else None)


def layer_plans(plan: Plan, tensor_num_per_layer: int) -> list[tuple[int, Plan]]:
    """The plan split by destination layer (for layer-wise progress): [(dst layer, sub-plan), ...] in layer order."""
    layer = plan.dst_tensor // np.uint32(tensor_num_per_layer)
    out = []
    for value in np.unique(layer).tolist():
        mask = layer == value
        strides = {} if plan.count is None or plan.src_stride is None or plan.dst_stride is None else {
            "count": plan.count[mask], "src_stride": plan.src_stride[mask], "dst_stride": plan.dst_stride[mask]}
        out.append((int(value), dataclasses.replace(
            plan, src_tensor=plan.src_tensor[mask], src_offset=plan.src_offset[mask],
            dst_tensor=plan.dst_tensor[mask], dst_offset=plan.dst_offset[mask], length=plan.length[mask],
            **strides)))
    return out
