"""cuda_remap: TP and block-size remaps between GPU engines, on per-layer views whose strides are written out here for
every vLLM 0.32 KVCacheLayout (tests/vllm/test_cuda_remap.py takes them from vLLM's own allocation, and moves them
through real daemons). A plan is applied the way the daemon applies it (tests/cudaremapkit.py: every run, the same
unit pairs) and every (layer, head, token) of the decode views is compared with the prefill's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")


from kvbroker import Placement
from kvbroker.integrations.vllm import cuda_remap
from kvbroker.integrations.vllm.cuda_remap import NoRemap, parse_geometry, read_geometry, units_desc
from kvbroker.integrations.vllm.gpu import DeviceDirect
from kvbroker.integrations.vllm.layout import layout_of_tag
from kvbroker.integrations.vllm.remap import refusal
from tests.cudaremapkit import Rank, check, copy_units, engine_rank, fill, hand_views
from tests.devicedirectkit import DaemonClient, device_direct_daemon, serve_device_direct

REMAPPED = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC")
# (prefill tp, prefill block, decode tp, decode block, model KV heads)
SHAPES = [
    pytest.param(1, 16, 2, 32, 4, id="tp1-b16-to-tp2-b32"),
    pytest.param(2, 32, 1, 16, 4, id="tp2-b32-to-tp1-b16"),
    pytest.param(2, 16, 1, 16, 4, id="tp2-to-tp1"),
    pytest.param(1, 16, 4, 16, 2, id="tp1-to-tp4-replicas"),
    pytest.param(1, 16, 1, 64, 2, id="b16-to-b64"),
]


def _pull(order: str, p_tp: int, p_block: int, d_tp: int, d_block: int, heads: int, mla: bool = False,
          serve: Callable[[list[Rank]], Callable[[Rank], list[np.ndarray]]] | None = None) -> None:
    """`serve`: registers the ranks with a daemon and returns where that daemon finds each rank's unit cache (None:
    the copies go straight between the ranks' own tensors)."""
    prefill = [engine_rank(hand_views, order, p_tp, p_block, heads, mla) for _ in range(p_tp)]
    decode = [engine_rank(hand_views, order, d_tp, d_block, heads, mla) for _ in range(d_tp)]
    units_of = serve(prefill + decode) if serve is not None else Rank.unit_tensors
    num_tokens = 2 * max(p_block, d_block) + 5  # a partial last block on both sides
    p_blocks = [7, 2, 9, 4, 0, 11, 5, 1, 3, 10][: -(-num_tokens // p_block)]
    d_blocks = [6, 3, 10, 1, 8, 0, 2, 4, 5, 11][: -(-num_tokens // d_block)]
    start = d_block  # the decode engine had its first block cached
    for index, rank in enumerate(prefill):
        fill(rank, index, p_blocks, num_tokens)
    for index, rank in enumerate(decode):
        assert refusal(rank.layout, prefill[0].layout.tag()) is None
        assert rank.geometry is not None and prefill[0].geometry is not None
        plan = cuda_remap.plan_pull(rank.layout, rank.geometry, index, prefill[0].layout, prefill[0].geometry,
                                    d_blocks[1:], p_blocks[start // p_block:], start, num_tokens)
        copy_units(plan, prefill, rank, units_of)
        check(rank, index, d_blocks[1:], start, num_tokens)


@pytest.mark.parametrize("order", REMAPPED)
@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block", "heads"), SHAPES)
def test_every_head_and_token_lands_where_the_decode_views_read_it(order: str, p_tp: int, p_block: int, d_tp: int,
                                                                   d_block: int, heads: int) -> None:
    _pull(order, p_tp, p_block, d_tp, d_block, heads)


@pytest.mark.parametrize("order", ["LBNHC", "LHBNC", "BLNHC"])
@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block"), [(1, 16, 2, 32), (2, 32, 1, 16), (2, 16, 1, 16)])
def test_mla_is_taken_whole_from_one_prefill_rank(order: str, p_tp: int, p_block: int, d_tp: int,
                                                  d_block: int) -> None:
    _pull(order, p_tp, p_block, d_tp, d_block, 1, mla=True)


def test_head_major_pages_move_chunks_of_tokens_token_major_ones_single_tokens() -> None:
    nhd = engine_rank(hand_views, "LBNHC", 1, 32, 4).geometry
    hnd = engine_rank(hand_views, "LBHNC", 1, 32, 4).geometry
    assert nhd is not None and hnd is not None
    assert (nhd.unit_tokens, nhd.head_stride, nhd.token_stride) == (1, 1, 4)
    assert (hnd.unit_tokens, hnd.head_stride, hnd.token_stride) == (16, 2, 1)
    outer = engine_rank(hand_views, "BLHNC", 1, 32, 4).geometry
    assert outer is not None and (outer.layers_per_run, outer.layer_step) == (3, 8)
    assert parse_geometry(hnd.text) == hnd


def test_a_homogeneous_pull_stays_whole_blocks_rank_to_rank() -> None:
    rank = engine_rank(hand_views, "LBNHC", 2, 16, 4)
    assert refusal(rank.layout, rank.layout.tag()) is None
    assert layout_of_tag(rank.layout.tag()).unit_geometry == rank.layout.unit_geometry
    assert not layout_of_tag(rank.layout.tag()).token_view


def _refused(ours: Rank, theirs: Rank) -> str:
    why = refusal(ours.layout, theirs.layout.tag())
    assert why is not None
    return why.field


def test_what_cannot_be_remapped_is_refused_by_field() -> None:
    # LHBNC gives each head a run of its own: whole blocks only, between equal shapes.
    lhbnc_1, lhbnc_2 = (engine_rank(hand_views, "LHBNC", tp, 16, 4) for tp in (1, 2))
    assert lhbnc_1.geometry is None
    assert _refused(lhbnc_2, lhbnc_1) == "tp"
    assert _refused(engine_rank(hand_views, "LHBNC", 1, 32, 4), lhbnc_1) == "block"
    # Another vLLM KV cache layout: the bytes of a block are in another order.
    assert _refused(engine_rank(hand_views, "LBHNC", 2, 16, 4), engine_rank(hand_views, "LBNHC", 1, 16, 4)) == "phys"
    # Block sizes neither of which divides the other, and units of different sizes (chunks of 8 vs 16 tokens).
    assert _refused(engine_rank(hand_views, "LBNHC", 1, 48, 4), engine_rank(hand_views, "LBNHC", 1, 32, 4)) == "block"
    assert _refused(engine_rank(hand_views, "LBHNC", 1, 8, 4), engine_rank(hand_views, "LBHNC", 1, 16, 4)) == "block"
    # KV heads TP does not split evenly (6 heads over 4 ranks), and a tag whose heads per rank do not add up.
    six = engine_rank(hand_views, "LBNHC", 1, 16, 6)
    assert _refused(six, dataclasses.replace(six, layout=dataclasses.replace(six.layout, tp_size=4))) == "tp"
    two = engine_rank(hand_views, "LBNHC", 2, 16, 4)
    odd = dataclasses.replace(two.layout, num_kv_heads=1)
    assert _refused(engine_rank(hand_views, "LBNHC", 1, 16, 4), dataclasses.replace(two, layout=odd)) == "kv_heads"
    # A peer without units (an older connector, or a layout without them).
    bare = dataclasses.replace(two, layout=dataclasses.replace(two.layout, unit_geometry=""))
    assert _refused(engine_rank(hand_views, "LBNHC", 1, 16, 4), bare) == "tp"
    assert _refused(engine_rank(hand_views, "LBNHC", 1, 16, 4),
                    dataclasses.replace(two, layout=dataclasses.replace(two.layout, model_id="other"))) == "model"


def test_units_finer_than_a_grant_can_count_are_not_offered() -> None:
    """Token-major pages of every layer in one block (BLNHC) cut a block into layers x heads x tokens units: past what
    a grant counts per block (MAX_GRANT_UNITS), the engine offers no units and moves whole blocks only."""
    views = hand_views("BLNHC", 1, 16, 64, False, layers=80)  # 80 x 16 x 64 = 81920 units
    from kvbroker.integrations.vllm.cuda_layout import read_runs

    with pytest.raises(NoRemap, match="more than the daemon can address"):
        read_geometry(views, read_runs(views), 64)


def test_malformed_geometry_in_a_peers_tag_is_refused_as_unreadable() -> None:
    two = engine_rank(hand_views, "LBNHC", 2, 16, 4)
    tag = two.layout.tag().replace(two.layout.unit_geometry, "cu1.0.1.1.1.0+0x1")
    why = refusal(engine_rank(hand_views, "LBNHC", 1, 16, 4).layout, tag)
    assert why is not None and why.field == "version"


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLHNC"])
@pytest.mark.parametrize(("p_tp", "p_block", "d_tp", "d_block", "heads"), SHAPES[:3])
def test_device_direct_engines_remap_through_units_the_daemon_imports_over_their_vram(
        tmp_path: Path, order: str, p_tp: int, p_block: int, d_tp: int, d_block: int, heads: int) -> None:
    """BOOKKEEPING ONLY for CUDA and NIXL (fakes): every rank registers its runs device-direct and its unit cache as
    the same VRAM again; the daemon imports each allocation once and registers it with NIXL once, and the plan applied
    to the memory the daemon serves as unit caches lands every (layer, head, token) where the decode views read it."""
    with device_direct_daemon(tmp_path) as (rig, cuda, engines):
        client = DaemonClient(rig)
        serve = serve_device_direct(client, cuda, engines)
        _pull(order, p_tp, p_block, d_tp, d_block, heads, serve=serve)
        engines_count = p_tp + d_tp
        assert rig.kinds() == ["open", "register"] * engines_count and len(rig.registry.list()) == 2 * engines_count
    assert rig.kinds()[2 * engines_count:] == ["deregister", "close"] * engines_count
    assert rig.agent.live == {} and client.calls == ["register", "register"] * engines_count + [
        "unregister", "unregister"] * engines_count


def test_device_direct_offers_no_units_on_a_daemon_that_would_register_the_vram_twice(tmp_path: Path) -> None:
    """A daemon without CUDA_REREGISTER would register the same descriptors with NIXL twice (refused, or freed wrongly
    on deregistration: ai-dynamo/nixl#1792, #1773): the engine registers its runs once and offers no units."""
    rank = engine_rank(hand_views, "LBHNC", 1, 16, 2)
    assert rank.geometry is not None
    with device_direct_daemon(tmp_path) as (rig, cuda, engines):
        client = DaemonClient(rig, features=())
        gpu = DeviceDirect(client, rank.views, rank.runs, rank.layout.tag(), exporter=cuda.export)  # type: ignore[arg-type]
        engines.append(gpu)
        with pytest.raises(NoRemap, match="NIXL twice"):
            gpu.open_units(units_desc(rank.runs, rank.geometry, rank.layout, Placement.DEVICE))
    assert client.calls == ["register", "unregister"] and rig.kinds() == ["open", "register", "deregister", "close"]


@pytest.mark.parametrize("remapped", [True, False])
def test_failed_units_of_a_gpu_remap_are_reported_as_their_blocks_and_a_homogeneous_pulls_blocks_as_they_are(
        remapped: bool) -> None:
    """A GPU engine offers units and pulls whole blocks between equal shapes: the failed entries of a pull are its
    unit cache's units (reported as the blocks that hold them) only where the pull was planned in units."""
    import numpy as np

    from kvbroker.blockruns import Runs
    from kvbroker.integrations.vllm.config import ConnectorConfig
    from kvbroker.integrations.vllm.loads import LoadOutcome, PullItem
    from kvbroker.integrations.vllm.params import PullSpec, RemoteKv
    from kvbroker.integrations.vllm.worker import WorkerSide
    from kvbroker.status import LlmStatus
    from kvbroker.types import Grant

    rank = engine_rank(hand_views, "LBHNC", 1, 16, 2)
    assert rank.geometry is not None
    # No daemon: the constructor does no I/O, and this path does not reach one.
    worker = WorkerSide(ConnectorConfig(target="unix:///nonexistent/kvbroker.sock"), "engine", 0, rank.layout)
    worker._geometry = rank.geometry
    grant = Grant(bytes(16), bytes(32))
    one = np.ones(1, dtype=np.uint64)
    runs = Runs(one, one, one, one, one * 0, one * 0) if remapped else None
    worker._items = lambda spec: (  # type: ignore[method-assign]
        worker.layout, [PullItem(spec.request_id, 1, grant, 0, 0, (), runs=runs)])
    worker.loads.submit = lambda items: None  # type: ignore[method-assign]
    remote = RemoteKv(cluster_id=1, grant=grant, block_ids=((1, 2, 3),), request_id="p", engine_id="engine-p",
                      layout_tag=rank.layout.tag(), num_tokens=48, tp_size=1)
    try:
        worker.start([PullSpec("d", (4, 5, 6), (1, 2, 3), remote)], {})
        failed = 5 * rank.geometry.units_per_block + 1 if remapped else 5
        worker._loaded(LoadOutcome("d", frozenset({failed}), 0, 0.0, "", LlmStatus.LLM_FAILED))
        assert worker.finished()[1] == {"d"} and worker.take_load_errors() == {5}
    finally:
        worker.shutdown()
