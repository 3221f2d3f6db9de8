"""Heterogeneous prefill/decode: whether a prefill engine's KV can be used here, and the plan that moves it.

The check (`refusal`) compares the two layout tags field by field: what changes the meaning of a byte (model, dtype,
memory layout, head size, layers, the model's KV heads) must be equal; what only changes where a byte is (TP size,
block size, heads per rank) is mapped where one size divides the other, and refused otherwise. A refusal names its
field, before any byte moves.

The plan is a list of (source unit, destination unit) pairs per prefill rank, where a unit is `chunk_tokens` tokens
of one head's K or V in one block (`KvLayout.desc`): the daemon executes it as strided runs over the caches it
already serves, merging consecutive units into one run, with no staging copy.

- TP: a rank holds the model's KV heads `rank_heads(rank, tp, total)`; a decode rank takes each of its heads from one
  prefill rank holding it (several prefill ranks when prefill TP is larger; a slice of one when it is smaller; each
  head once when ranks hold replicas, TP > KV heads). MLA's latent cache is on every rank: one prefill rank each.
- Block sizes: token t is chunk (t % block) // chunk of block t // block on either side, so a plan maps chunks, not
  blocks, and any two block sizes that are multiples of the same chunk work; one must divide the other (as vLLM's
  NixlConnector requires), which keeps a request's blocks aligned on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.integrations.vllm.layout import LAYOUT_VERSION, MEMORY_MLA, MUST_MATCH, KvLayout, layout_of_tag, parse_tag

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


def refusal(ours: KvLayout, theirs_tag: str) -> Refusal | None:
    """Why the KV described by `theirs_tag` cannot be used here (None: it can, through `plan_pull`)."""
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
    if ours.physical:  # a GPU engine's cache is addressed in whole blocks (gpu.runs_desc): nothing is remapped
        for name, local, other in (("tp", ours.tp_size, remote.tp_size), ("block", ours.block_size,
                                                                         remote.block_size)):
            if local != other:
                return Refusal(name, f"{name}: local {local} vs remote {other} (GPU engines pull rank to rank, "
                                     "block to block)")
    if ours.has_state and ours.tp_size != remote.tp_size:
        # A rank's Mamba state is its slice of the heads and of the conv channels, interleaved per projection.
        return Refusal("tp", f"tp: local {ours.tp_size} vs remote {remote.tp_size} (Mamba state moves between equal "
                             "TP sizes only)")
    small, large = sorted((ours.tp_size, remote.tp_size))
    if small < 1 or large % small:
        return Refusal("tp", f"tp: local {ours.tp_size} vs remote {remote.tp_size} (neither divides the other)")
    small, large = sorted((ours.block_size, remote.block_size))
    if small < 1 or large % small:
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (neither divides "
                                "the other)")
    if small != large and not ours.token_units:
        return Refusal("block", f"block: local {ours.block_size} vs remote {remote.block_size} (set "
                                "kvbroker_token_units on both engines to remap block sizes)")
    for side, layout in (("local", ours), ("remote", remote)):
        heads, tp = layout.model_kv_heads, layout.tp_size
        if layout.memory != MEMORY_MLA and (heads % tp if tp <= heads else tp % heads):
            # vLLM splits KV heads evenly or replicates them evenly; anything else names heads nobody holds
            return Refusal("tp", f"tp: {side} {tp} does not split {heads} KV heads evenly")
        want = len(rank_heads(0, layout.tp_size, layout.model_kv_heads))
        if layout.memory != MEMORY_MLA and layout.num_kv_heads != want:
            return Refusal("kv_heads", f"kv_heads: {side} {layout.num_kv_heads} per rank, expected {want} "
                                       f"({layout.model_kv_heads} heads over tp {layout.tp_size})")
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
    """One pull from one remote rank: `src_units[i]` lands in `dst_units[i]` (sorted by destination)."""

    remote_rank: int
    src_units: np.ndarray
    dst_units: np.ndarray


def plan_pull(ours: KvLayout, rank: int, remote: KvLayout, local_blocks: Sequence[int],
              remote_blocks: Sequence[int], start_token: int, end_token: int) -> list[UnitPull]:
    """Tokens [start_token, end_token) of a request: `local_blocks` hold them from block start_token // our block
    size on, `remote_blocks` from start_token // theirs on. ValueError if the lists do not cover them."""
    if not ours.token_units and ours.block_size != remote.block_size:
        raise ValueError("blocks of different sizes need token units on both engines")
    step = ours.chunk_tokens if ours.token_units else ours.block_size
    if start_token % step or end_token <= start_token:
        raise ValueError(f"token range [{start_token}, {end_token}) does not start at one of our units")
    tokens = np.arange(start_token // step, -(-end_token // step), dtype=np.int64) * step
    local_at = tokens // ours.block_size - start_token // ours.block_size
    remote_at = tokens // remote.block_size - start_token // remote.block_size
    if int(local_at[-1]) >= len(local_blocks) or int(remote_at[-1]) >= len(remote_blocks):
        raise ValueError(f"tokens [{start_token}, {end_token}) need {int(local_at[-1]) + 1} local and "
                         f"{int(remote_at[-1]) + 1} remote blocks; the request has {len(local_blocks)} and "
                         f"{len(remote_blocks)}")
    dst_page = np.asarray(local_blocks, dtype=np.int64)[local_at]
    src_page = np.asarray(remote_blocks, dtype=np.int64)[remote_at]
    out = []
    for source, heads in sorted(head_sources(ours, rank, remote).items()):
        src, dst = [], []
        for remote_head, local_head in heads:
            if ours.token_units:
                src.append(_token_units(remote, src_page, remote_head, tokens % remote.block_size))
                dst.append(_token_units(ours, dst_page, local_head, tokens % ours.block_size))
            else:  # a unit is one head of one block: the pages line up one to one
                src.append(src_page * remote.num_kv_heads + remote_head)
                dst.append(dst_page * ours.num_kv_heads + local_head)
        src_all, dst_all = np.concatenate(src), np.concatenate(dst)
        order = np.argsort(dst_all, kind="stable")  # by destination: consecutive pairs merge into one run
        out.append(UnitPull(source, src_all[order].astype(np.uint64), dst_all[order].astype(np.uint64)))
    return out


def plan_state(ours: KvLayout, rank: int, remote: KvLayout, local_block: int, remote_block: int) -> list[UnitPull]:
    """A Mamba layer's running state, whole: the units at the start of `remote_block` that hold it, into
    `local_block`, from the prefill rank of our rank (`refusal` saw equal TP sizes)."""
    if ours.unit_bytes != remote.unit_bytes or ours.state_bytes != remote.state_bytes:
        raise ValueError(f"Mamba state of {remote.state_bytes} bytes in units of {remote.unit_bytes} does not map "
                         f"onto {ours.state_bytes} bytes in units of {ours.unit_bytes}")
    units = np.arange(ours.state_units, dtype=np.uint64)
    return [UnitPull(rank, np.uint64(remote_block * remote.units_per_block) + units,
                     np.uint64(local_block * ours.units_per_block) + units)]


def _token_units(layout: KvLayout, pages: np.ndarray, head: int, offsets: np.ndarray) -> np.ndarray:
    """Units (of `chunk_tokens` elements) holding the chunks that start at token `offsets` of `pages`, for one head.

    A head's K is [head_size, block_size]: a chunk is one unit per dimension, `block_size / chunk` units apart. V
    (and MLA's latent cache) is [block_size, head_size]: a chunk is `head_size` consecutive units."""
    chunk, size = layout.chunk_tokens, layout.head_size
    per_token_row = layout.block_size // chunk  # units of one dimension of K (or one row of tokens)
    head_base = pages * layout.units_per_block + head * layout.kv_parts * layout.block_size * size // chunk
    c = offsets // chunk
    dims = np.arange(size, dtype=np.int64)
    token_major: np.ndarray = (head_base + (layout.kv_parts - 1) * per_token_row * size + c * size)[:, None] + dims
    if layout.memory == MEMORY_MLA:
        return token_major.reshape(-1)
    dim_major = (head_base + c)[:, None] + dims[None, :] * per_token_row
    return np.concatenate([dim_major.reshape(-1), token_major.reshape(-1)])


def blocks_of_units(layout: KvLayout, units: Sequence[int]) -> frozenset[int]:
    """The blocks that hold some of `units` (for reporting which blocks a failed pull left incomplete)."""
    return frozenset(int(u) // layout.units_per_block for u in units)
