"""GPU engines' KV as CPU tensors, for the remap tests: per-layer `[B, H, N, C]` views (whoever lays them out: vLLM's
own allocation in tests/vllm, or orders written out by hand in tests/unit), a value per (layer, model head, token,
element) written through the views, the layout and geometry the connector reads from them, and the unit copies a
plan names done the way the daemon does them (every run, the same unit pairs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbroker.blockruns import expand
from kvbroker.integrations.vllm.cuda_layout import KvRuns, read_runs, run_tensors
from kvbroker.integrations.vllm.cuda_remap import Geometry, NoRemap, read_geometry
from kvbroker.integrations.vllm.gpu import physical_tag
from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_MLA, KvLayout
from kvbroker.integrations.vllm.remap import UnitPull, rank_heads

# (layout name, blocks, heads per rank, tokens per block, mla) -> per-layer [B, H, N, C] views of one allocation
ViewMaker = Callable[[str, int, int, int, bool], dict[str, torch.Tensor]]

HEAD = 8
"""Elements of one head's K (and of its V): C = 2 * HEAD, or the latent vector of MLA."""


@dataclass
class Rank:
    views: dict[str, torch.Tensor]
    runs: KvRuns
    layout: KvLayout
    geometry: Geometry | None

    def unit_tensors(self) -> list[np.ndarray]:
        """The daemon's unit cache over the runs: `[num_blocks * units_per_block, unit_bytes]` per run."""
        assert self.geometry is not None
        return [t.numpy().reshape(-1, self.geometry.unit_bytes) for t in run_tensors(self.views, self.runs)]


def engine_rank(make: ViewMaker, order: str, tp: int, block: int, model_heads: int, mla: bool = False,
                blocks: int = 12) -> Rank:
    heads = 1 if mla else max(1, model_heads // tp)
    views = make(order, blocks, heads, block, mla)
    runs = read_runs(views)
    first = next(iter(views.values()))
    layout = KvLayout(num_layers=len(views), num_blocks=runs.num_blocks, block_size=block, num_kv_heads=heads,
                      head_size=HEAD, dtype="float32",
                      page_bytes=heads * block * int(first.shape[-1]) * first.element_size(), model_id="m",
                      tp_size=tp, total_kv_heads=1 if mla else model_heads, memory=MEMORY_MLA if mla else MEMORY_CPU,
                      physical=physical_tag(order, runs))
    try:
        geometry: Geometry | None = read_geometry(views, runs, block)
    except NoRemap:
        geometry = None
    if geometry is not None:
        layout = dataclasses.replace(layout, unit_geometry=geometry.text)
    return Rank(views, runs, layout, geometry)


def value(layer: int, head: int, tokens: np.ndarray, content: int) -> torch.Tensor:
    """A distinct int32 per (layer, model head, token, element)."""
    out = layer * 10_000_000 + head * 1_000_000 + tokens[:, None] * 1000 + np.arange(content)[None, :]
    return torch.from_numpy(out.astype(np.int32))


def fill(rank: Rank, rank_index: int, blocks: Sequence[int], num_tokens: int) -> None:
    tokens = np.arange(num_tokens)
    where = torch.from_numpy(np.asarray(blocks)[tokens // rank.layout.block_size])
    at = torch.from_numpy(tokens % rank.layout.block_size)
    lay = rank.layout
    for layer, t in enumerate(rank.views.values()):
        for local, head in enumerate(rank_heads(rank_index, lay.tp_size, lay.model_kv_heads)):
            t[where, local, at] = value(layer, head, tokens, int(t.shape[-1]))


def check(rank: Rank, rank_index: int, blocks: Sequence[int], start: int, end: int) -> None:
    """Every (layer, head, token) of [start, end) in the decode rank's views holds the prefill's value."""
    lay = rank.layout
    tokens = np.arange(start, end)
    where = torch.from_numpy(np.asarray(blocks)[(tokens - start) // lay.block_size])
    at = torch.from_numpy(tokens % lay.block_size)
    for layer, t in enumerate(rank.views.values()):
        for local, head in enumerate(rank_heads(rank_index, lay.tp_size, lay.model_kv_heads)):
            got = t[where, local, at]
            want = value(layer, head, tokens, int(t.shape[-1]))
            assert torch.equal(got, want), f"rank {rank_index} layer {layer} head {head}: {got[:2]} vs {want[:2]}"


def copy_units(pulls: Sequence[UnitPull], sources: Sequence[Rank], dest: Rank,
               units_of: Callable[[Rank], list[np.ndarray]] = Rank.unit_tensors) -> None:
    """What the daemons do with a plan: every run (kvbroker tensor) of the source rank's unit cache into the same run
    of ours, unit pair by unit pair. `units_of`: a rank's unit cache (default: over its own tensors; a test of a
    daemon passes the memory that daemon serves)."""
    for pull in pulls:
        src_units, dst_units = expand(pull.runs)
        src = units_of(sources[pull.remote_rank])
        dst = units_of(dest)
        assert len(src) == len(dst)
        for s, d in zip(src, dst, strict=True):
            d[dst_units.astype(np.int64)] = s[src_units.astype(np.int64)]


def hand_views(order: str, blocks: int, heads: int, tokens: int, mla: bool, layers: int = 3) -> dict[str, Any]:
    """Per-layer [B, H, N, C] int32 views of one buffer in physical order `order` over (L, B, H, N, C), as vLLM
    0.32's create_kv_cache_views makes them (its strides written out)."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": tokens, "C": HEAD if mla else 2 * HEAD}
    strides, acc = {}, 1
    for d in reversed(order):
        strides[d] = acc
        acc *= sizes[d]
    flat = torch.zeros(acc, dtype=torch.int32)
    shape = tuple(sizes[d] for d in "BHNC")
    return {f"model.layers.{i}.self_attn.attn": torch.as_strided(flat, shape, tuple(strides[d] for d in "BHNC"),
                                                                 i * strides["L"]) for i in range(layers)}
