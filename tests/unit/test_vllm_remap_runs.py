"""The remap plan as runs (`remap.plan_pull`), built from the layouts' structure, against the plan written out unit
by unit (the reference below, which is how the plan was made before: every (source unit, destination unit) pair).
Whatever the TP sizes, block sizes, memory layout and token range, both name the same pairs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.blockruns import check
from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_MLA, KvLayout
from kvbroker.integrations.vllm.remap import head_sources, merged, plan_pull, plan_state


def _reference(ours: KvLayout, rank: int, remote: KvLayout, local_blocks: Sequence[int],
               remote_blocks: Sequence[int], start: int, end: int) -> dict[int, set[tuple[int, int]]]:
    """Remote rank -> every (source unit, destination unit) pair, one token chunk of one dimension at a time."""
    step = ours.chunk_tokens if ours.token_units else ours.block_size
    tokens = np.arange(start // step, -(-end // step), dtype=np.int64) * step
    dst_page = np.asarray(local_blocks)[tokens // ours.block_size - start // ours.block_size]
    src_page = np.asarray(remote_blocks)[tokens // remote.block_size - start // remote.block_size]
    out: dict[int, set[tuple[int, int]]] = {}
    for source, heads in head_sources(ours, rank, remote).items():
        pairs = out.setdefault(source, set())
        for remote_head, local_head in heads:
            if ours.token_units:
                src = _units(remote, src_page, remote_head, tokens % remote.block_size)
                dst = _units(ours, dst_page, local_head, tokens % ours.block_size)
            else:
                src = src_page * remote.num_kv_heads + remote_head
                dst = dst_page * ours.num_kv_heads + local_head
            pairs.update(zip(src.tolist(), dst.tolist(), strict=True))
    return out


def _units(layout: KvLayout, pages: np.ndarray, head: int, offsets: np.ndarray) -> np.ndarray:
    chunk, size = layout.chunk_tokens, layout.head_size
    row = layout.block_size // chunk
    base = pages * layout.units_per_block + head * layout.kv_parts * layout.block_size * size // chunk
    c = offsets // chunk
    dims = np.arange(size)
    token_major: np.ndarray = (base + (layout.kv_parts - 1) * row * size + c * size)[:, None] + dims
    if layout.memory == MEMORY_MLA:
        return token_major.reshape(-1)
    return np.concatenate([((base + c)[:, None] + dims * row).reshape(-1), token_major.reshape(-1)])


def _layout(tp: int, block: int, memory: str = MEMORY_CPU, token_units: bool = True, heads: int = 4,
            size: int = 8) -> KvLayout:
    per_rank = 1 if memory == MEMORY_MLA else max(1, heads // tp)
    parts = 1 if memory == MEMORY_MLA else 2
    return KvLayout(2, 64, block, per_rank, size, "float16", block * per_rank * parts * size * 2, "m", tp,
                    total_kv_heads=1 if memory == MEMORY_MLA else heads, memory=memory, token_units=token_units)


def _pairs(pull_runs: object) -> set[tuple[int, int]]:
    from kvbroker.blockruns import expand

    src, dst = expand(pull_runs)  # type: ignore[arg-type]
    pairs = set(zip(src.tolist(), dst.tolist(), strict=True))
    assert len(pairs) == len(src)  # no pair twice
    return pairs


@settings(max_examples=150, deadline=None)
@given(tps=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1)]),
       blocks=st.sampled_from([(32, 32), (32, 64), (64, 32), (16, 64), (128, 32), (32, 128)]),
       memory=st.sampled_from([MEMORY_CPU, MEMORY_MLA]), token_units=st.booleans(),
       start_chunks=st.integers(0, 12), length=st.integers(1, 300), rank_pick=st.integers(0, 7),
       shuffle=st.randoms(use_true_random=False))
def test_the_runs_name_exactly_the_pairs_of_the_plan_written_out(
        tps: tuple[int, int], blocks: tuple[int, int], memory: str, token_units: bool, start_chunks: int,
        length: int, rank_pick: int, shuffle: object) -> None:
    ours_bs, theirs_bs = blocks
    if not token_units:
        theirs_bs = ours_bs  # whole-block units: block sizes must be equal
    ours, theirs = _layout(tps[0], ours_bs, memory, token_units), _layout(tps[1], theirs_bs, memory, token_units)
    step = ours.chunk_tokens if token_units else ours_bs
    start = start_chunks * step
    end = start + length
    rank = rank_pick % tps[0]
    # the request's blocks from its first token: any distinct ids, in any order
    local = list(range(1, -(-end // ours_bs) + 1))
    remote = list(range(3, -(-end // theirs_bs) + 3))
    shuffle.shuffle(local)  # type: ignore[attr-defined]
    shuffle.shuffle(remote)  # type: ignore[attr-defined]
    local_from, remote_from = local[start // ours_bs:], remote[start // theirs_bs:]
    want = _reference(ours, rank, theirs, local_from, remote_from, start, end)
    got = plan_pull(ours, rank, theirs, local_from, remote_from, start, end)
    assert {p.remote_rank: _pairs(p.runs) for p in got} == want
    for p in got:  # the runs are well formed on the wire (the daemon's own bounds)
        r = p.runs
        check(r.src_first, r.dst_first, r.length, r.count, r.src_stride, r.dst_stride)


def test_a_pull_between_equal_layouts_is_one_run_and_a_remap_a_few_strided_ones() -> None:
    same = _layout(1, 32, heads=8, size=128)
    (pull,) = plan_pull(same, 0, same, list(range(1, 33)), list(range(1, 33)), 0, 1024)
    assert len(pull.runs.length) == 1 and int(pull.runs.length[0]) == 32 * same.units_per_block
    (remap,) = plan_pull(_layout(1, 64, heads=8, size=128), 0, same, list(range(1, 17)), list(range(1, 33)), 0, 1024)
    # a piece of 32 tokens per head: K as one run repeated per dimension, V as one run
    assert len(remap.runs.length) == 32 * 8 * 2 and int(remap.runs.count.max()) == 128


def test_the_groups_of_a_rank_merge_into_one_pull_and_a_state_is_one_run() -> None:
    ours = _layout(1, 32)
    (a,) = plan_pull(ours, 0, ours, [1, 2], [5, 6], 0, 64)
    (b,) = plan_pull(ours, 0, ours, [9], [7], 0, 20)
    both = merged([a, b])
    assert _pairs(both.runs) == _pairs(a.runs) | _pairs(b.runs)
    mamba = KvLayout(2, 64, 32, 4, 8, "float16", ours.page_bytes, "m", 1, total_kv_heads=4, token_units=True,
                     groups="mamba:2,full:2", state="3x8.float16")
    (state,) = plan_state(mamba, 0, mamba, 9, 3)
    assert len(state.runs.length) == 1 and _pairs(state.runs) == {
        (3 * mamba.units_per_block + i, 9 * mamba.units_per_block + i) for i in range(mamba.state_units)}
