"""The remap plan as runs (`remap.plan_pull`), built from the layouts' structure, against the plan written out unit
by unit (the reference below, which is how the plan was made before: every (source unit, destination unit) pair).
Whatever the TP sizes, block sizes, memory layout and token range, both name the same pairs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.blockruns import check
from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_CPU_AMX, MEMORY_MLA, KvLayout, cpu_memory
from kvbroker.integrations.vllm.remap import head_sources, merged, plan_pull, plan_state


def _reference(ours: KvLayout, rank: int, remote: KvLayout, local_blocks: Sequence[int],
               remote_blocks: Sequence[int], start: int, end: int) -> dict[int, set[tuple[int, int]]]:
    """Remote rank -> every (source unit, destination unit) pair, from where each element (token, dimension, K or V)
    lies on either side (`_elements`): the plan moves whole units, of which the element is at the same place."""
    step = ours.chunk_tokens if ours.token_units else ours.block_size
    out: dict[int, set[tuple[int, int]]] = {}
    if not ours.token_units:
        pages = np.arange(start // step, -(-end // step), dtype=np.int64)
        dst_page = np.asarray(local_blocks)[pages - start // step]
        src_page = np.asarray(remote_blocks)[pages - start // step]
        for source, heads in head_sources(ours, rank, remote).items():
            for remote_head, local_head in heads:
                out.setdefault(source, set()).update(zip((src_page * remote.num_kv_heads + remote_head).tolist(),
                                                         (dst_page * ours.num_kv_heads + local_head).tolist(),
                                                         strict=True))
        return out
    tokens = np.arange(start, -(-end // step) * step, dtype=np.int64)
    dst_page = np.asarray(local_blocks)[tokens // ours.block_size - start // ours.block_size]
    src_page = np.asarray(remote_blocks)[tokens // remote.block_size - start // remote.block_size]
    for source, heads in head_sources(ours, rank, remote).items():
        pairs = out.setdefault(source, set())
        for remote_head, local_head in heads:
            src = _elements(remote, src_page, remote_head, tokens % remote.block_size)
            dst = _elements(ours, dst_page, local_head, tokens % ours.block_size)
            assert (src % remote.chunk_tokens == dst % ours.chunk_tokens).all()
            pairs.update(zip((src // remote.chunk_tokens).tolist(), (dst // ours.chunk_tokens).tolist(), strict=True))
    return out


def _elements(layout: KvLayout, pages: np.ndarray, head: int, offsets: np.ndarray) -> np.ndarray:
    """The element offset in the cache of every (token, dimension) of K and V of one head, as each layout's kernel
    writes it (measured with vLLM's own kernels in tests/vllm/test_cpu_layouts.py)."""
    block, size = layout.block_size, layout.head_size
    t, d = offsets[:, None], np.arange(size)[None, :]
    base = (pages * layout.units_per_block * layout.unit_elems + head * layout.kv_parts * block * size)[:, None]
    if layout.memory == MEMORY_MLA:
        latent: np.ndarray = (base + t * size + d).reshape(-1)
        return latent
    if layout.memory == MEMORY_CPU_AMX:
        k = (t // 16) * 16 * size + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = (d // 16) * block * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        k, v = d * block + t, t * size + d
    return np.concatenate([(base + k).reshape(-1), (base + block * size + v).reshape(-1)])


def _layout(tp: int, block: int, memory: str = MEMORY_CPU, token_units: bool = True, heads: int = 4,
            size: int = 8) -> KvLayout:
    size = 32 if memory == MEMORY_CPU_AMX else size  # AMX tiles V by 16 dimensions
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
       memory=st.sampled_from([MEMORY_CPU, MEMORY_CPU_AMX, MEMORY_MLA]), token_units=st.booleans(),
       start_chunks=st.integers(0, 12), length=st.integers(1, 300), rank_pick=st.integers(0, 7),
       shuffle=st.randoms(use_true_random=False))
def test_the_runs_name_exactly_the_pairs_of_the_plan_written_out(
        tps: tuple[int, int], blocks: tuple[int, int], memory: str, token_units: bool, start_chunks: int,
        length: int, rank_pick: int, shuffle: object) -> None:
    ours_bs, theirs_bs = blocks
    if memory == MEMORY_CPU_AMX:  # vLLM runs it on blocks of a multiple of 32 tokens only (a tile is 16)
        ours_bs, theirs_bs = max(ours_bs, 32), max(theirs_bs, 32)
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


def test_a_layout_not_cut_at_tokens_moves_whole_blocks_of_one_size() -> None:
    """An ISA whose layout was not measured (`cpu_memory`): the blocks a token range touches move whole (the same
    units on both sides, whatever they hold), and blocks of another size are not planned."""
    neon, vec = _layout(1, 32, cpu_memory("neon")), _layout(1, 32)
    (whole,) = plan_pull(neon, 0, neon, [4, 2], [7, 5], 0, 40)
    assert _pairs(whole.runs) == {(7 * neon.units_per_block + i, 4 * neon.units_per_block + i)
                                  for i in range(neon.units_per_block)} | {
        (5 * neon.units_per_block + i, 2 * neon.units_per_block + i) for i in range(neon.units_per_block)}
    (same,) = plan_pull(vec, 0, vec, [4, 2], [7, 5], 0, 64)
    assert _pairs(whole.runs) == _pairs(same.runs)
    with pytest.raises(ValueError, match="move whole"):
        plan_pull(_layout(1, 64, cpu_memory("neon")), 0, neon, [4], [7, 5], 0, 64)


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
