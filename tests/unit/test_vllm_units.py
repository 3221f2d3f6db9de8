"""Which units a pull addresses, settled per request from the two layout tags (`remap.settle`): with default
settings an engine serves its KV in head units and, through a view of the same memory, in token units; engines of
one block size pull exactly as before, engines of different block sizes through both token views, and an engine with
`kvbroker_token_units` (an existing config) pulls from and into either."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbroker.blockruns import expand
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.layout import MEMORY_CPU_AMX, KvLayout, layout_from_vllm, layout_of_tag
from kvbroker.integrations.vllm.params import PullSpec, RemoteKv, WorkerEndpoint
from kvbroker.integrations.vllm.remap import plan_pull, refusal, settle
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.types import Grant
from tests.unit.test_vllm_connector import FakeRequest

HEADS, HEAD = 2, 64


def _spec(block: int, heads: int) -> Any:
    return SimpleNamespace(block_size=block, num_kv_heads=heads, head_size=HEAD, dtype="torch.float32",
                           page_size_bytes=heads * 2 * block * HEAD * 4)


def _engine(block: int, token_units: bool = False, groups: int = 1, tp: int = 1, blocks: int = 64) -> KvLayout:
    """A CPU engine's layout as the connector reads it from vLLM (default settings unless `token_units`): a model of
    HEADS KV heads over `tp` ranks."""
    spec = _spec(block, HEADS // tp)
    page = spec.page_size_bytes
    tensor = SimpleNamespace(size=page * blocks * 2, layers=["l0", "l1"], layer_stride=page * blocks,
                             block_stride=page, offset=0)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * groups,
                             kv_cache_tensors=[tensor] * groups, num_blocks=blocks)
    return layout_from_vllm(config, "m1", tp_size=tp, total_kv_heads=HEADS, token_units=token_units)


def _older(layout: KvLayout) -> str:
    """The tag of a connector that predates token views (no `remap` field)."""
    return " ".join(item for item in layout.tag().split() if not item.startswith("remap="))


def test_a_default_engine_offers_a_token_view_and_says_so_in_its_tag() -> None:
    layout = _engine(32)
    assert layout.token_view and not layout.token_units and "units=head" in layout.tag()
    assert "remap=token16" in layout.tag() and "remap" not in layout.daemon_tag()
    view = layout.token_layout()
    assert view.token_units and view.desc().tensor_nbytes == layout.desc().tensor_nbytes  # the same bytes
    assert view.desc().shape == (64 * HEADS * 2 * 32 * HEAD // 16, 16)
    assert layout_of_tag(layout.tag()).token_view and not layout_of_tag(_older(layout)).token_view
    # With kvbroker_token_units the cache itself is in token units: no view is needed.
    knob = _engine(32, token_units=True)
    assert not knob.token_view and knob.remap_units == "token16" == layout.remap_units


def test_engines_of_one_block_size_pull_their_caches_as_before() -> None:
    """The homogeneous pull: settled to the two layouts themselves (head units), so its plan is exactly the plan
    without views, and the worker pulls into its cache from the prefill caches' slots (`test_the_worker_...`)."""
    ours, theirs = _engine(32), _engine(32)
    mine, remote = settle(ours, layout_of_tag(theirs.tag()))  # type: ignore[misc]
    assert mine is ours and not remote.token_units
    plain = dataclasses.replace(ours, token_view=False)
    runs = plan_pull(mine, 0, remote, [3, 4], [7, 8], 0, 64)
    before = plan_pull(plain, 0, dataclasses.replace(remote, token_view=False), [3, 4], [7, 8], 0, 64)
    for a, b in zip(runs, before, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(expand(a.runs), expand(b.runs), strict=True))
    assert refusal(ours, _older(theirs)) is None  # an older connector's engine of our block size: as before


@pytest.mark.parametrize(("ours_block", "theirs_block"), [(64, 32), (32, 64)])
@pytest.mark.parametrize("groups", [1, 2])
def test_engines_of_different_block_sizes_remap_through_their_token_views(ours_block: int, theirs_block: int,
                                                                          groups: int) -> None:
    ours, theirs = _engine(ours_block, groups=groups), _engine(theirs_block, groups=groups)
    assert refusal(ours, theirs.tag()) is None
    mine, remote = settle(ours, layout_of_tag(theirs.tag()))  # type: ignore[misc]
    assert mine.token_units and remote.token_units and mine.desc().layout_tag == remote.desc().layout_tag
    # The plan is the one `kvbroker_token_units` on both engines made.
    knob = plan_pull(_engine(ours_block, True, groups), 0, layout_of_tag(_engine(theirs_block, True, groups).tag()),
                     [1, 2], [5, 6, 7, 8] if theirs_block < ours_block else [5], 0, 64)
    got = plan_pull(mine, 0, remote, [1, 2], [5, 6, 7, 8] if theirs_block < ours_block else [5], 0, 64)
    for a, b in zip(got, knob, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(expand(a.runs), expand(b.runs), strict=True))


def test_an_existing_token_units_config_pulls_from_and_into_default_engines() -> None:
    knob, default = _engine(32, token_units=True), _engine(64)
    for ours, theirs in ((knob, default), (default, knob), (knob, _engine(32)), (_engine(32), knob)):
        assert refusal(ours, theirs.tag()) is None, (ours, theirs)
        mine, remote = settle(ours, layout_of_tag(theirs.tag()))  # type: ignore[misc]
        assert mine.token_units and remote.token_units


def test_a_remap_with_an_engine_without_token_units_is_refused_by_field() -> None:
    older = refusal(_engine(64), _older(_engine(32)))
    assert older is not None and older.field == "block" and older.message == (
        "block: local 64 vs remote 32 (a block-size remap needs token units on both engines: local token16, remote "
        "none)")
    units = refusal(dataclasses.replace(_engine(32), token_view=False), _engine(32, token_units=True).tag())
    assert units is not None and units.field == "units" and "local head vs remote token16" in units.message
    # Token units of different sizes (an existing config of blocks of 8 and one of 16) do not meet.
    eight = refusal(_engine(16, token_units=True), _engine(8, token_units=True).tag())
    assert eight is not None and eight.field == "block" and "local token16, remote token8" in eight.message
    # AMX blocks are cut in tiles of 16 tokens: a token view of 8-token units cannot meet one.
    amx = dataclasses.replace(_engine(32), memory=MEMORY_CPU_AMX)
    assert refusal(amx, dataclasses.replace(_engine(8), memory=MEMORY_CPU_AMX).tag()) is not None


class _Cache:
    def __init__(self, cache_id: int) -> None:
        self.cache_id = cache_id


def _pull(ours: KvLayout, theirs: KvLayout, tp: int = 1) -> tuple[Any, list[Any]]:
    pytest.importorskip("torch", reason="the connector's worker side needs torch (vLLM's KV tensors)")
    from kvbroker.integrations.vllm.worker import WorkerSide

    worker = WorkerSide(ConnectorConfig(target="unix:///nonexistent.sock", prefill_daemons="1=127.0.0.1:1"),
                        "engine", 0, ours)
    worker.cache, worker.view = _Cache(10), _Cache(11)  # type: ignore[assignment]
    remote = RemoteKv(1, Grant(bytes(16), bytes(32)), ((5, 6, 7, 8),), "p", "engine-p", theirs.tag(), 64, tp)
    planned = worker._items(PullSpec("r", (1, 2), (5, 6), remote, start_token=0, end_token=64))
    worker.cache = worker.view = None
    worker.shutdown()
    assert planned is not None
    return planned


def test_the_worker_pulls_into_its_cache_or_its_view_from_the_matching_slots() -> None:
    """Slots 0..P-1 of a grant are the prefill ranks' caches, P..2P-1 their token views."""
    addressed, items = _pull(_engine(32), _engine(32))
    assert not addressed.token_units and [(i.dst_cache, i.cache_slot) for i in items] == [(10, 0)]
    addressed, items = _pull(_engine(64), _engine(32, tp=2), tp=2)
    assert addressed.token_units and [(i.dst_cache, i.cache_slot) for i in items] == [(11, 2), (11, 3)]
    addressed, items = _pull(_engine(64), _engine(32, token_units=True))  # the prefill cache is in token units
    assert addressed.token_units and [(i.dst_cache, i.cache_slot) for i in items] == [(11, 0)]


def test_the_prefill_grant_covers_each_ranks_view_in_its_units(tmp_path: Any) -> None:
    from kvbroker._local import LocalDaemon

    layout = _engine(32, blocks=8)
    with LocalDaemon(tmp_path, 1) as daemon, daemon.client() as c:
        cache = c.allocate_cache(layout.desc())
        view = c.allocate_cache(layout.token_layout().desc(), view_of=cache)
        side = SchedulerSide(ConnectorConfig(target=daemon.target, hold_lease_s=60), "engine-p", 32)
        side.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", cache.cache_id, layout.tag(), view.cache_id)})
        req = FakeRequest("p-req", 64, {"do_remote_decode": True}, num_computed_tokens=64)
        delay, params = side.request_finished(req, [6, 7], finished_normally=True)
        assert delay and params is not None and "remap=token16" in params["kvbroker_layout_tag"]
        c.release_grant(Grant.from_token(params["kvbroker_grant"]))
        # A rank without a view (its daemon made none): no rank offers one, and the tag says so.
        side.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", cache.cache_id, layout.tag())})
        assert side.layout is not None and not side.layout.token_view
        assert "remap=-" in side.endpoints[0].layout_tag
        side.shutdown()


def test_a_daemon_that_makes_no_view_leaves_the_engine_without_remaps() -> None:
    """A daemon that predates views ignores `view_of` and allocates new memory: the worker sees that the "view" is
    not over its cache's memory, gives it back, and its tag offers no token view (remaps with it are refused by
    field, never pulled into memory vLLM does not read)."""
    pytest.importorskip("torch", reason="the connector's worker side needs torch (vLLM's KV tensors)")
    from kvbroker.integrations.vllm.worker import WorkerSide

    freed: list[int] = []
    cache = SimpleNamespace(cache_id=10, record=SimpleNamespace(tensors=("kvbroker-x-c10",)))
    elsewhere = SimpleNamespace(cache_id=11, record=SimpleNamespace(tensors=("kvbroker-x-c11",)))
    worker = WorkerSide(ConnectorConfig(target="unix:///nonexistent.sock"), "engine", 0, _engine(32))
    worker.client = SimpleNamespace(allocate_cache=lambda desc, view_of: elsewhere,  # type: ignore[assignment]
                                    deallocate_cache=lambda cache_id, timeout: freed.append(cache_id))
    worker.cache = cache  # type: ignore[assignment]
    worker._open_view()
    assert worker.view is None and freed == [11] and not worker.layout.token_view
    assert "remap=-" in worker.layout.tag()
    worker.client = SimpleNamespace(allocate_cache=lambda desc, view_of: SimpleNamespace(  # type: ignore[assignment]
        cache_id=12, record=SimpleNamespace(tensors=cache.record.tensors)))
    worker.layout = _engine(32)
    worker._open_view()
    assert worker.view is not None and worker.view.cache_id == 12 and worker.layout.token_view
    worker.loads.close()
