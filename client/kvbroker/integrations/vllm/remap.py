"""Heterogeneous prefill/decode: whether a prefill engine's KV can be used here, and the plan that moves it.

The check (`refusal`) compares the two layout tags field by field: what changes the meaning of a byte (model, dtype,
memory layout, head size, layers, the model's KV heads) must be equal; what only changes where a byte is (TP size,
block size, heads per rank) is mapped where one size divides the other, and refused otherwise. A refusal names its
field, before any byte moves.

The plan maps (source unit, destination unit) pairs per prefill rank, where a unit is `chunk_tokens` tokens of one
head's K or V in one block (`KvLayout.desc`). It is built as runs (`kvbroker.blockruns`: a few hundred, some repeated
at a stride), never as the pairs themselves, and the daemon checks, claims and copies those runs as they are over the
caches it already serves, with no staging copy. A Mamba layer's state moves whole between equal TP sizes, and split or
gathered per projection across them (`plan_state`, mamba_state.py).

- TP: a rank holds the model's KV heads `rank_heads(rank, tp, total)`; a decode rank takes each of its heads from one
  prefill rank holding it (several prefill ranks when prefill TP is larger; a slice of one when it is smaller; each
  head once when ranks hold replicas, TP > KV heads). MLA's latent cache is on every rank: one prefill rank each.
- Block sizes: token t is chunk (t % block) // chunk of block t // block on either side, so a plan maps chunks, not
  blocks, and any two block sizes that are multiples of the same chunk work; one must divide the other (as vLLM's
  NixlConnector requires), which keeps a request's blocks aligned on both sides.
- Units (`settle`, per request, from the two tags): where both sides address their caches alike and the blocks are
  the same size, the pull uses those caches (head units by default: a homogeneous pull is planned and moved exactly
  as it always was); else both sides' token units (each engine's token view, or its cache with
  `kvbroker_token_units`), refused by field where one side has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.blockruns import Runs, concatenated, expand
from kvbroker.integrations.vllm.layout import (
    AMX_TILE_TOKENS,
    CUT_AT_TOKENS,
    LAYOUT_VERSION,
    MEMORY_CPU_AMX,
    MEMORY_MLA,
    MUST_MATCH,
    KvLayout,
    layout_of_tag,
    parse_tag,
)
from kvbroker.integrations.vllm.mamba_state import plan_split_state, split_refusal
from kvbroker.integrations.vllm.stages import NO_SPLIT

MAX_TP = 1024
MAX_BLOCK_TOKENS = 1 << 16


@dataclass(frozen=True, slots=True)
class Refusal:
    field: str
    message: str


def rank_heads(rank: int, tp: int, total: int) -> list[int]:
    """The model's KV heads a TP rank holds (vLLM's split: consecutive slices, or one replica when tp > total)."""
    if tp <= total:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * total // tp]


def settle(ours: KvLayout, remote: KvLayout) -> tuple[KvLayout, KvLayout] | None:
    """The layouts a pull between these engines addresses, (ours, theirs), in the same units on both sides: the
    caches themselves where they are addressed alike and the blocks are the same size (or both in token units), else
    both sides' token units; None when one side has none (its blocks move whole)."""
    # A Mamba state split across TP sizes is cut per projection, finer than a head's block: in token units.
    whole_blocks = ours.block_size == remote.block_size and not (ours.has_state and ours.tp_size != remote.tp_size)
    if ours.units == remote.units and (ours.token_units or whole_blocks):
        return ours, remote
    if ours.remap_units and ours.remap_units == remote.remap_units:
        return ours.token_layout(), remote.token_layout()
    return None


def refusal(ours: KvLayout, theirs_tag: str) -> Refusal | None:
    """Why the KV described by `theirs_tag` cannot be used here (None: it can, through `plan_pull`)."""
    if ours.physical:  # a GPU engine: its runs and units are cuda_remap's
        from kvbroker.integrations.vllm import cuda_remap  # (it builds on this module)

        if (split := parse_tag(theirs_tag).get("pp", NO_SPLIT)) != ours.pp:
            return Refusal("pp", f"pp: local {ours.pp} vs remote {split[:80]} (GPU engines are not split into "
                                 "pipeline stages)")

        return cuda_remap.refusal(ours, theirs_tag)
    theirs = parse_tag(theirs_tag)
    mine = {"version": f"vllm-kv/{LAYOUT_VERSION}", **ours.fields()}
    for name in MUST_MATCH:
        if theirs.get(name) != mine[name]:
            return Refusal(name, f"{name}: local {mine[name]} vs remote {theirs.get(name, '?')}")
    try:
        remote = layout_of_tag(theirs_tag)
    except ValueError as e:
        return Refusal("version", f"version: unreadable remote layout ({e})")
    # A peer's numbers are not trusted: out of these ranges they could only make the plan expensive.
    if not 1 <= remote.tp_size <= MAX_TP or not 1 <= remote.block_size <= MAX_BLOCK_TOKENS:
        field = "tp" if not 1 <= remote.tp_size <= MAX_TP else "block"
        return Refusal(field, f"{field}: remote {getattr(remote, 'tp_size' if field == 'tp' else 'block_size')} is "
                              "out of range")
    if ours.pp != remote.pp and (ours.physical or ours.has_state or "," in ours.groups):
        # A split engine's cache is one group's layers of its stage: Mamba state, several groups and GPU caches are
        # not split that way (layout_from_vllm refuses a split engine with them).
        return Refusal("pp", f"pp: local {ours.pp} vs remote {remote.pp} (pipeline stages are mapped for the "
                             "attention KV of one KV cache group on CPU engines)")
    if ours.has_state and ours.tp_size == remote.tp_size and ours.state != remote.state:
        return Refusal("state", f"state: local {ours.state} vs remote {remote.state}")
    small, large = sorted((ours.tp_size, remote.tp_size))
    if small < 1 or large % small:
        return Refusal("tp", f"tp: local {ours.tp_size} vs remote {remote.tp_size} (neither divides the other)")
    small, large = sorted((ours.block_size, remote.block_size))
    if small < 1 or large % small:
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (neither divides "
                                "the other)")
    if small != large and ours.memory not in CUT_AT_TOKENS:
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (blocks of the "
                                f"{ours.memory} layout move whole, between equal block sizes only)")
    settled = settle(ours, remote)
    if settled is None:
        local_units, remote_units = ours.remap_units or "none", remote.remap_units or "none"
        if ours.has_state and ours.tp_size != remote.tp_size:
            return Refusal("state", f"state: a Mamba state split across TP sizes (local {ours.tp_size}, remote "
                                    f"{remote.tp_size}) needs token units on both engines: local {local_units}, "
                                    f"remote {remote_units}")
        if small != large:
            return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (a block-size "
                                    f"remap needs token units on both engines: local {local_units}, remote "
                                    f"{remote_units})")
        return Refusal("units", f"units: local {ours.units} vs remote {remote.units} (no units both engines "
                                f"address: token units local {local_units}, remote {remote_units})")
    addressed, remote = settled
    if addressed.token_units and addressed.memory == MEMORY_CPU_AMX and AMX_TILE_TOKENS not in (
            addressed.chunk_tokens, remote.chunk_tokens):
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (a unit of the AMX "
                                f"layout is a tile of {AMX_TILE_TOKENS} tokens)")
    for side, layout in (("local", ours), ("remote", remote)):
        heads, tp = layout.model_kv_heads, layout.tp_size
        if layout.memory != MEMORY_MLA and (heads % tp if tp <= heads else tp % heads):
            # vLLM splits KV heads evenly or replicates them evenly; anything else names heads nobody holds
            return Refusal("tp", f"tp: {side} {tp} does not split {heads} KV heads evenly")
        want = len(rank_heads(0, layout.tp_size, layout.model_kv_heads))
        if layout.memory != MEMORY_MLA and layout.num_kv_heads != want:
            return Refusal("kv_heads", f"kv_heads: {side} {layout.num_kv_heads} per rank, expected {want} "
                                       f"({layout.model_kv_heads} heads over tp {layout.tp_size})")
    if ours.has_state and ours.tp_size != remote.tp_size and (why := split_refusal(addressed, remote)):
        return Refusal("state", f"state: local {ours.state} at tp {ours.tp_size} from remote {remote.state} at tp "
                                f"{remote.tp_size}: {why}")
    if remote.units_per_block * remote.unit_bytes != remote.page_bytes:
        return Refusal("page", f"page: remote {remote.page_bytes} bytes is not {remote.units_per_block} units of "
                               f"{remote.unit_bytes} bytes (padded pages are not supported)")
    return None


def head_sources(ours: KvLayout, rank: int, remote: KvLayout) -> dict[int, list[tuple[int, int]]]:
    """Remote rank -> [(its local head, our local head)] for everything our `rank` holds."""
    total = ours.model_kv_heads
    out: dict[int, list[tuple[int, int]]] = {}
    for local, head in enumerate(rank_heads(rank, ours.tp_size, total)):
        holders = [p for p in range(remote.tp_size) if head in rank_heads(p, remote.tp_size, total)]
        # Spread the ranks that want the same head over its holders (MLA: decode rank r of R reads prefill rank
        # r * P // R, as NixlConnector does).
        source = holders[rank * len(holders) // ours.tp_size]
        out.setdefault(source, []).append((rank_heads(source, remote.tp_size, total).index(head), local))
    return out


@dataclass(frozen=True, slots=True)
class UnitPull:
    """One pull from one remote rank, as the runs of (source unit, destination unit) pairs the daemon takes
    (`kvbroker.blockruns`): built from the layouts' structure, never from the pairs written out."""

    remote_rank: int
    runs: Runs

    @property
    def src_units(self) -> np.ndarray:
        return expand(self.runs)[0]

    @property
    def dst_units(self) -> np.ndarray:
        return expand(self.runs)[1]


def token_pieces(our_block: int, their_block: int, local_blocks: int, remote_blocks: int, start_token: int,
                 end_token: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens [start_token, end_token) cut where either side's blocks end: per piece its first token, the index of
    its block in the request's local and remote block lists, and its units of `step` tokens. ValueError if the
    lists are too short for the range."""
    small = min(our_block, their_block)
    cuts = np.arange(start_token // small, -(-end_token // small), dtype=np.int64) * small
    starts = np.maximum(cuts, start_token)
    local_at = starts // our_block - start_token // our_block
    remote_at = starts // their_block - start_token // their_block
    if int(local_at[-1]) >= local_blocks or int(remote_at[-1]) >= remote_blocks:
        raise ValueError(f"tokens [{start_token}, {end_token}) need {int(local_at[-1]) + 1} local and "
                         f"{int(remote_at[-1]) + 1} remote blocks; the request has {local_blocks} and "
                         f"{remote_blocks}")
    units = -(-(np.minimum(cuts + small, end_token) - starts) // step)
    return starts, local_at, remote_at, units


def plan_pull(ours: KvLayout, rank: int, remote: KvLayout, local_blocks: Sequence[int],
              remote_blocks: Sequence[int], start_token: int, end_token: int) -> list[UnitPull]:
    """Tokens [start_token, end_token) of a request: `local_blocks` hold them from block start_token // our block
    size on, `remote_blocks` from start_token // theirs on. ValueError if the lists do not cover them.

    The tokens are cut where a block of either side ends (one block size divides the other, so at multiples of the
    smaller): each piece lies in one block on both sides, and per head it is one run of V (token-major: `head_size`
    consecutive units per chunk) and one of K repeated per dimension (dimension-major: `block_size / chunk` units
    apart on each side). Runs that continue each other are merged: a pull between equal layouts is one run."""
    if not ours.token_units and ours.block_size != remote.block_size:
        raise ValueError("blocks of different sizes need token units on both engines")
    step = ours.chunk_tokens if ours.token_units else ours.block_size
    if start_token % step or end_token <= start_token:
        raise ValueError(f"token range [{start_token}, {end_token}) does not start at one of our units")
    if ours.memory not in CUT_AT_TOKENS:
        if ours.block_size != remote.block_size or start_token % ours.block_size:
            raise ValueError(f"blocks of the {ours.memory} layout move whole, between equal block sizes")
        end_token = -(-end_token // ours.block_size) * ours.block_size  # whole blocks: the same bytes on both sides
    starts, local_at, remote_at, units = token_pieces(ours.block_size, remote.block_size, len(local_blocks),
                                                      len(remote_blocks), start_token, end_token, step)
    dst_page = np.asarray(local_blocks, dtype=np.int64)[local_at]
    src_page = np.asarray(remote_blocks, dtype=np.int64)[remote_at]
    out = []
    for source, heads in sorted(head_sources(ours, rank, remote).items()):
        # Every head of this source at once: columns of shape (heads, pieces), one numpy call each however many
        # heads (per head, the calls cost more than the plan's arithmetic).
        remote_head, local_head = (np.asarray(h, dtype=np.int64)[:, None] for h in zip(*heads, strict=True))
        if not ours.token_units:  # a unit is one head of one block: the pages line up one to one
            src = (src_page * remote.num_kv_heads + remote_head).ravel()
            one = np.ones_like(src)
            out.append(UnitPull(source, _merged_runs([src, (dst_page * ours.num_kv_heads + local_head).ravel(), one,
                                                      one, one, one])))
            continue
        parts = _piece_runs(remote, src_page, remote_head, starts % remote.block_size, ours, dst_page, local_head,
                            starts % ours.block_size, units)
        shape = (len(heads), len(starts))
        out.append(UnitPull(source, _merged_runs([np.concatenate([np.broadcast_to(a, shape).ravel() for a in c])
                                                  for c in zip(*parts, strict=True)])))
    return out


_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _piece_runs(remote: KvLayout, src_page: np.ndarray, remote_head: np.ndarray, src_offset: np.ndarray,
                ours: KvLayout, dst_page: np.ndarray, local_head: np.ndarray, dst_offset: np.ndarray, units: np.ndarray
                ) -> list[_Columns]:
    """The runs of heads of each piece (token units; offsets are tokens into the pieces' blocks; the heads a column
    (heads, 1) against the pieces' rows: the columns broadcast to (heads, pieces)).

    "vec": a head's K is [head_size, block_size] (one unit per dimension and chunk, a row of `block_size / chunk`
    units per dimension); V (and MLA's latent cache) is [block_size, head_size] (a chunk is `head_size` consecutive
    units). "amx" (chunks of 16 tokens, `refusal`): a chunk of K is `head_size` consecutive units; of V, 16 units in
    each tile of 16 dimensions, the tiles `block_size` units apart. A layout not cut at tokens (`CUT_AT_TOKENS`) is
    planned as the "vec" one over whole blocks of equal size: the same units on both sides, whatever they hold."""
    size = ours.head_size
    src_base, src_row = _head_base(remote, src_page, remote_head), remote.block_size // remote.chunk_tokens
    dst_base, dst_row = _head_base(ours, dst_page, local_head), ours.block_size // ours.chunk_tokens
    src_chunk, dst_chunk = src_offset // remote.chunk_tokens, dst_offset // ours.chunk_tokens
    one = np.ones_like(units)
    token_major = (src_base + (remote.kv_parts - 1) * src_row * size + src_chunk * size,
                   dst_base + (ours.kv_parts - 1) * dst_row * size + dst_chunk * size, units * size, one, one, one)
    if ours.memory == MEMORY_MLA:
        return [token_major]
    if ours.memory == MEMORY_CPU_AMX:
        k_tiles = (src_base + src_chunk * size, dst_base + dst_chunk * size, units * size, one, one, one)
        tile = AMX_TILE_TOKENS  # dimensions of a tile of V; 16 tokens of one are 16 units
        v_tiles = (src_base + src_row * size + src_chunk * tile, dst_base + dst_row * size + dst_chunk * tile,
                   units * tile, one * (size // tile), one * remote.block_size, one * ours.block_size)
        return [k_tiles, v_tiles]
    dim_major = (src_base + src_chunk, dst_base + dst_chunk, units, one * size, one * src_row, one * dst_row)
    return [dim_major, token_major]


def _head_base(layout: KvLayout, pages: np.ndarray, head: np.ndarray) -> np.ndarray:
    base: np.ndarray = pages * layout.units_per_block + head * layout.kv_parts * layout.block_size * (
        layout.head_size) // layout.chunk_tokens
    return base


def _merged_runs(columns: list[np.ndarray]) -> Runs:
    """Runs by destination, a repeated run whose repetitions touch on both sides written as one, and plain runs
    that continue each other joined."""
    src, dst, length, count, src_stride, dst_stride = columns
    solid = (count > 1) & (length == src_stride) & (length == dst_stride)
    length = np.where(solid, length * count, length)
    count = np.where(solid, 1, count)
    order = np.argsort(dst, kind="stable")
    src, dst, length, count = src[order], dst[order], length[order], count[order]
    src_stride, dst_stride = src_stride[order], dst_stride[order]
    plain = count == 1
    joined = plain[1:] & plain[:-1] & (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    first = np.flatnonzero(np.concatenate(([True], ~joined)))
    total = np.add.reduceat(length, first)
    keep = count[first] > 1
    u64 = np.uint64
    return Runs(src[first].astype(u64), dst[first].astype(u64), total.astype(u64), count[first].astype(u64),
                np.where(keep, src_stride[first], 0).astype(u64), np.where(keep, dst_stride[first], 0).astype(u64))


def plan_state(ours: KvLayout, rank: int, remote: KvLayout, local_block: int, remote_block: int) -> list[UnitPull]:
    """A Mamba layer's running state: between equal TP sizes whole (the units at the start of `remote_block` that
    hold it, into `local_block`, from the prefill rank of our rank), else split or gathered per projection
    (`mamba_state`)."""
    if ours.tp_size != remote.tp_size:
        return [UnitPull(p, runs) for p, runs in plan_split_state(ours, rank, remote, local_block,
                                                                  remote_block).items()]
    if ours.unit_bytes != remote.unit_bytes or ours.state_bytes != remote.state_bytes:
        raise ValueError(f"Mamba state of {remote.state_bytes} bytes in units of {remote.unit_bytes} does not map "
                         f"onto {ours.state_bytes} bytes in units of {ours.unit_bytes}")
    one, zero = np.ones(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    src, dst = one * (remote_block * remote.units_per_block), one * (local_block * ours.units_per_block)
    return [UnitPull(rank, Runs(src, dst, one * ours.state_units, one, zero, zero))]


def merged(pulls: Sequence[UnitPull]) -> UnitPull:
    """Several pulls from one remote rank (of distinct blocks: several KV cache groups) as one."""
    return UnitPull(pulls[0].remote_rank, concatenated([p.runs for p in pulls]))


def blocks_of_units(layout: KvLayout, units: Sequence[int]) -> frozenset[int]:
    """The blocks that hold some of `units` (for reporting which blocks a failed pull left incomplete)."""
    return frozenset(int(u) // layout.units_per_block for u in units)
