"""TP and block-size remaps between GPU engines, on KV laid out by vLLM's own allocation (`allocate_kv_cache`, the
code a GPU worker runs, with device "cpu") for every attention backend that imports on vLLM's CPU build and every
KV cache layout it declares, as tests/vllm/test_cuda_layouts.py reads them.

- The plan, for every (backend, layout): each decode rank's units are copied as the daemon copies them
  (tests/cudaremapkit.py) and every (layer, head, token) of the decode rank's vLLM views must hold the prefill's.
- Device-direct, for every (backend, layout): each rank's runs and unit cache registered through the connector's
  DeviceDirect with a daemon stand-in (tests/devicedirectkit.py: a real registry and nixl backend, fakes of CUDA and
  NIXL), the plan applied to the unit caches at the addresses that daemon imported.
- Real daemons on loopback, for every KVCacheLayout (MLA too): CPU TENSORS STAND IN FOR DEVICE TENSORS, served
  host-staged by the connector's own worker (its unit cache is a view of the daemon's host buffer). The prefill
  workers stage what vLLM's views hold, grant the request's blocks with their unit caches as the scheduler does,
  and the decode workers pull with the plan: prefill TP 1 block 16 -> decode TP 2 block 32, the reverse, and
  TP 2 -> 1; and between equal shapes, the whole-block pull of before (the units are offered, and not used).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm import cuda_remap
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.gpu import HOST_STAGED, HostStaged
from kvbroker.integrations.vllm.params import PullSpec, RemoteKv
from kvbroker.integrations.vllm.remap import refusal
from kvbroker.integrations.vllm.worker import WorkerSide
from tests.cudaremapkit import HEAD, Rank, check, copy_units, engine_rank, fill
from tests.devicedirectkit import DaemonClient, device_direct_daemon, serve_device_direct
from tests.helpers import wait_until
from tests.vllm.test_cuda_layouts import CASES, _is_mla

try:  # vLLM >= 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

LAYERS, BLOCKS, MODEL_HEADS = 3, 12, 4
# (prefill tp, prefill block, decode tp, decode block)
SHAPES = [(1, 16, 2, 32), (2, 32, 1, 16), (2, 16, 1, 16)]
HOMOGENEOUS = (2, 16, 2, 16)


def vllm_views(order: str, blocks: int, heads: int, tokens: int, mla: bool) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of a KV buffer it places and allocates, float32 read as int32 (exact values)."""
    spec = (MLAAttentionSpec(block_size=tokens, num_kv_heads=1, head_size=HEAD, dtype=torch.float32) if mla else
            FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32))
    layout = KVCacheLayout[order]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None))
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(names, spec)],
                                             spec.page_size_bytes * LAYERS * blocks)
    views: dict[str, torch.Tensor] = allocate_kv_cache(config, torch.device("cpu"), layout)
    return {name: t.view(torch.int32) for name, t in views.items()}


def _tokens(p_block: int, d_block: int) -> tuple[int, list[int], list[int], int]:
    num_tokens = 2 * max(p_block, d_block) + 5  # a partial last block on both sides
    p_blocks = [7, 2, 9, 4, 0, 11, 5, 1, 3, 10][: -(-num_tokens // p_block)]
    d_blocks = [6, 3, 10, 1, 8, 0, 2, 4, 5, 11][: -(-num_tokens // d_block)]
    return num_tokens, p_blocks, d_blocks, d_block  # the decode engine had its first block cached


def _backends_per_view() -> dict[tuple[KVCacheLayout, bool], list[str]]:
    """The (layout, MLA or not) pairs of every backend's declared layouts: the views depend on nothing else."""
    out: dict[tuple[KVCacheLayout, bool], list[str]] = {}
    for name, cls, layout in CASES:
        if layout != KVCacheLayout.LHBNC or _is_mla(cls):  # (LHBNC: a run per head, no units; below)
            out.setdefault((layout, _is_mla(cls)), []).append(name)
    return out


VIEWS = _backends_per_view()


@pytest.mark.parametrize(("layout", "mla"), list(VIEWS), ids=[f"{lay.name}{'-mla' if mla else ''}-{len(names)}-backends"
                                                               for (lay, mla), names in VIEWS.items()])
@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block"), SHAPES, ids=["tp1b16-tp2b32", "tp2b32-tp1b16",
                                                                                  "tp2-tp1"])
def test_every_backends_layout_remaps_every_head_and_token(layout: KVCacheLayout, mla: bool, p_tp: int,
                                                           p_block: int, d_tp: int, d_block: int) -> None:
    prefill = [engine_rank(vllm_views, layout.name, p_tp, p_block, MODEL_HEADS, mla, BLOCKS) for _ in range(p_tp)]
    num_tokens, p_blocks, d_blocks, start = _tokens(p_block, d_block)
    for index, rank in enumerate(prefill):
        fill(rank, index, p_blocks, num_tokens)
    for index in range(d_tp):
        rank = engine_rank(vllm_views, layout.name, d_tp, d_block, MODEL_HEADS, mla, BLOCKS)
        assert refusal(rank.layout, prefill[0].layout.tag()) is None
        assert rank.geometry is not None and prefill[0].geometry is not None
        plan = cuda_remap.plan_pull(rank.layout, rank.geometry, index, prefill[0].layout, prefill[0].geometry,
                                    d_blocks[1:], p_blocks[start // p_block:], start, num_tokens)
        copy_units(plan, prefill, rank)
        check(rank, index, d_blocks[1:], start, num_tokens)


@pytest.mark.parametrize(("layout", "mla"), list(VIEWS), ids=[f"{lay.name}{'-mla' if mla else ''}-{len(names)}-backends"
                                                               for (lay, mla), names in VIEWS.items()])
def test_device_direct_engines_remap_every_backends_layout_through_units_the_daemon_imports(
        tmp_path: Path, layout: KVCacheLayout, mla: bool) -> None:
    """BOOKKEEPING for CUDA and NIXL (fakes): prefill TP 1 blocks of 16 -> decode TP 2 blocks of 32, device-direct on
    both sides; each engine's allocation imported and registered with NIXL once for its two caches."""
    p_tp, p_block, d_tp, d_block = SHAPES[0]
    with device_direct_daemon(tmp_path) as (rig, cuda, engines):
        prefill = [engine_rank(vllm_views, layout.name, p_tp, p_block, MODEL_HEADS, mla, BLOCKS) for _ in range(p_tp)]
        decode = [engine_rank(vllm_views, layout.name, d_tp, d_block, MODEL_HEADS, mla, BLOCKS) for _ in range(d_tp)]
        units_of = serve_device_direct(DaemonClient(rig), cuda, engines)(prefill + decode)
        assert rig.kinds() == ["open", "register"] * (p_tp + d_tp)
        num_tokens, p_blocks, d_blocks, start = _tokens(p_block, d_block)
        for index, rank in enumerate(prefill):
            fill(rank, index, p_blocks, num_tokens)
        for index, rank in enumerate(decode):
            assert rank.geometry is not None and prefill[0].geometry is not None
            plan = cuda_remap.plan_pull(rank.layout, rank.geometry, index, prefill[0].layout, prefill[0].geometry,
                                        d_blocks[1:], p_blocks[start // p_block:], start, num_tokens)
            copy_units(plan, prefill, rank, units_of)
            check(rank, index, d_blocks[1:], start, num_tokens)
    assert rig.agent.live == {} and rig.kinds().count("close") == p_tp + d_tp


def test_lhbnc_moves_whole_blocks_between_equal_shapes_only() -> None:
    """LHBNC gives each head a run of its own: no units; another TP size or block size is refused by field."""
    one, two = (engine_rank(vllm_views, "LHBNC", tp, 16, MODEL_HEADS, False, BLOCKS) for tp in (1, 2))
    assert one.geometry is None and two.geometry is None
    why = refusal(two.layout, one.layout.tag())
    assert why is not None and why.field == "tp" and "needs units on both" in why.message


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    root = tmp_path_factory.mktemp("cudaremap")
    with LocalDaemon(root, 61) as p, LocalDaemon(root, 62) as d:
        yield p, d


def _worker(daemon: LocalDaemon, engine: str, rank: Rank, index: int, prefill: LocalDaemon | None = None
            ) -> WorkerSide:
    trusted = f"{prefill.cluster_id}={prefill.peer_address}" if prefill is not None else ""
    worker = WorkerSide(ConnectorConfig(target=daemon.target, prefill_daemons=trusted, link_timeout_s=5), engine,
                        index, rank.layout)
    order = rank.layout.physical.partition(":")[0]
    worker.register_gpu(rank.views, HOST_STAGED, order, saves=prefill is None)
    return worker


@pytest.mark.parametrize("order", [lay.name for lay in KVCacheLayout if lay != KVCacheLayout.LHBNC] + ["LHBNC-mla"])
@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block"), [*SHAPES, HOMOGENEOUS],
                         ids=["tp1b16-tp2b32", "tp2b32-tp1b16", "tp2-tp1", "homogeneous"])
def test_decode_workers_pull_through_real_daemons_byte_for_byte(daemons: tuple[LocalDaemon, LocalDaemon],
                                                                order: str, p_tp: int, p_block: int, d_tp: int,
                                                                d_block: int, tmp_path: Path) -> None:
    p_daemon, d_daemon = daemons
    mla = order.endswith("-mla")
    order = order.removesuffix("-mla")
    num_tokens, p_blocks, d_blocks, start = _tokens(p_block, d_block)
    p_ranks = [engine_rank(vllm_views, order, p_tp, p_block, MODEL_HEADS, mla, BLOCKS) for _ in range(p_tp)]
    d_ranks = [engine_rank(vllm_views, order, d_tp, d_block, MODEL_HEADS, mla, BLOCKS) for _ in range(d_tp)]
    engine = f"engine-p-{order}-{int(mla)}-{p_tp}-{p_block}-{d_tp}-{d_block}"
    prefill = [_worker(p_daemon, engine, rank, i) for i, rank in enumerate(p_ranks)]
    decode = [_worker(d_daemon, "engine-d", rank, i, p_daemon) for i, rank in enumerate(d_ranks)]
    try:
        for index, (rank, worker) in enumerate(zip(p_ranks, prefill, strict=True)):
            fill(rank, index, p_blocks, num_tokens)
            staged = worker.gpu
            assert isinstance(staged, HostStaged) and worker.view is not None
            for name in rank.views:  # the prefill step: every layer wrote the request's blocks
                staged.save_layer(name, p_blocks)
            staged.wait_for_save()
        layout = prefill[0].layout
        assert layout.unit_geometry and all(w.layout.unit_geometry for w in decode)
        with p_daemon.client() as p:  # what the prefill scheduler grants: every rank's cache, then its units
            grant = p.create_grant([w.cache.cache_id for w in prefill if w.cache], p_blocks, 60.0,
                                   view_cache_ids=[w.view.cache_id for w in prefill if w.view],
                                   view_units_per_block=layout.view_grant_units)
        remote = RemoteKv(cluster_id=p_daemon.cluster_id, grant=grant, block_ids=(tuple(p_blocks),),
                          request_id="p-req", engine_id=engine, layout_tag=layout.tag(), num_tokens=num_tokens,
                          tp_size=p_tp)
        spec = PullSpec("d-req", tuple(d_blocks[1:]), tuple(p_blocks[start // p_block:]), remote, first_block=1,
                        start_token=start, end_token=num_tokens)
        for index, worker in enumerate(decode):
            planned = worker._items(spec)
            assert planned is not None
            if (p_tp, p_block) == (d_tp, d_block):  # the homogeneous pull, as before units: whole blocks, rank to rank
                ((item,)) = planned[1]
                assert item.runs is None and item.dst_cache == worker.cache.cache_id  # type: ignore[union-attr]
                assert (item.cache_slot, item.dst_blocks, item.first_block) == (index, tuple(d_blocks[1:]), 1)
            else:
                assert all(i.runs is not None and i.dst_cache == worker.view.cache_id  # type: ignore[union-attr]
                           and i.cache_slot >= p_tp for i in planned[1])
            worker.start([spec], {})
        for index, (rank, worker) in enumerate(zip(d_ranks, decode, strict=True)):
            def pulled(w: WorkerSide = worker) -> bool:
                return "d-req" in w.finished()[1]

            wait_until(pulled, timeout=30, poll=0.02, what="pull finished")
            assert worker.take_load_errors() == set()
            (transfer,) = worker.transfers.take_requests().values()
            assert transfer.tokens == num_tokens - start
            check(rank, index, d_blocks[1:], start, num_tokens)  # in vLLM's views: landed() copied the blocks in
        with p_daemon.client() as p:
            p.release_grant(grant)
    finally:
        for worker in prefill + decode:
            worker.shutdown()
