"""A Mamba2 layer's state between engines of different TP sizes: which bytes of which prefill rank's state block make
a decode rank's, so that it holds exactly what a single engine at its own TP size would.

vLLM 0.32's MambaMixer2 (model_executor/layers/mamba/mamba_mixer2.py) shards a layer by heads: a rank of T holds
heads [r H/T, (r+1) H/T) of the SSM state ((H/T, head_dim, d_state)) and of x's channels, and its conv state holds
its channels of the conv input xBC in that order: x's I/T (I = H head_dim), then B's and C's G' d_state/T each. With
the model's n_groups G divisible by T, G' = G and a rank holds groups [r G/T, (r+1) G/T) of B and of C; else vLLM
requires G = 1 and extends it to G' = T, every rank holding the one group whole (`extra_groups_for_head_shards`,
`mamba_v2_sharded_weight_loader` with `duplicate_groups`). The conv state is (conv_len, channels) per block ("SD",
vLLM's default), or (channels, conv_len) with `VLLM_SSM_CONV_STATE_LAYOUT=DS`; the tensors lie back to back from the
start of the state's block (layout.py).

So a decode rank's conv state is, per row of the SD layout, three stretches (x, B, C) each taken from the prefill rank
that holds those channels, a run repeated per row; its SSM state is one run per prefill rank holding some of its heads.
The model's G is read from the two tags' shapes: a side with G' != T, or at TP 1, says it; two sides that both say
"1 or T" for different T agree only on 1. Refused (field `state`) where the state is of another kind than Mamba2,
where the shapes cannot come from one Mamba2 model, or where a stretch does not start and end on a transfer unit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.blockruns import Runs
from kvbroker.integrations.vllm.layout import KvLayout, dtype_size

MAMBA2 = "mamba2"
CONV_DIM_FIRST = "DS"


@dataclass(frozen=True, slots=True)
class Mamba2Shape:
    """A Mamba2 layer of the model (not of a rank)."""

    heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_len: int
    dim_first: bool
    """The conv state is (channels, conv_len) ("DS"), else (conv_len, channels)."""
    conv_itemsize: int
    ssm_itemsize: int

    @property
    def x_channels(self) -> int:
        return self.heads * self.head_dim

    def extended_groups(self, tp: int) -> int:
        """vLLM's G' at `tp`: G, or with G = 1 one replica per rank."""
        return self.n_groups if self.n_groups % tp == 0 else tp

    def channels(self, tp: int) -> int:
        """Conv channels of a rank."""
        return (self.x_channels + 2 * self.extended_groups(tp) * self.d_state) // tp

    def conv_pieces(self, tp: int, rank: int) -> list[tuple[int, int, int]]:
        """A rank's conv channels as (first model channel, count, first channel of the rank), model channels being
        x's, then B's, then C's (G d_state each)."""
        x, per_x = self.x_channels, self.x_channels // tp
        gs = self.n_groups * self.d_state
        per_group = gs // tp if self.n_groups % tp == 0 else self.d_state  # else G = 1, whole on every rank
        first_group = rank * per_group if self.n_groups % tp == 0 else 0
        return [(rank * per_x, per_x, 0), (x + first_group, per_group, per_x),
                (x + gs + first_group, per_group, per_x + per_group)]

    def head_pieces(self, tp: int, rank: int) -> list[tuple[int, int, int]]:
        per = self.heads // tp
        return [(rank * per, per, 0)]


def _parts(state: str) -> list[tuple[tuple[int, ...], int]]:
    out = []
    for part in state.split("+"):
        shape, _, dtype = part.partition(".")
        out.append((tuple(int(n) for n in shape.split("x")), dtype_size(dtype)))
    return out


def _group_candidates(channels: int, tp: int, x: int, d_state: int) -> set[int]:
    """The model's n_groups that give a rank of `tp` `channels` conv channels (vLLM's rule, above)."""
    twice_groups, rest = divmod(channels * tp - x, d_state)
    if rest or twice_groups <= 0 or twice_groups % 2:
        return set()
    extended = twice_groups // 2
    candidates = {extended} if extended % tp == 0 else set()
    if extended == tp:
        candidates.add(1)
    return candidates


def model_shape(a: KvLayout, b: KvLayout) -> Mamba2Shape | str:
    """The Mamba2 layer both engines' states are ranks of, or why there is none."""
    kinds = {a.mamba, b.mamba}
    if len(kinds) != 1 or not a.mamba.startswith(MAMBA2 + "."):
        return f"{a.mamba or '-'} state is not split across TP sizes (Mamba2 only)"
    dim_first = a.mamba.endswith("." + CONV_DIM_FIRST)
    found = []
    groups: set[int] | None = None
    for side in (a, b):
        parts = _parts(side.state)
        if len(parts) != 2 or len(parts[0][0]) != 2 or len(parts[1][0]) != 3:
            return f"{side.state} is not a Mamba2 conv state and SSM state"
        (conv, conv_size), ((heads, head_dim, d_state), ssm_size) = parts
        channels, conv_len = conv if dim_first else conv[::-1]
        x = heads * side.tp_size * head_dim
        found.append((heads * side.tp_size, head_dim, d_state, conv_len, conv_size, ssm_size))
        mine = _group_candidates(channels, side.tp_size, x, d_state)
        groups = mine if groups is None else groups & mine
    if found[0] != found[1]:
        return f"local {a.state} at tp {a.tp_size} and remote {b.state} at tp {b.tp_size} are not one model's state"
    if not groups or len(groups) > 1:
        return (f"local {a.state} at tp {a.tp_size} and remote {b.state} at tp {b.tp_size} name "
                f"{'no' if not groups else 'more than one'} number of B/C groups")
    heads, head_dim, d_state, conv_len, conv_size, ssm_size = found[0]
    if heads % a.tp_size or heads % b.tp_size:
        return f"{heads} heads do not split over tp {a.tp_size} and {b.tp_size}"
    return Mamba2Shape(heads, head_dim, d_state, groups.pop(), conv_len, dim_first, conv_size, ssm_size)


def _sources(ours: Sequence[tuple[int, int, int]], theirs: dict[int, list[tuple[int, int, int]]],
             preferred: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(remote rank, its first channel, our first channel, count) covering each of our pieces: each model channel
    from the first rank in `preferred` order that holds it."""
    out = []
    for start, count, at in ours:
        pos, end = start, start + count
        while pos < end:
            hit = next(((rank, rs, rn, ro) for rank in preferred for rs, rn, ro in theirs[rank] if rs <= pos < rs + rn),
                       None)
            if hit is None:
                raise ValueError(f"model channel {pos} is on no remote rank")
            rank, rs, rn, ro = hit
            stop = min(end, rs + rn)
            out.append((rank, ro + pos - rs, at + pos - start, stop - pos))
            pos = stop
    return out


def plan_split_state(ours: KvLayout, rank: int, remote: KvLayout, local_block: int,
                     remote_block: int) -> dict[int, Runs]:
    """Remote rank -> the runs of units (both layouts' transfer units) that make our `rank`'s state in
    `local_block` from the remote ranks' states in `remote_block`; ValueError where they cannot."""
    shape = model_shape(ours, remote)
    if isinstance(shape, str):
        raise ValueError(shape)
    mine, theirs = ours.tp_size, remote.tp_size
    x_ranks = [p for p in range(theirs) if any(
        rs < start + count and start < rs + rn for start, count, _ in shape.conv_pieces(mine, rank)[:1]
        for rs, rn, _ in shape.conv_pieces(theirs, p)[:1])]
    preferred = x_ranks + [p for p in range(theirs) if p not in x_ranks]  # B and C with x where they are replicas
    conv_bytes = (shape.conv_len * shape.channels(mine) * shape.conv_itemsize,
                  shape.conv_len * shape.channels(theirs) * shape.conv_itemsize)
    # (remote rank, src byte, dst byte, bytes, repetitions, src stride, dst stride)
    stretches: list[tuple[int, int, int, int, int, int, int]] = []
    size = shape.conv_itemsize
    for p, src, dst, n in _sources(shape.conv_pieces(mine, rank),
                                   {p: shape.conv_pieces(theirs, p) for p in range(theirs)}, preferred):
        if shape.dim_first:  # a channel's conv_len elements are consecutive
            stretches.append((p, src * shape.conv_len * size, dst * shape.conv_len * size, n * shape.conv_len * size,
                              1, 0, 0))
        else:  # one stretch per row of channels
            rows = shape.conv_len
            stretches.append((p, src * size, dst * size, n * size, rows, shape.channels(theirs) * size * (rows > 1),
                              shape.channels(mine) * size * (rows > 1)))
    head = shape.head_dim * shape.d_state * shape.ssm_itemsize
    for p, src, dst, n in _sources(shape.head_pieces(mine, rank),
                                   {p: shape.head_pieces(theirs, p) for p in range(theirs)}, range(theirs)):
        stretches.append((p, conv_bytes[1] + src * head, conv_bytes[0] + dst * head, n * head, 1, 0, 0))
    unit = ours.unit_bytes
    if unit != remote.unit_bytes:
        raise ValueError(f"transfer units of {ours.unit_bytes} and {remote.unit_bytes} bytes")
    out: dict[int, list[tuple[int, ...]]] = {}
    for p, src, dst, n, reps, src_stride, dst_stride in stretches:
        if math.gcd(src, dst, n, src_stride, dst_stride) % unit:
            raise ValueError(f"a stretch of {n} bytes at byte {src} of the remote state (to {dst} here) is not in "
                             f"whole transfer units of {unit} bytes")
        out.setdefault(p, []).append((remote_block * remote.units_per_block + src // unit,
                                      local_block * ours.units_per_block + dst // unit, n // unit, reps,
                                      src_stride // unit, dst_stride // unit))
    return {p: Runs(*(np.asarray(column, dtype=np.uint64) for column in zip(*rows, strict=True)))
            for p, rows in sorted(out.items())}


@functools.lru_cache(maxsize=64)
def split_refusal(ours: KvLayout, remote: KvLayout) -> str:
    """Why no rank of ours can take its state from `remote`'s ranks ("" when every one can): `ours` and `remote` in
    the units the pull addresses (remap.settle)."""
    try:
        for rank in range(ours.tp_size):
            plan_split_state(ours, rank, remote, 0, 0)
    except ValueError as e:
        return str(e)
    return ""
