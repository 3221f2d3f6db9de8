"""Validation rules of block transfers (LLM-DataDist V2 semantics) and the transfer plan: arrays of byte runs.

A plan never holds per-block Python objects: block lists become numpy arrays, contiguous (src, dst) block pairs are
merged into runs, and runs are crossed with the selected tensor pairs into flat arrays of byte ranges. A run may be
strided (a block-size remap's dimension-major K: the same short run repeated at a fixed step): it then stays one
entry, from the wire's `BlockRuns` down to the copy (strided.py checks and plans those).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker import blockruns
from kvbroker.types import CacheDesc
from kvbrokerd.errors import param_invalid

DEFAULT_TENSOR_NUM_PER_LAYER = 2
ALL_LAYERS = (-1, -1)
MAX_BLOCKS_PER_REQUEST = 1 << 20

Run = tuple[int, int, int, int, int, int]
"""(run index, src tensor, src offset, dst tensor, dst offset, length), as plain ints for copy loops; a piece of a
split run keeps its run's index."""


@dataclass(frozen=True, slots=True)
class LayerSelection:
    src_layer_range: tuple[int, int] = ALL_LAYERS
    dst_layer_range: tuple[int, int] = ALL_LAYERS
    tensor_num_per_layer: int = DEFAULT_TENSOR_NUM_PER_LAYER


@dataclass(frozen=True)
class Plan:
    """Byte runs: run i copies `length[i]` bytes from (src_tensor[i], src_offset[i]) to (dst_tensor[i],
    dst_offset[i]). Offsets are relative to the start of the tensor."""

    src_tensor: np.ndarray
    src_offset: np.ndarray
    dst_tensor: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    dst_blocks: np.ndarray
    """Destination blocks touched (for failure reports)."""
    block_nbytes: int
    count: np.ndarray | None = None
    """Strided plans only: entry i copies its `length[i]` bytes `count[i]` times, repetition k from src_offset[i] +
    k * src_stride[i] to dst_offset[i] + k * dst_stride[i] (bytes). None: every count is 1 (a plain plan)."""
    src_stride: np.ndarray | None = None
    dst_stride: np.ndarray | None = None
    dst_runs: blockruns.Runs | None = None
    """When set, the destination blocks are these runs' (and `dst_blocks` is empty): a request that came as runs has
    its blocks written out only if a report needs them (2^17 of them cost ~0.5-1.5 ms per pull)."""

    @property
    def strided(self) -> bool:
        return self.count is not None

    def destination_blocks(self) -> np.ndarray:
        """Destination blocks touched (for failure reports)."""
        return self.dst_blocks if self.dst_runs is None else blockruns.expand(self.dst_runs)[1]

    @functools.cached_property
    def num_dst_blocks(self) -> int:
        return len(self.dst_blocks) if self.dst_runs is None else self.dst_runs.num_pairs

    @functools.cached_property
    def num_runs(self) -> int:
        """Entries (a strided entry is one, whatever its count): the length of the arrays."""
        return len(self.length)

    @functools.cached_property
    def num_copies(self) -> int:
        """Byte runs copied, a strided entry's repetitions each counted (what a transfer reports as its runs)."""
        return self.num_runs if self.count is None else int(self.count.sum())

    @functools.cached_property
    def run_bytes(self) -> np.ndarray:
        """Bytes per entry (length x count)."""
        return self.length if self.count is None else self.length * self.count

    @functools.cached_property
    def total_bytes(self) -> int:
        # Asked several times per transfer (limits, inline choice, accounting); the arrays never change.
        return int(self.run_bytes.sum())

    def plain(self) -> Plan:
        """The same copies with every repetition written out as a run of its own (for backends that move plain
        runs only: tcp, nixl, hccl). Itself when not strided."""
        if self.count is None or self.src_stride is None or self.dst_stride is None:
            return self
        rep = self.count.astype(np.int64)
        k = (np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)).astype(np.uint64)
        return Plan(src_tensor=np.repeat(self.src_tensor, rep),
                    src_offset=np.repeat(self.src_offset, rep) + k * np.repeat(self.src_stride, rep),
                    dst_tensor=np.repeat(self.dst_tensor, rep),
                    dst_offset=np.repeat(self.dst_offset, rep) + k * np.repeat(self.dst_stride, rep),
                    length=np.repeat(self.length, rep), dst_blocks=self.dst_blocks, block_nbytes=self.block_nbytes,
                    dst_runs=self.dst_runs)


def block_array(blocks: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """uint64 array of block indices; refuses values that are negative or do not fit 64 bits."""
    if len(blocks) > MAX_BLOCKS_PER_REQUEST:
        param_invalid(f"{name} has {len(blocks)} entries; at most {MAX_BLOCKS_PER_REQUEST}")
    try:
        if isinstance(blocks, np.ndarray):
            return np.asarray(blocks, dtype=np.uint64) if len(blocks) else np.zeros(0, dtype=np.uint64)
        # fromiter: a protobuf repeated field or a list converts several times faster than through np.asarray.
        return np.fromiter(blocks, dtype=np.uint64, count=len(blocks))
    except (OverflowError, ValueError, TypeError):
        param_invalid(f"{name} holds a value that is not a block index in [0, 2^64)")


def check_block_lists(src: np.ndarray, dst: np.ndarray) -> None:
    if len(src) == 0:
        param_invalid("src_blocks is empty")
    if len(src) != len(dst):
        param_invalid(f"src_blocks has {len(src)} entries but dst_blocks has {len(dst)}")


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


def coalesce(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merges consecutive pairs where both src and dst advance by one: (src starts, dst starts, run lengths)."""
    if len(src) == 1:
        return src.copy(), dst.copy(), np.ones(1, dtype=np.uint64)
    # Differences in int64 wrap for indices >= 2^63; those were refused by the bounds check before we get here.
    step_ok = (np.diff(src.astype(np.int64)) == 1) & (np.diff(dst.astype(np.int64)) == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~step_ok)))
    lengths = np.diff(np.append(starts, len(src))).astype(np.uint64)
    return src[starts], dst[starts], lengths


def _has_duplicates(blocks: np.ndarray, num_blocks: int) -> bool:
    """Blocks must be < num_blocks."""
    if len(blocks) < 64:  # a sort costs more than a set for the common short lists
        return len(set(blocks.tolist())) != len(blocks)
    if num_blocks <= 8 * len(blocks):  # a list covering much of the cache (token units): counting beats sorting
        return bool(np.bincount(blocks.astype(np.int64)).max() > 1)
    ordered = np.sort(blocks)  # not np.unique: it costs ~50x more on 2^20 blocks
    return bool((ordered[1:] == ordered[:-1]).any())


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


def plan_blocks(
    src: CacheDesc, dst: CacheDesc, src_blocks: np.ndarray, dst_blocks: np.ndarray, layers: LayerSelection
) -> Plan:
    """Validates a block transfer between two caches and returns its plan. Raises LLM_PARAM_INVALID."""
    check_block_lists(src_blocks, dst_blocks)
    if int(src_blocks.max()) >= src.num_blocks:
        param_invalid(f"src block {int(src_blocks.max())} is out of range: the source cache has {src.num_blocks} "
                      "blocks")
    if int(dst_blocks.max()) >= dst.num_blocks:
        param_invalid(f"dst block {int(dst_blocks.max())} is out of range: the destination cache has "
                      f"{dst.num_blocks} blocks")
    if _has_duplicates(dst_blocks, dst.num_blocks):
        param_invalid("dst_blocks contains duplicates: two source blocks would land in one destination block")
    if src.block_nbytes != dst.block_nbytes:
        param_invalid(f"bytes per block differ: source {src.block_nbytes}, destination {dst.block_nbytes}")
    run_src, run_dst, run_len = coalesce(src_blocks, dst_blocks)
    return _plan(src, dst, layers, run_src, run_dst, run_len * np.uint64(dst.block_nbytes), dst_blocks,
                 dst.block_nbytes)


MAX_PLAN_SEGMENTS = 4096
"""Pairs that came as at most this many stretches are checked and planned per stretch (sorting more would cost
what the per-block checks cost)."""


def plan_segments(src: CacheDesc, dst: CacheDesc, segments: tuple[np.ndarray, np.ndarray, np.ndarray],
                  dst_blocks: np.ndarray, layers: LayerSelection) -> Plan | None:
    """`plan_blocks` of the pairs of a few stretches (int64 src starts, dst starts, lengths; `dst_blocks` their
    destination blocks): the same checks and messages, per stretch. None when there are too many stretches."""
    seg_src, seg_dst, seg_len = segments
    if not 0 < len(seg_len) <= MAX_PLAN_SEGMENTS:
        return None
    src_max, dst_max = int((seg_src + seg_len - 1).max()), int((seg_dst + seg_len - 1).max())
    if src_max >= src.num_blocks:
        param_invalid(f"src block {src_max} is out of range: the source cache has {src.num_blocks} blocks")
    if dst_max >= dst.num_blocks:
        param_invalid(f"dst block {dst_max} is out of range: the destination cache has {dst.num_blocks} blocks")
    order = np.argsort(seg_dst, kind="stable")
    if bool((seg_dst[order][1:] < (seg_dst + seg_len)[order][:-1]).any()):  # stretches overlap in dst
        param_invalid("dst_blocks contains duplicates: two source blocks would land in one destination block")
    if src.block_nbytes != dst.block_nbytes:
        param_invalid(f"bytes per block differ: source {src.block_nbytes}, destination {dst.block_nbytes}")
    # stretches that continue each other on both sides are one run, as coalesce merges consecutive pairs
    joined = (seg_src[1:] == seg_src[:-1] + seg_len[:-1]) & (seg_dst[1:] == seg_dst[:-1] + seg_len[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    run_len = np.add.reduceat(seg_len, starts).astype(np.uint64)
    return _plan(src, dst, layers, seg_src[starts].astype(np.uint64), seg_dst[starts].astype(np.uint64),
                 run_len * np.uint64(dst.block_nbytes), dst_blocks, dst.block_nbytes)


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


@dataclass(frozen=True)
class Pieces:
    """A plan's runs as arrays, possibly cut into pieces (a piece keeps its run's index in `run`). A strided plan's
    pieces carry its counts and strides; a strided entry is cut between repetitions, never inside one."""

    run: np.ndarray
    src_tensor: np.ndarray
    src_offset: np.ndarray
    dst_tensor: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    count: np.ndarray | None = None
    src_stride: np.ndarray | None = None
    dst_stride: np.ndarray | None = None
    first_repeat: np.ndarray | None = None
    """Strided plans only: the repetition of its run that each piece starts at."""

    @classmethod
    def of(cls, plan: Plan) -> Pieces:
        first = None if plan.count is None else np.zeros(plan.num_runs, dtype=np.uint64)
        return cls(np.arange(plan.num_runs), plan.src_tensor, plan.src_offset, plan.dst_tensor, plan.dst_offset,
                   plan.length, plan.count, plan.src_stride, plan.dst_stride, first)

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes per piece (length x count)."""
        return self.length if self.count is None else self.length * self.count

    def runs(self) -> list[Run]:
        plain = self.plain()
        return list(zip(plain.run.tolist(), plain.src_tensor.tolist(), plain.src_offset.tolist(),
                        plain.dst_tensor.tolist(), plain.dst_offset.tolist(), plain.length.tolist(), strict=True))

    def plain(self) -> Pieces:
        """Every repetition of a strided piece as a piece of its own (same run index, and its repetition in
        `first_repeat`); itself when not strided."""
        if self.count is None or self.src_stride is None or self.dst_stride is None:
            return self
        rep = self.count.astype(np.int64)
        k = (np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)).astype(np.uint64)
        first = np.zeros(len(self), dtype=np.uint64) if self.first_repeat is None else self.first_repeat
        return Pieces(np.repeat(self.run, rep), np.repeat(self.src_tensor, rep),
                      np.repeat(self.src_offset, rep) + k * np.repeat(self.src_stride, rep),
                      np.repeat(self.dst_tensor, rep),
                      np.repeat(self.dst_offset, rep) + k * np.repeat(self.dst_stride, rep),
                      np.repeat(self.length, rep), first_repeat=np.repeat(first, rep) + k)

    def take(self, index: slice) -> Pieces:
        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index]

        return Pieces(self.run[index], self.src_tensor[index], self.src_offset[index], self.dst_tensor[index],
                      self.dst_offset[index], self.length[index], cut(self.count), cut(self.src_stride),
                      cut(self.dst_stride), cut(self.first_repeat))

    def bounded(self, max_bytes: int) -> Pieces:
        """The same pieces, those over `max_bytes` cut into pieces of at most that (a strided one between
        repetitions, keeping at least one repetition a piece): a copy checks its fence between pieces, so that a
        copy that resumes after its deadline (a frozen daemon) writes at most one piece more."""
        nbytes = self.nbytes
        big = np.flatnonzero(nbytes > np.uint64(max_bytes))
        if not len(big):
            return self
        parts: list[Pieces] = []
        start = 0
        for i in big.tolist():
            if start < i:
                parts.append(self.take(slice(start, i)))
            parts.append(self.take(slice(i, i + 1))._cut(max_bytes))
            start = i + 1
        if start < len(self):
            parts.append(self.take(slice(start, None)))
        return Pieces.concatenated(parts)

    def _cut(self, max_bytes: int) -> Pieces:
        """This one piece as consecutive pieces of at most `max_bytes` (whole repetitions, when strided)."""
        length = int(self.length[0])
        repeats = 1 if self.count is None else int(self.count[0])
        if repeats > 1:
            step = max(1, max_bytes // length)
            k = np.arange(0, repeats, step, dtype=np.uint64)
            assert self.src_stride is not None and self.dst_stride is not None and self.first_repeat is not None
            return Pieces(np.repeat(self.run, len(k)), np.repeat(self.src_tensor, len(k)),
                          self.src_offset[0] + k * self.src_stride[0], np.repeat(self.dst_tensor, len(k)),
                          self.dst_offset[0] + k * self.dst_stride[0], np.repeat(self.length, len(k)),
                          np.minimum(np.uint64(step), np.uint64(repeats) - k), np.repeat(self.src_stride, len(k)),
                          np.repeat(self.dst_stride, len(k)), self.first_repeat[0] + k)

        def same(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.repeat(a, len(at))

        at = np.arange(0, length, max_bytes, dtype=np.uint64)
        return Pieces(np.repeat(self.run, len(at)), np.repeat(self.src_tensor, len(at)), self.src_offset[0] + at,
                      np.repeat(self.dst_tensor, len(at)), self.dst_offset[0] + at,
                      np.minimum(np.uint64(max_bytes), np.uint64(length) - at), same(self.count),
                      same(self.src_stride), same(self.dst_stride), same(self.first_repeat))

    @staticmethod
    def concatenated(parts: Sequence[Pieces]) -> Pieces:
        def join(name: str) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            return None if arrays[0] is None else np.concatenate(arrays)

        run, src_tensor, src_offset, dst_tensor, dst_offset, length = (
            np.concatenate([getattr(p, name) for p in parts])
            for name in ("run", "src_tensor", "src_offset", "dst_tensor", "dst_offset", "length"))
        return Pieces(run, src_tensor, src_offset, dst_tensor, dst_offset, length, join("count"), join("src_stride"),
                      join("dst_stride"), join("first_repeat"))

    def split(self, parts: int) -> list[Pieces]:
        """`parts` lists of about equal bytes, in order; a run that straddles a boundary is cut there (a strided
        one at the repetition the boundary falls in)."""
        nbytes = self.nbytes
        ends = np.cumsum(nbytes, dtype=np.uint64)
        total = int(ends[-1])
        cuts = sorted({total * k // parts for k in range(1, parts)} - {0, total})
        # Only the runs at the cuts change: each part is a slice of the arrays (no pass over every run but the
        # cumulative sum; splits of 10^5 small runs used to cost more than their copy).
        out: list[Pieces] = []
        run, skip = 0, 0  # the next part starts `skip` bytes into run `run`
        for cut in cuts:
            at = int(np.searchsorted(ends, np.uint64(cut), side="right"))
            head = cut - (int(ends[at]) - int(nbytes[at]))  # bytes of run `at` before the cut
            if self.count is not None and int(self.count[at]) > 1:
                head -= head % int(self.length[at])  # whole repetitions only
            out.append(self._part(run, skip, at, head))
            run, skip = at, head
        out.append(self._part(run, skip, len(self), 0))
        return [p for p in out if len(p)]

    def _part(self, first: int, skip: int, last: int, head: int) -> Pieces:
        """Runs [first, last) and the first `head` bytes of run `last`, less the first `skip` bytes of `first` (for
        a strided run, whole repetitions: `skip` and `head` are multiples of its length)."""
        index = slice(first, last + 1 if head else last)

        def own(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index].copy()

        part = Pieces(self.run[index], self.src_tensor[index], self.src_offset[index].copy(),
                      self.dst_tensor[index], self.dst_offset[index].copy(), self.length[index].copy(),
                      own(self.count), own(self.src_stride), own(self.dst_stride), own(self.first_repeat))
        if not len(part):
            return part
        if head:
            part._keep_head(len(part) - 1, head)
        if skip:
            part._drop_head(0, skip)
        if not part.nbytes[0]:  # a cut at a run's start leaves nothing of it here
            return part.take(slice(1, None))
        return part

    def _keep_head(self, i: int, nbytes: int) -> None:
        """Piece i keeps its first `nbytes` bytes."""
        if self.count is not None and int(self.count[i]) > 1:
            self.count[i] = nbytes // int(self.length[i])
        else:
            self.length[i] = nbytes

    def _drop_head(self, i: int, nbytes: int) -> None:
        """Piece i loses its first `nbytes` bytes."""
        if self.count is not None and self.src_stride is not None and self.dst_stride is not None \
                and int(self.count[i]) > 1:
            k = nbytes // int(self.length[i])
            self.src_offset[i] += np.uint64(k) * self.src_stride[i]
            self.dst_offset[i] += np.uint64(k) * self.dst_stride[i]
            self.count[i] -= np.uint64(k)
            if self.first_repeat is not None:
                self.first_repeat[i] += np.uint64(k)
            return
        self.src_offset[i] += np.uint64(nbytes)
        self.dst_offset[i] += np.uint64(nbytes)
        self.length[i] -= np.uint64(nbytes)


class Progress:
    """What landed of a plan, recorded by backends as runs (or pieces of runs) complete, from any thread."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._landed: list[tuple[int, int]] = []  # list.append is atomic: no lock needed between copy threads
        self._landed_arrays: list[tuple[np.ndarray, np.ndarray]] = []
        self._repeats: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # strided: (runs, first repetition, bytes)
        self._untold: list[np.ndarray] = []  # runs marked without saying which repetitions (or taken back)
        self.cancelled = False
        self._wakers: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def mark(self, run_index: int, nbytes: int) -> None:
        self._landed.append((run_index, nbytes))

    def mark_runs(self, runs: np.ndarray, nbytes: np.ndarray, first_repeat: np.ndarray | None = None) -> None:
        """`mark` for many runs (or pieces of runs) at once; negative bytes take marks back (bytes that arrived but
        turned out not to be the source's). `first_repeat`: for pieces of a strided plan, the repetition each starts
        at (its bytes then say how many whole repetitions landed), so that a report names exactly the repetitions
        that did not land."""
        self._landed_arrays.append((runs, nbytes))
        if first_repeat is not None and not bool((nbytes < 0).any()):  # pieces of strided runs: which repetitions
            self._repeats.append((runs, first_repeat, nbytes))
        elif self.plan.count is not None:
            self._untold.append(runs)

    @contextlib.contextmanager
    def on_cancel(self, wake: Callable[[], object]) -> Iterator[None]:
        """While inside, `cancel` also calls `wake` (from the cancelling thread): for a backend that blocks where a
        flag is not looked at (tcp shuts its socket down, which wakes the thread waiting on it). Called at once if
        the transfer is already cancelled."""
        with self._lock:
            self._wakers.append(wake)
        try:
            if self.cancelled:
                wake()
            yield
        finally:
            with self._lock:
                self._wakers.remove(wake)

    def cancel(self) -> None:
        """The caller went away: copy loops stop at their next check, blocked waits are woken now."""
        self.cancelled = True
        with self._lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def _per_run(self) -> np.ndarray:
        """Bytes landed per run (bincount, not np.add.at: the latter costs seconds for 2^20 runs, and a failure
        report must be ready before the caller's deadline)."""
        parts = list(self._landed_arrays)
        if self._landed:
            idx, n = zip(*self._landed, strict=True)
            parts.append((np.asarray(idx, dtype=np.int64), np.asarray(n, dtype=np.int64)))
        if not parts:
            return np.zeros(self.plan.num_runs, dtype=np.int64)
        runs = np.concatenate([r for r, _ in parts])  # one bincount: one per mark would cost marks x runs
        nbytes = np.concatenate([n.astype(np.int64) for _, n in parts])
        # float64 sums are exact below 2^53 bytes per run
        return np.bincount(runs, weights=nbytes, minlength=self.plan.num_runs).astype(np.int64)

    @property
    def bytes_moved(self) -> int:
        return int(self._per_run().sum())

    def _landed_repeats(self, incomplete: np.ndarray, rep: np.ndarray) -> np.ndarray:
        """Of the repetitions of the `incomplete` strided runs (`rep` each, written out in order), which landed
        whole: from the marks that say where their pieces start. A run with a mark that does not (or that takes
        bytes back) counts as landed nowhere."""
        landed = np.zeros(int(rep.sum()) + 1, dtype=np.int64)
        if not self._repeats:
            return landed[:-1] > 0
        plan = self.plan
        at = np.full(plan.num_runs, -1, dtype=np.int64)  # where each incomplete run's repetitions start
        at[incomplete] = np.cumsum(rep) - rep
        runs = np.concatenate([r for r, _, _ in self._repeats]).astype(np.int64)
        first = np.concatenate([f for _, f, _ in self._repeats]).astype(np.int64)
        nbytes = np.concatenate([n for _, _, n in self._repeats]).astype(np.int64)
        untold = np.zeros(plan.num_runs, dtype=bool)
        for r in [*self._untold, np.asarray([i for i, _ in self._landed], dtype=np.int64)]:
            untold[np.asarray(r, dtype=np.int64)] = True
        keep = (at[runs] >= 0) & ~untold[runs] & (nbytes > 0)
        runs, first, nbytes = runs[keep], first[keep], nbytes[keep]
        whole = nbytes // plan.length[runs].astype(np.int64)
        np.add.at(landed, at[runs] + first, 1)  # marks of a failed transfer's incomplete runs: few
        np.add.at(landed, at[runs] + first + whole, -1)
        return np.cumsum(landed)[:-1] > 0

    def failed_dst_blocks(self) -> np.ndarray:
        """Destination blocks of which at least one tensor's bytes did not (completely) land (every block of a run
        that did not land whole: a strided run's every repetition)."""
        plan = self.plan
        incomplete = self._per_run() < plan.run_bytes.astype(np.int64)
        if not incomplete.any():
            return np.zeros(0, dtype=np.uint64)
        bpb = np.uint64(plan.block_nbytes)
        offset, length = plan.dst_offset[incomplete], plan.length[incomplete]
        if plan.count is not None and plan.dst_stride is not None:  # a failure only: written out here
            rep = plan.count[incomplete].astype(np.int64)
            k = (np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)).astype(np.uint64)
            offset = np.repeat(offset, rep) + k * np.repeat(plan.dst_stride[incomplete], rep)
            length = np.repeat(length, rep)
            missing = ~self._landed_repeats(incomplete, rep)
            offset, length = offset[missing], length[missing]
        starts = (offset // bpb).astype(np.int64)
        ends = ((offset + length + bpb - np.uint64(1)) // bpb).astype(np.int64)
        if not len(starts):
            return np.zeros(0, dtype=np.uint64)
        # Blocks covered by any incomplete run, as a difference array over [0, last end): linear, no sort.
        size = int(ends.max()) + 1
        cover = np.cumsum(np.bincount(starts, minlength=size) - np.bincount(ends, minlength=size))
        return np.flatnonzero(cover[:-1] > 0).astype(np.uint64)
