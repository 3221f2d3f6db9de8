"""Reads a GPU engine's per-layer KV tensors (the views vLLM hands `register_kv_caches`) and turns them into the
runs the daemon moves: equal-sized, non-overlapping byte ranges of one backing allocation, one per kvbroker tensor,
in which block `b` lies at `start + b * block_bytes`.

Nothing about the attention backend is guessed: vLLM 0.32 builds every layer's view with
`vllm.v1.kv_cache_interface.create_kv_cache_views` from the resolved `KVCacheLayout` (the stride permutation of
`[L, B, H, N, C]`, e.g. LBNHC for FlashAttention/Triton, LBHNC = FlashInfer's HND, block-outermost BL* layouts) and
the `KVCacheTensor` placement, so the views' own shapes and strides say where each block's bytes are. (Older vLLM
gave backends `get_kv_cache_shape` / `get_kv_cache_stride_order` and views such as FlashAttention's
`[2, num_blocks, block_size, kv_heads, head_size]`: `block_dim=1` reads those the same way.)

How: per layer, the dimensions inside the block dimension that are contiguous merge into one run; dimensions
outside it (K/V of the legacy layout, heads of LHBNC) give several runs per block. Runs of different layers that
touch (a block-outermost layout puts every layer's page of a block side by side) merge. Each run must then be dense
(its length equals the block stride), or its blocks interleave with other bytes and cannot be one kvbroker tensor:
that, overlapping layers, and layers with different block strides are refused with the reason, at start-up.
A KV tensor shared by several layers (vLLM's `get_shared_kv_cache_layers`) is the same bytes: counted once.

Works on any torch tensor (CPU ones in the tests); imports neither vLLM nor CUDA.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbroker.integrations.vllm.layout import UnsupportedLayoutError

# A layout that cuts one block into more runs than this is a layout we do not want to move block by block.
MAX_RUNS_PER_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class KvRuns:
    """Where a worker's KV blocks lie in their backing allocation (the storage the views share)."""

    storage_ptr: int
    """Address of the allocation's first byte (the views' shared storage)."""
    storage_bytes: int
    num_blocks: int
    block_bytes: int
    """Bytes of one block in one run; also the distance between blocks (runs are dense)."""
    starts: tuple[int, ...]
    """Per run (one kvbroker tensor each), the offset of its block 0 in the allocation, ascending."""
    layer_runs: Mapping[str, tuple[int, ...]]
    """Per layer name, the runs holding its bytes (a run of a block-outermost layout holds several layers)."""
    device: str
    """The views' torch device ("cuda:0", "cpu")."""

    @property
    def run_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def signature(self) -> str:
        """What a peer's runs must equal for block-by-block copies to mean the same thing (not the block count)."""
        per_layer = sorted({len(r) for r in self.layer_runs.values()})
        return f"{len(self.starts)}x{self.block_bytes}/l{','.join(map(str, per_layer))}"


def _block0_segments(t: Any, block_dim: int) -> tuple[int, list[tuple[int, int]]]:
    """(block stride in bytes, [(offset from the tensor's first byte, length)] of block 0's bytes, coalesced)."""
    es = int(t.element_size())
    shape, strides = tuple(int(s) for s in t.shape), tuple(int(s) * es for s in t.stride())
    if not 0 <= block_dim < len(shape):
        raise UnsupportedLayoutError(f"a KV view of shape {shape} has no block dimension {block_dim}")
    block_stride = strides[block_dim]
    dims = [(n, s) for i, (n, s) in enumerate(zip(shape, strides, strict=True)) if i != block_dim and n > 1]
    if any(s <= 0 for _, s in dims) or (shape[block_dim] > 1 and block_stride <= 0):
        raise UnsupportedLayoutError(f"a KV view of shape {shape} has zero or negative strides {strides}")
    dims.sort(key=lambda d: d[1])
    run = es
    while dims and dims[0][1] == run:  # innermost dimensions that continue each other are one run
        run *= dims.pop(0)[0]
    if math.prod(n for n, _ in dims) > MAX_RUNS_PER_BLOCK:
        raise UnsupportedLayoutError(f"a KV view of shape {shape}, strides {strides} (bytes) cuts a block into more "
                                     f"than {MAX_RUNS_PER_BLOCK} pieces")
    offsets = sorted(sum(i * s for i, (_, s) in zip(idx, dims, strict=True))
                     for idx in itertools.product(*(range(n) for n, _ in dims)))
    return block_stride, _coalesce([(o, run) for o in offsets], f"a KV view of shape {shape}, strides {strides}")


def _coalesce(segments: list[tuple[int, int]], what: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, length in sorted(set(segments)):
        if out and start < out[-1][0] + out[-1][1]:
            raise UnsupportedLayoutError(f"{what}: bytes [{start}, {start + length}) overlap [{out[-1][0]}, "
                                         f"{out[-1][0] + out[-1][1]})")
        if out and start == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def read_runs(kv_caches: Mapping[str, Any], block_dim: int = 0) -> KvRuns:
    """The runs of `kv_caches` (layer name -> that layer's KV view, as vLLM passes them to `register_kv_caches`);
    UnsupportedLayoutError, naming the reason, when they cannot be served block by block without a copy."""
    if not kv_caches:
        raise UnsupportedLayoutError("no KV cache layers")
    views = list(kv_caches.items())
    storages = {int(t.untyped_storage().data_ptr()) for _, t in views}
    devices = {str(t.device) for _, t in views}
    if len(storages) != 1 or len(devices) != 1:
        raise UnsupportedLayoutError(f"the KV layers lie in {len(storages)} allocations on {sorted(devices)}; "
                                     "one backing allocation on one device is supported (one KV cache group)")
    storage_ptr = storages.pop()
    first = views[0][1]
    storage_bytes = int(first.untyped_storage().nbytes())
    num_blocks = int(first.shape[block_dim])
    strides: set[int] = set()
    per_layer: dict[str, list[tuple[int, int]]] = {}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], str], str] = {}
    for name, t in views:
        key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), str(t.dtype))
        if key in seen:  # a layer sharing another's KV tensor: the same bytes, moved once
            per_layer[name] = per_layer[seen[key]]
            continue
        seen[key] = name
        if int(t.shape[block_dim]) != num_blocks:
            raise UnsupportedLayoutError(f"layer {name} has {t.shape[block_dim]} blocks, layer {views[0][0]} "
                                         f"{num_blocks}")
        stride, segments = _block0_segments(t, block_dim)
        strides.add(stride)
        base = int(t.data_ptr()) - storage_ptr
        per_layer[name] = [(base + o, n) for o, n in segments]
    if len(strides) != 1:
        raise UnsupportedLayoutError(f"the KV layers have different block strides {sorted(strides)}")
    block_stride = strides.pop()
    unique = sorted({s for segs in per_layer.values() for s in segs})
    runs = _coalesce(unique, "two KV layers")
    lengths = {n for _, n in runs}
    if len(lengths) != 1:
        raise UnsupportedLayoutError(f"a block's bytes form runs of different lengths {sorted(lengths)}: kvbroker "
                                     "tensors are all one shape")
    block_bytes = lengths.pop()
    if num_blocks > 1 and block_bytes != block_stride:
        raise UnsupportedLayoutError(
            f"a block's run is {block_bytes} bytes but blocks are {block_stride} bytes apart: its bytes interleave "
            f"with other data (a padded or mixed KV layout), so a block cannot be moved as one range per run")
    starts = tuple(s for s, _ in runs)
    extents = [(s, num_blocks * block_bytes) for s in starts]
    _coalesce(extents, "two runs' blocks")  # dense runs of distinct starts can still cross each other
    if starts[0] < 0 or starts[-1] + num_blocks * block_bytes > storage_bytes:
        raise UnsupportedLayoutError("the KV runs reach outside their allocation")
    layer_runs = {name: tuple(sorted({i for i, (s, n) in enumerate(runs) for o, m in segs if s <= o < s + n}))
                  for name, segs in per_layer.items()}
    return KvRuns(storage_ptr=storage_ptr, storage_bytes=storage_bytes, num_blocks=num_blocks,
                  block_bytes=block_bytes, starts=starts, layer_runs=layer_runs, device=devices.pop())


def manager_block_views(kv_caches: Mapping[str, Any], num_blocks: int, block_size: int
                        ) -> tuple[dict[str, Any], int]:
    """vLLM's KV views counted in the scheduler's blocks, and the kernel block size (`block_size` where unsplit).

    Where no attention backend of the group takes the scheduler's block size (a hybrid model's attention block raised
    to the Mamba page, or `--block-size` past FlashInfer's 64), vLLM splits each block into kernel blocks
    (`prepare_kernel_block_sizes`) and hands `register_kv_caches` views of `num_blocks * ratio` kernel blocks, block
    b's being b * ratio ... b * ratio + ratio - 1 of one dense page (`create_kv_cache_views` splits no other page).
    The block ids a pull names are the scheduler's: served in kernel blocks, block b would be another block's part.
    Viewed back in the scheduler's blocks (as vLLM's `group_kernel_blocks` does), id b is the same bytes again."""
    views: dict[str, Any] = {}
    ratios = set()
    for name, t in kv_caches.items():
        kernel_blocks = int(t.shape[0])
        if kernel_blocks % num_blocks:
            raise UnsupportedLayoutError(f"layer {name} has {kernel_blocks} KV blocks, not a multiple of the "
                                         f"scheduler's {num_blocks}")
        ratio = kernel_blocks // num_blocks
        ratios.add(ratio)
        views[name] = t if ratio == 1 else t.unflatten(0, (num_blocks, ratio))
    if len(ratios) != 1 or block_size % max(ratios):
        raise UnsupportedLayoutError(f"blocks of {block_size} tokens are split into kernel blocks of "
                                     f"{sorted(block_size // r for r in ratios)} tokens across the layers")
    return views, block_size // ratios.pop()


def run_tensors(kv_caches: Mapping[str, Any], runs: KvRuns) -> list[Any]:
    """One `[num_blocks, block_bytes]` uint8 tensor per run, over the views' own storage (no copy)."""
    import torch  # the caller's tensors are torch's: it is loaded

    first = next(iter(kv_caches.values()))
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
    return [flat[s:s + runs.run_bytes].view(runs.num_blocks, runs.block_bytes) for s in runs.starts]


def block_ranges(blocks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted block ids as [start, end) ranges of consecutive ids (one copy each)."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(blocks)):
        if out and b == out[-1][1]:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out
