"""Heterogeneous GPU engines: TP and block-size differences between prefill and decode engines whose KV stays where
vLLM's CUDA attention backends put it (gpu.py), planned from vLLM's own per-layer views.

vLLM 0.32 views every layer's KV as a logical `[B, H, N, C]` tensor (blocks, KV heads, tokens, one token's K and V of
one head: `C` elements, always innermost and dense), permuted in memory by the resolved `KVCacheLayout`: LBNHC
(FlashAttention, Triton: token-major pages), LBHNC (FlashInfer's HND: head-major pages), LHBNC, and the
block-outermost BLNHC, BLHNC, BHLNC. MLA's latent cache is the same with `H = 1` and the latent vector as `C`: it is
not split across TP, so each decode rank takes it whole from one prefill rank (`remap.head_sources`).

A unit (what the daemon addresses) is what is contiguous on both sides and means the same on both: `C` of one head of
one token, or where a head's tokens are adjacent in the page (head-major: `s_N == C`) a chunk of `unit_tokens` of
them (`chunk_tokens` of the block size). Inside a run's block (cuda_layout.read_runs) the unit of (layer, head,
token chunk j) is `layer_base + head * head_stride + j * token_stride`; the daemon applies a pull's unit pairs to
every run (kvbroker tensor) alike, so a layer's offset must repeat from run to run (layer-compact layouts: one layer
per run at offset 0; block-outermost: every layer in the one run, at a fixed step). A layout that gives one head a run
of its own (LHBNC) moves whole blocks only: between engines of one TP size and block size.

A host-staged engine serves these units as a daemon view of its host buffer (a device-direct one offers none yet:
`gpu.DeviceDirect.open_units` says why); the geometry travels in the tag's `remap` field (`Geometry.text`), and a
pull between engines of different shapes is planned here into the runs of `remap.plan_pull` (`remap._merged_runs`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbroker.integrations.vllm.cuda_layout import KvRuns
from kvbroker.integrations.vllm.layout import (
    DAEMON_TAG_FIELDS,
    LAYOUT_VERSION,
    MAX_CHUNK_TOKENS,
    MAX_GRANT_UNITS,
    MEMORY_MLA,
    MUST_MATCH,
    KvLayout,
    layout_of_tag,
    parse_tag,
)
from kvbroker.integrations.vllm.remap import (
    MAX_BLOCK_TOKENS,
    MAX_TP,
    Refusal,
    UnitPull,
    _merged_runs,
    head_sources,
    token_pieces,
)
from kvbroker.types import CacheDesc, DataType, Placement

GEOMETRY_PREFIX = "cu"
_GEOMETRY = re.compile(r"cu(\d{1,5})\.(\d{1,9})\.(\d{1,9})\.(\d{1,9})\.(\d{1,9})\.(\d{1,9})\+(\d{1,9})x(\d{1,5})")


class NoRemap(ValueError):
    """The engine's KV cannot be addressed in units for a remap (it still moves whole blocks between equal shapes)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where the units of one engine rank's KV lie inside a run's block, in units."""

    unit_tokens: int
    """Tokens of one head in a unit (1: token-major pages)."""
    unit_bytes: int
    units_per_block: int
    """Units of one run's block (its kvbroker tensor's blocks are these)."""
    head_stride: int
    token_stride: int
    """Units between consecutive token chunks of one head."""
    layer_first: int
    layer_step: int
    layers_per_run: int
    """Layer i of a run (in vLLM's order) starts at unit `layer_first + i * layer_step` of the run's block."""

    @property
    def text(self) -> str:
        """The tag's `remap` field of a GPU engine."""
        return (f"{GEOMETRY_PREFIX}{self.unit_tokens}.{self.unit_bytes}.{self.units_per_block}.{self.head_stride}."
                f"{self.token_stride}.{self.layer_first}+{self.layer_step}x{self.layers_per_run}")

    @property
    def layer_bases(self) -> np.ndarray:
        return self.layer_first + self.layer_step * np.arange(self.layers_per_run, dtype=np.int64)


def parse_geometry(text: str) -> Geometry | None:
    """A peer's geometry (None: it offers no units, "-"); ValueError if malformed."""
    if text in ("", "-"):
        return None
    match = _GEOMETRY.fullmatch(text)
    if match is None:
        raise ValueError(f"malformed GPU remap geometry {text[:80]!r}")
    geometry = Geometry(*(int(g) for g in match.groups()))
    if min(geometry.unit_tokens, geometry.unit_bytes, geometry.units_per_block, geometry.layers_per_run) < 1:
        raise ValueError(f"GPU remap geometry {text!r} has a zero size")
    return geometry


def chunk_tokens(block_size: int) -> int:
    """As `KvLayout.chunk_tokens`: the largest power of two up to MAX_CHUNK_TOKENS that divides the block size."""
    chunk = MAX_CHUNK_TOKENS
    while block_size % chunk:
        chunk //= 2
    return chunk


def read_geometry(kv_caches: Mapping[str, Any], runs: KvRuns, block_size: int) -> Geometry:
    """The units of vLLM's per-layer `[B, H, N, C]` views (the ones `runs` was read from); NoRemap, with the reason,
    where they cannot be addressed alike on every run."""
    views = list(kv_caches.values())
    es = int(views[0].element_size())
    shapes = {tuple(int(s) for s in t.shape) for t in views}
    strides = {tuple(int(s) * es for s in t.stride()) for t in views}
    if len(shapes) != 1 or len(strides) != 1 or len(next(iter(shapes))) != 4:
        raise NoRemap(f"the KV views are not all one [B, H, N, C] shape and stride ({sorted(shapes)[:2]})")
    (_, heads, tokens, content), (_, s_h, s_n, s_c) = shapes.pop(), strides.pop()
    if tokens != block_size:
        raise NoRemap(f"the views' blocks hold {tokens} tokens, the engine's {block_size} (kernel blocks)")
    slice_bytes = content * es
    if content > 1 and s_c != es:
        raise NoRemap("a token's K and V of one head are not contiguous")
    # Head-major pages (heads outside tokens, a head's tokens adjacent) cut at chunks of tokens, token-major at single
    # tokens; read from the order of the strides, which a layout keeps where a size is 1 (one head per rank, MLA).
    unit_tokens = chunk_tokens(block_size) if s_n == slice_bytes and s_h > s_n else 1
    unit_bytes = unit_tokens * slice_bytes
    if runs.block_bytes % unit_bytes or (heads > 1 and s_h % unit_bytes) or (tokens > 1 and (s_n * unit_tokens)
                                                                            % unit_bytes):
        raise NoRemap(f"units of {unit_bytes} bytes do not tile a block of {runs.block_bytes} bytes")
    if any(len(r) != 1 for r in runs.layer_runs.values()):
        raise NoRemap("a layer's KV lies in several runs (a head's KV is a tensor of its own: LHBNC)")
    per_run: dict[int, list[int]] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in kv_caches.items():
        (r,) = runs.layer_runs[name]
        offset = int(t.data_ptr()) - runs.storage_ptr - runs.starts[r]
        if (r, offset) in seen:  # a layer sharing another's KV tensor: its units are the other's
            continue
        seen.add((r, offset))
        if offset % unit_bytes or not 0 <= offset < runs.block_bytes:
            raise NoRemap(f"a layer starts {offset} bytes into its run's block, not at a unit")
        per_run.setdefault(r, []).append(offset // unit_bytes)
    patterns = {tuple(bases) for bases in per_run.values()}
    if len(patterns) != 1:
        raise NoRemap(f"the layers' places in their runs differ from run to run ({sorted(patterns)[:2]})")
    bases = patterns.pop()
    step = bases[1] - bases[0] if len(bases) > 1 else 0
    if any(b != bases[0] + i * step for i, b in enumerate(bases)):
        raise NoRemap(f"the layers of a run are not equally far apart ({bases[:4]})")
    upb = runs.block_bytes // unit_bytes
    if upb > MAX_GRANT_UNITS:
        raise NoRemap(f"a block is {upb} units of {unit_bytes} bytes: more than a grant counts per block "
                      f"({MAX_GRANT_UNITS}); units this small are more than the daemon can address")
    return Geometry(unit_tokens=unit_tokens, unit_bytes=unit_bytes, units_per_block=upb,
                    head_stride=s_h // unit_bytes if heads > 1 else 0,
                    token_stride=s_n * unit_tokens // unit_bytes if tokens > 1 else 0,
                    layer_first=bases[0], layer_step=step, layers_per_run=len(bases))


def units_desc(runs: KvRuns, geometry: Geometry, layout: KvLayout, placement: Placement) -> CacheDesc:
    """The second cache over the runs' memory: the same tensors, addressed in units."""
    fields = {**layout.fields(), "phys": f"{vllm_layout_of(layout)}:u{geometry.unit_bytes}",
              "units": f"cuda{geometry.unit_tokens}"}
    tag = f"vllm-kv/{LAYOUT_VERSION} " + " ".join(f"{k}={fields[k]}" for k in DAEMON_TAG_FIELDS)
    return CacheDesc(num_tensors=len(runs.starts), shape=(runs.num_blocks * geometry.units_per_block,
                                                          geometry.unit_bytes),
                     data_type=DataType.UINT8, placement=placement, layout_tag=tag)


def vllm_layout_of(layout: KvLayout) -> str:
    """vLLM's KVCacheLayout name from the tag's `phys` field (`gpu.physical_tag`)."""
    return layout.physical.partition(":")[0]


def remote_geometry(theirs_tag: str) -> Geometry | None:
    return parse_geometry(parse_tag(theirs_tag).get("remap", "-"))


def refusal(ours: KvLayout, theirs_tag: str) -> Refusal | None:
    """Why a GPU engine cannot use the KV described by `theirs_tag` (None: it can: whole blocks rank to rank where
    the shapes are equal, else through `plan_pull`)."""
    theirs = parse_tag(theirs_tag)
    mine = {"version": f"vllm-kv/{LAYOUT_VERSION}", **ours.fields()}
    for name in MUST_MATCH:
        if name != "phys" and theirs.get(name) != mine[name]:
            return Refusal(name, f"{name}: local {mine[name]} vs remote {theirs.get(name, '?')}")
    try:
        remote = layout_of_tag(theirs_tag)
    except ValueError as e:
        return Refusal("version", f"version: unreadable remote layout ({e})")
    if not remote.physical or vllm_layout_of(remote) != vllm_layout_of(ours):
        return Refusal("phys", f"phys: local {ours.physical} vs remote {remote.physical or '-'} (GPU engines move "
                               "KV between engines of one vLLM KV cache layout)")
    if ours.tp_size == remote.tp_size and ours.block_size == remote.block_size:
        if remote.physical != ours.physical:
            return Refusal("phys", f"phys: local {ours.physical} vs remote {remote.physical}")
        return None  # whole blocks, rank to rank: the homogeneous pull
    field = "tp" if ours.tp_size != remote.tp_size else "block"
    if not 1 <= remote.tp_size <= MAX_TP or not 1 <= remote.block_size <= MAX_BLOCK_TOKENS:
        return Refusal(field, f"{field}: remote tp {remote.tp_size}, block {remote.block_size} out of range")
    try:
        geometry = parse_geometry(theirs.get("remap", "-"))
    except ValueError as e:
        return Refusal("version", f"version: unreadable remote layout ({e})")
    mine_geometry = parse_geometry(mine["remap"])
    if mine_geometry is None or geometry is None:
        return Refusal(field, f"{field}: local {mine[field]} vs remote {theirs.get(field)} (a remap needs units on "
                              f"both GPU engines: local {mine['remap']}, remote {theirs.get('remap', '-')})")
    small, large = sorted((ours.tp_size, remote.tp_size))
    if large % small:
        return Refusal("tp", f"tp: local {ours.tp_size} vs remote {remote.tp_size} (neither divides the other)")
    small, large = sorted((ours.block_size, remote.block_size))
    if large % small:
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (neither divides "
                                "the other)")
    if (mine_geometry.unit_tokens, mine_geometry.unit_bytes) != (geometry.unit_tokens, geometry.unit_bytes):
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (units of "
                                f"{mine_geometry.unit_tokens} token(s) here, {geometry.unit_tokens} there)")
    if mine_geometry.layers_per_run != geometry.layers_per_run:
        return Refusal("phys", f"phys: {mine_geometry.layers_per_run} layers per run here, "
                               f"{geometry.layers_per_run} there")
    for side, layout in (("local", ours), ("remote", remote)):
        heads, tp = layout.model_kv_heads, layout.tp_size
        if layout.memory != MEMORY_MLA and (heads % tp if tp <= heads else tp % heads):
            return Refusal("tp", f"tp: {side} {tp} does not split {heads} KV heads evenly")
        want = 1 if layout.memory == MEMORY_MLA else max(1, heads // tp)
        if layout.num_kv_heads != want:
            return Refusal("kv_heads", f"kv_heads: {side} {layout.num_kv_heads} per rank, expected {want} "
                                       f"({heads} heads over tp {tp})")
    return None


def plan_pull(ours: KvLayout, our_geometry: Geometry, rank: int, remote: KvLayout, their_geometry: Geometry,
              local_blocks: Sequence[int], remote_blocks: Sequence[int], start_token: int,
              end_token: int) -> list[UnitPull]:
    """`remap.plan_pull` for GPU engines: tokens [start_token, end_token) of a request, `local_blocks` holding them
    from block start_token // our block size on, `remote_blocks` from start_token // theirs on. One pull per prefill
    rank read, in units of both sides' unit caches (`units_desc`). ValueError if the lists do not cover them."""
    step = our_geometry.unit_tokens
    if start_token % step or end_token <= start_token:
        raise ValueError(f"token range [{start_token}, {end_token}) does not start at one of our units")
    starts, local_at, remote_at, units = token_pieces(ours.block_size, remote.block_size, len(local_blocks),
                                                      len(remote_blocks), start_token, end_token, step)
    src_chunk = (starts % remote.block_size) // step
    dst_chunk = (starts % ours.block_size) // step
    src_base = np.asarray(remote_blocks, dtype=np.int64)[remote_at] * their_geometry.units_per_block + (
        src_chunk * their_geometry.token_stride)
    dst_base = np.asarray(local_blocks, dtype=np.int64)[local_at] * our_geometry.units_per_block + (
        dst_chunk * our_geometry.token_stride)
    one = np.ones_like(units)
    # Tokens of a head adjacent on both sides: a piece is one run; else one unit per token, at each side's stride.
    adjacent = their_geometry.token_stride == our_geometry.token_stride == 1
    shape = (units, one, one, one) if adjacent else (one, units, one * their_geometry.token_stride,
                                                       one * our_geometry.token_stride)
    out = []
    for source, heads in sorted(head_sources(ours, rank, remote).items()):
        parts = []
        for remote_head, local_head in heads:
            for src_layer, dst_layer in zip(their_geometry.layer_bases, our_geometry.layer_bases, strict=True):
                parts.append((src_base + int(src_layer) + remote_head * their_geometry.head_stride,
                              dst_base + int(dst_layer) + local_head * our_geometry.head_stride, *shape))
        out.append(UnitPull(source, _merged_runs([np.concatenate(c) for c in zip(*parts, strict=True)])))
    return out
