"""Adapter contract: the `hccl` backend against documented HIXL semantics.

HIXL needs CANN and an NPU, so these tests run two `HcclBackend`s in one process over
`hixl_contract_standin` (NOT HIXL: a stand-in that enforces the binding's documented rules and moves real bytes).
What they cannot show -- HCCS/RoCE behaviour, device memory, real status codes for undocumented cases -- is for
`tests/device/ascend_check.py` on Ascend hardware.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbroker.status import LlmError
from kvbroker.types import CacheDesc
from kvbrokerd.backends.hccl import backend as hccl_module
from kvbrokerd.backends.hccl.backend import HcclBackend, HcclChannel, HcclSettings, llm_status
from kvbrokerd.config import ConfigError, load
from kvbrokerd.dataplane.pairs import block_array
from kvbrokerd.dataplane.plan import Plan, Progress
from kvbrokerd.dataplane.seam import BackendUnusable, LocalContext, PeerInfo, RemoteCache
from kvbrokerd.errors import LlmStatus
from kvbrokerd.registry.caches import CacheEntry, Registry
from kvbrokerd.transfers.planner import LayerSelection, plan_blocks
from tests.contract import hixl_contract_standin as standin
from tests.helpers import wait_until

DESC = CacheDesc(num_tensors=2, shape=(8, 256))
SRC_BLOCKS, DST_BLOCKS = [1, 2, 7], [0, 5, 6]


@pytest.fixture
def hixl(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The stand-in installed as `hixl` and `acl`; every test ends with no contract breach on record."""
    standin.reset()
    monkeypatch.setitem(sys.modules, "hixl", standin)
    monkeypatch.setitem(sys.modules, "acl", standin.acl)
    yield standin
    assert standin.VIOLATIONS == []


@dataclass
class Node:
    registry: Registry
    backend: HcclBackend

    def cache(self, seed: int | None = None) -> CacheEntry:
        entry = self.registry.allocate(DESC)
        if seed is not None:
            for view in entry.views:
                np.frombuffer(view, np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, len(view), np.uint8)
                seed += 1
        return entry

    def describe(self, entry: CacheEntry) -> RemoteCache:
        """What a peer's GetCacheInfo gives it (the backend's part through describe_cache)."""
        return RemoteCache(entry.cache_id, entry.desc, entry.tensors,
                           backend_info={"hccl": asyncio.run(self.backend.describe_cache(entry))})


@pytest.fixture
def nodes(hixl: object, tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    executor = concurrent.futures.ThreadPoolExecutor(2)
    made: list[Node] = []
    for n in (1, 2):
        registry = Registry(tmp_path / f"shm{n}")
        registry.open()
        ctx = LocalContext(cluster_id=n, registry=registry, shm_dir=registry.shm_dir, peer_host="127.0.0.1",
                           parts_executor=executor, secret_for=lambda _: None)
        backend = HcclBackend(ctx, HcclSettings(device=n, engine=f"127.0.0.1:{26000 + n}"))
        asyncio.run(backend.start())
        made.append(Node(registry, backend))
    yield made[0], made[1]
    for node in made:
        node.backend.close()
        node.registry.close()
    executor.shutdown()


def link(src: Node, dst: Node) -> HcclChannel:
    channel = asyncio.run(dst.backend.connect(PeerInfo(1, "127.0.0.1:7100", b"k" * 32), src.backend.advertise()))
    assert isinstance(channel, HcclChannel)
    return channel


def blocks_plan(src: CacheEntry, dst: CacheEntry, s: list[int] = SRC_BLOCKS, d: list[int] = DST_BLOCKS) -> Plan:
    return plan_blocks(src.desc, dst.desc, block_array(s, "src"), block_array(d, "dst"), LayerSelection())


def tensors(entry: CacheEntry) -> list[np.ndarray]:
    return [np.frombuffer(v, np.uint8).reshape(DESC.num_blocks, -1).copy() for v in entry.views]


def pull(channel: HcclChannel, src_node: Node, src: CacheEntry, dst: CacheEntry, timeout: float = 5.0,
         remote: RemoteCache | None = None) -> Progress:
    plan = blocks_plan(src, dst)
    progress = Progress(plan)
    remote = remote or src_node.describe(src)
    assert channel.pull(remote, dst, plan, progress, time.monotonic() + timeout) == plan.total_bytes
    return progress


def assert_pulled(src: CacheEntry, dst: CacheEntry, before: list[np.ndarray]) -> None:
    """Every byte of the requested blocks came from the source; every other destination byte is as it was."""
    for s, d, b in zip(tensors(src), tensors(dst), before, strict=True):
        expected = b.copy()
        expected[DST_BLOCKS] = s[SRC_BLOCKS]
        assert np.array_equal(d, expected)


def engine_calls(name: str) -> list[tuple[str, str]]:
    return [(method, thread) for engine, method, thread in standin.CALLS if engine == name]


# -- data moves ----------------------------------------------------------------------------------------------------
def test_pull_reads_every_requested_byte_and_nothing_else(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    src, dst = a.cache(seed=1), b.cache(seed=100)
    before = tensors(dst)
    progress = pull(link(a, b), a, src, dst)
    assert_pulled(src, dst, before)
    assert len(progress.failed_dst_blocks()) == 0


def test_push_writes_every_requested_byte_and_nothing_else(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    local, target = b.cache(seed=7), a.cache(seed=200)
    before = tensors(target)
    plan = blocks_plan(local, target, SRC_BLOCKS, DST_BLOCKS)
    assert link(a, b).push(local, a.describe(target), plan, Progress(plan), time.monotonic() + 5) == plan.total_bytes
    assert_pulled(local, target, before)


def test_engine_is_initialised_with_the_pool_off_on_its_own_thread(nodes: tuple[Node, Node]) -> None:
    a, _ = nodes
    engine = standin.engine(a.backend.local_engine)
    assert engine.options == {"BufferPool": "0:0"}
    assert [t for _, t in standin.acl.rt.devices_set if t.startswith("kvbroker-hixl-npu1")]
    threads = {t for _, t in engine_calls(a.backend.local_engine)}
    assert len(threads) == 1 and threads.pop().startswith("kvbroker-hixl-npu1")


def test_operator_options_pass_through_but_the_pool_and_auto_connect_stay_ours(nodes: tuple[Node, Node]) -> None:
    config, _ = load(["--cluster-id", "1", "--insecure-peers", "--hccl-device", "3", "--hccl-engine", "10.0.0.5:27000",
                      "--hccl-options", json.dumps({"LocalCommRes": '{"version":"1.3"}'})], {})
    settings = config.settings_of("hccl")
    assert isinstance(settings, HcclSettings)
    assert (settings.device, settings.engine) == (3, "10.0.0.5:27000")
    assert settings.options == {"LocalCommRes": '{"version":"1.3"}'}
    for bad in ({"BufferPool": "4:8"}, {"AutoConnect": "1"}):
        with pytest.raises(ConfigError, match=r"backend.hccl.options: .* cannot be set"):
            load(["--cluster-id", "1", "--insecure-peers", "--hccl-options", json.dumps(bad)], {})
        ctx = dataclasses.replace(nodes[0].backend.ctx, settings=HcclSettings(device=9, options=bad))
        with pytest.raises(OSError, match="options"):  # settings that bypass the config are checked too
            asyncio.run(HcclBackend(ctx).start())
    assert sorted(standin.live_engines()) == sorted(n.backend.local_engine for n in nodes)  # none started


# -- register before connect: epochs and re-links ----------------------------------------------------------------------
def test_peer_registration_after_the_link_remakes_it(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    first, dst = a.cache(seed=1), b.cache(seed=2)
    pull(channel, a, first, dst)
    assert channel.connects == 1
    later = a.cache(seed=3)  # registered by describe_cache, after our link was made
    remote = a.describe(later)
    epoch = json.loads(remote.backend_info["hccl"])["epoch"]
    assert epoch > json.loads(a.describe(first).backend_info["hccl"])["epoch"]
    before = tensors(dst)
    pull(channel, a, later, dst, remote=remote)
    assert_pulled(later, dst, before)
    assert channel.connects == 2
    assert [m for m, _ in engine_calls(b.backend.local_engine)].count("disconnect") == 1


def test_local_registration_after_the_link_remakes_it(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src = a.cache(seed=1)
    pull(channel, a, src, b.cache())
    fresh = b.cache(seed=9)  # our destination, never registered before the link
    before = tensors(fresh)
    pull(channel, a, src, fresh)
    assert_pulled(src, fresh, before)
    assert channel.connects == 2


def test_a_link_that_already_sees_both_registrations_is_kept(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    src, dst = a.cache(seed=1), b.cache()
    a.describe(src)
    b.backend.registration(dst)
    channel = link(a, b)
    for _ in range(3):
        pull(channel, a, src, dst)
    assert channel.connects == 1


def test_transfers_from_many_threads_with_registrations_between_them(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src = a.cache(seed=5)
    remote = a.describe(src)
    dsts = [b.cache() for _ in range(16)]

    def one(dst: CacheEntry) -> None:
        before = tensors(dst)
        pull(channel, a, src, dst, remote=remote)
        assert_pulled(src, dst, before)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, dsts))
    assert channel.connects >= 2  # new destinations registered while others were in flight: drained and re-linked


# -- failures and their statuses -----------------------------------------------------------------------------------
def test_status_table() -> None:
    assert {code: llm_status(standin, code) for code in (
        standin.PARAM_INVALID, standin.TIMEOUT, standin.NOT_CONNECTED, standin.UNSUPPORTED,
        standin.RESOURCE_EXHAUSTED, standin.FAILED, 999)} == {
        103900: LlmStatus.LLM_PARAM_INVALID, 103901: LlmStatus.LLM_TIMEOUT, 103902: LlmStatus.LLM_LINK_FAILED,
        103905: LlmStatus.LLM_FEATURE_NOT_ENABLED, 203900: LlmStatus.LLM_OUT_OF_MEMORY, 503900: LlmStatus.LLM_FAILED,
        999: LlmStatus.LLM_FAILED}


@pytest.mark.parametrize(("code", "status"), [
    (standin.PARAM_INVALID, LlmStatus.LLM_PARAM_INVALID),
    (standin.TIMEOUT, LlmStatus.LLM_TIMEOUT),
    (standin.RESOURCE_EXHAUSTED, LlmStatus.LLM_OUT_OF_MEMORY),
    (standin.FAILED, LlmStatus.LLM_FAILED),
])
def test_refused_transfer_maps_its_status_and_reports_every_block_failed(
        nodes: tuple[Node, Node], code: int, status: LlmStatus) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache(seed=2)
    remote = a.describe(src)
    b.backend.registration(dst)
    before = tensors(dst)
    standin.FAULTS.transfer_return = code
    plan = blocks_plan(src, dst)
    progress = Progress(plan)
    with pytest.raises(LlmError) as err:
        channel.pull(remote, dst, plan, progress, time.monotonic() + 5)
    assert err.value.status == status and str(code) in err.value.message
    assert progress.failed_dst_blocks().tolist() == DST_BLOCKS
    assert all(np.array_equal(x, y) for x, y in zip(tensors(dst), before, strict=True))
    pull(channel, a, src, dst)  # the next transfer works


@pytest.mark.parametrize(("result", "status"), [
    (standin.TransferStatus.FAILED, LlmStatus.LLM_FAILED),
    (standin.TransferStatus.TIMEOUT, LlmStatus.LLM_TIMEOUT),
])
def test_failed_request_drops_the_link_and_the_next_transfer_relinks(
        nodes: tuple[Node, Node], result: standin.TransferStatus, status: LlmStatus) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache(seed=2)
    pull(channel, a, src, dst)
    standin.FAULTS.transfer_result = result
    with pytest.raises(LlmError) as err:
        pull(channel, a, src, dst)
    assert err.value.status == status
    before = tensors(dst)
    pull(channel, a, src, dst)
    assert channel.connects == 2
    assert_pulled(src, dst, before)


def test_deadline_abandons_the_request_and_nothing_lands_later(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache(seed=2)
    remote = a.describe(src)
    b.backend.registration(dst)
    before = tensors(dst)
    # The request would complete long after the deadline: a pull that waited for it would end with its bytes
    # instead of LLM_TIMEOUT.
    standin.FAULTS.transfer_delay_s = 30.0
    plan = blocks_plan(src, dst)
    progress = Progress(plan)
    with pytest.raises(LlmError) as err:
        channel.pull(remote, dst, plan, progress, time.monotonic() + 0.2)
    assert err.value.status == LlmStatus.LLM_TIMEOUT
    assert progress.failed_dst_blocks().tolist() == DST_BLOCKS
    assert all(np.array_equal(x, y) for x, y in zip(tensors(dst), before, strict=True))
    assert ("disconnect" in [m for m, _ in engine_calls(b.backend.local_engine)])
    # Nothing can land later: the abandoned request is over in the engine (a request moves bytes only while open).
    assert standin.engine(b.backend.local_engine).open_requests() == 0
    standin.FAULTS.transfer_delay_s = 0.0
    pull(channel, a, src, dst)


def test_cancelled_caller_stops_the_wait(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache()
    remote = a.describe(src)
    before = tensors(dst)
    # The request would complete long after the cancellation (and the deadline is longer still): a wait that did
    # not stop would end with the request's bytes landed.
    standin.FAULTS.transfer_delay_s = 30.0
    plan = blocks_plan(src, dst)
    progress = Progress(plan)
    threading.Timer(0.1, progress.cancel).start()
    with pytest.raises(LlmError, match="cancelled") as err:
        channel.pull(remote, dst, plan, progress, time.monotonic() + 60)
    assert err.value.status == LlmStatus.LLM_FAILED
    assert all(np.array_equal(x, y) for x, y in zip(tensors(dst), before, strict=True))
    assert standin.engine(b.backend.local_engine).open_requests() == 0  # abandoned, not waited out


def test_a_lost_link_is_made_again_once(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache()
    pull(channel, a, src, dst)
    standin.drop_links_to(a.backend.local_engine)
    pull(channel, a, src, dst)
    assert channel.connects == 2


def test_peer_engine_gone_is_a_link_failure(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache()
    remote = a.describe(src)
    pull(channel, a, src, dst, remote=remote)
    a.backend.close()
    with pytest.raises(LlmError) as err:
        pull(channel, a, src, dst, remote=remote)
    assert err.value.status == LlmStatus.LLM_LINK_FAILED and a.backend.local_engine in err.value.message


def test_without_async_transfers_a_bounded_sync_transfer_is_used(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    standin.FAULTS.async_unsupported = True
    src, dst = a.cache(seed=1), b.cache(seed=2)
    before = tensors(dst)
    pull(link(a, b), a, src, dst)
    assert_pulled(src, dst, before)
    assert "transfer_sync" in [m for m, _ in engine_calls(b.backend.local_engine)]


def test_registration_refused_by_the_peer_reaches_the_puller(nodes: tuple[Node, Node],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    monkeypatch.setattr(standin, "MAX_REGISTRATIONS", 0)
    remote = a.describe(a.cache())
    with pytest.raises(LlmError) as err:
        pull(link(a, b), a, a.cache(), b.cache(), remote=remote)
    assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY and "RESOURCE_EXHAUSTED (203900)" in err.value.message


@pytest.mark.parametrize(("info", "status"), [
    (None, LlmStatus.LLM_FEATURE_NOT_ENABLED),
    (b"not json", LlmStatus.LLM_LINK_FAILED),
    (json.dumps({"engine": "127.0.0.1:26001", "epoch": 1, "addresses": [4096]}).encode(), LlmStatus.LLM_LINK_FAILED),
    (json.dumps({"engine": "127.0.0.1:26001", "epoch": 1, "addresses": [4096, 2**64 - 1]}).encode(),
     LlmStatus.LLM_LINK_FAILED),
    (json.dumps({"engine": "127.0.0.1:9", "epoch": 1, "addresses": [4096, 8192], "live": 64, "token": 1}).encode(),
     LlmStatus.LLM_LINK_FAILED),
    (json.dumps({"engine": "127.0.0.1:26001", "epoch": 1, "addresses": [4096, 8192], "live": 0, "token": 1}).encode(),
     LlmStatus.LLM_LINK_FAILED),
    (json.dumps({"error": "refused", "status": 0}).encode(), LlmStatus.LLM_FAILED),
])
def test_malformed_cache_descriptions_fail_that_transfer(nodes: tuple[Node, Node], info: bytes | None,
                                                         status: LlmStatus) -> None:
    a, b = nodes
    src = a.cache()
    remote = RemoteCache(src.cache_id, src.desc, src.tensors, backend_info={} if info is None else {"hccl": info})
    with pytest.raises(LlmError) as err:
        pull(link(a, b), a, src, b.cache(), remote=remote)
    assert err.value.status == status


@pytest.mark.parametrize("advert", [
    b"{", b'{"v": 1}', b'{"v": 2, "engine": "127.0.0.1:26001", "epoch": 0}',
    b'{"v": 1, "engine": "peer.example:26001", "epoch": 0}', b'{"v": 1, "engine": "0.0.0.0:26001", "epoch": 0}',
    b'{"v": 1, "engine": "127.0.0.1:26002", "epoch": 0}',  # our own engine
    b'{"v": 1, "engine": "127.0.0.1:26001", "epoch": -1}',
])
def test_unusable_advertisements_are_refused(nodes: tuple[Node, Node], advert: bytes) -> None:
    _, b = nodes
    with pytest.raises(BackendUnusable):
        asyncio.run(b.backend.connect(PeerInfo(1, "127.0.0.1:7100", b"k" * 32), advert))


# -- registration lifetime and tear-down ----------------------------------------------------------------------------
def test_forgotten_and_removed_caches_are_deregistered(nodes: tuple[Node, Node]) -> None:
    a, _ = nodes
    kept, forgotten, removed = a.cache(), a.cache(), a.cache()
    for entry in (kept, forgotten, removed):
        a.describe(entry)
    assert a.backend.live is not None
    words = a.backend.live.address

    def cache_regions() -> set[int]:
        return {r.addr for r in standin.engine(a.backend.local_engine)._regions.values()} - {words}

    assert len(cache_regions()) == 3
    a.backend.forget_cache(forgotten)
    asyncio.run(a.registry.remove(removed.cache_id, daemon_owned=True))
    a.describe(a.cache())  # a new registration first drops what a removed cache left behind
    assert len(cache_regions()) == 2 and kept.addresses[0] in cache_regions()
    assert [m for m, _ in engine_calls(a.backend.local_engine)].count("deregister_mem") == 2


def test_close_disconnects_deregisters_and_finalises_on_the_engine_thread(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache()
    remote = a.describe(src)
    pull(channel, a, src, dst, remote=remote)
    name = b.backend.local_engine
    standin.CALLS.clear()
    b.backend.close()
    b.backend.close()
    methods = [m for m, _ in engine_calls(name)]
    assert methods == ["disconnect", "deregister_mem", "deregister_mem", "finalize"]  # the cache, the live words
    assert {t for _, t in engine_calls(name)} == {t for _, t in standin.acl.rt.devices_reset}
    assert not b.backend.serving
    with pytest.raises(LlmError) as err:
        pull(channel, a, src, dst, remote=remote)
    assert err.value.status == LlmStatus.LLM_NOT_YET_LINK


def test_unavailable_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hixl", None)
    reason = HcclBackend.unavailable()
    assert reason is not None and "CANN >= 9.0" in reason and "docs/ascend.md" in reason
    monkeypatch.setitem(sys.modules, "hixl", standin)
    monkeypatch.setitem(sys.modules, "acl", None)
    reason = HcclBackend.unavailable()
    assert reason is not None and "pyACL" in reason
    monkeypatch.setitem(sys.modules, "acl", standin.acl)
    assert HcclBackend.unavailable() is None


# -- the stand-in enforces what the tests above rely on ----------------------------------------------------------------
def _raw_engine(name: str) -> standin.Hixl:
    standin.acl.rt.set_device(0)
    engine = standin.Hixl()
    assert engine.initialize(name, {"BufferPool": "0:0"}) == standin.SUCCESS
    return engine


def test_standin_refuses_memory_registered_after_the_link(hixl: object) -> None:
    src, dst = bytearray(b"x" * 64), bytearray(64)
    a, b = _raw_engine("127.0.0.1:1"), _raw_engine("127.0.0.1:2")
    src_addr = np.frombuffer(src, np.uint8).ctypes.data
    dst_addr = np.frombuffer(dst, np.uint8).ctypes.data
    assert a.register_mem(standin.MemDesc(src_addr, 64), standin.MEM_HOST)[0] == standin.SUCCESS
    assert b.connect("127.0.0.1:1") == standin.SUCCESS
    assert b.register_mem(standin.MemDesc(dst_addr, 64), standin.MEM_HOST)[0] == standin.SUCCESS
    op = [standin.TransferOpDesc(dst_addr, src_addr, 64)]
    assert b.transfer_sync("127.0.0.1:1", standin.READ, op) == standin.PARAM_INVALID
    assert b.disconnect("127.0.0.1:1") == standin.SUCCESS and b.connect("127.0.0.1:1") == standin.SUCCESS
    ret, req = b.transfer_async("127.0.0.1:1", standin.READ, op)
    assert ret == standin.SUCCESS
    assert b.get_transfer_status(req) == (standin.SUCCESS, standin.TransferStatus.COMPLETED) and dst == src
    assert b.get_transfer_status(req)[0] == standin.PARAM_INVALID  # a finished request is freed
    assert b.transfer_sync("127.0.0.1:3", standin.READ, op) == standin.NOT_CONNECTED
    assert b.connect("127.0.0.1:3") == standin.FAILED


def test_standin_stages_unregistered_memory_only_with_the_pool_on(hixl: object) -> None:
    src, dst = bytearray(b"y" * 64), bytearray(64)
    standin.acl.rt.set_device(0)
    pooled = standin.Hixl()
    assert pooled.initialize("127.0.0.1:4") == standin.SUCCESS  # HIXL's default pool "4:8"
    strict = _raw_engine("127.0.0.1:5")
    _raw_engine("127.0.0.1:6")
    assert pooled.connect("127.0.0.1:6") == standin.SUCCESS and strict.connect("127.0.0.1:6") == standin.SUCCESS
    op = [standin.TransferOpDesc(np.frombuffer(dst, np.uint8).ctypes.data, np.frombuffer(src, np.uint8).ctypes.data,
                                 64)]
    assert strict.transfer_sync("127.0.0.1:6", standin.READ, op) == standin.PARAM_INVALID and dst == bytearray(64)
    assert pooled.transfer_sync("127.0.0.1:6", standin.READ, op) == standin.SUCCESS and pooled.staged == 1


def test_standin_fails_calls_from_another_thread(hixl: object) -> None:
    engine = _raw_engine("127.0.0.1:7")
    results: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: results.append(engine.register_mem(standin.MemDesc(4096, 64),
                                                                                standin.MEM_HOST)))
    thread.start()
    thread.join()
    assert results[0][0] == standin.FAILED and len(standin.VIOLATIONS) == 1
    standin.VIOLATIONS.clear()


def test_module_finds_hixl_by_import_only() -> None:
    for module in Path(hccl_module.__file__).parent.glob("hccl*.py"):
        assert "standin" not in module.read_text()  # production code names no test double


def test_daemon_without_hixl_refuses_the_backend_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hixl", None)
    with pytest.raises(ConfigError, match=r"backends: hccl needs CANN >= 9.0 .*docs/ascend.md"):
        load(["--cluster-id", "1", "--backends", "hccl,tcp", "--insecure-peers"], environ={})


def test_a_timeout_abandons_the_links_other_requests_with_a_clear_error(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, slow_dst, other_dst = a.cache(seed=1), b.cache(), b.cache()
    remote = a.describe(src)
    pull(channel, a, src, slow_dst, remote=remote)
    pull(channel, a, src, other_dst, remote=remote)
    standin.FAULTS.transfer_delay_s = 30.0  # neither request completes: the patient one ends with the link
    errors: dict[str, LlmError] = {}

    def attempt(name: str, dst: CacheEntry, timeout: float) -> None:
        try:
            pull(channel, a, src, dst, timeout=timeout, remote=remote)
        except LlmError as e:
            errors[name] = e

    patient = threading.Thread(target=attempt, args=("patient", other_dst, 5.0))
    patient.start()
    engine = standin.engine(b.backend.local_engine)
    wait_until(lambda: engine.open_requests() == 1, what="the patient pull's request posted")
    attempt("hasty", slow_dst, 0.2)
    patient.join()
    assert errors["hasty"].status == LlmStatus.LLM_TIMEOUT
    assert errors["patient"].status == LlmStatus.LLM_FAILED and "abandoned with its link" in errors["patient"].message
    standin.FAULTS.transfer_delay_s = 0.0
    pull(channel, a, src, other_dst, remote=remote)


def test_a_remake_is_not_starved_by_a_stream_of_transfers(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src = a.cache(seed=1)
    remote = a.describe(src)
    streams = [b.cache() for _ in range(3)]
    for dst in streams:
        b.backend.registration(dst)
    pull(channel, a, src, streams[0], remote=remote)
    standin.FAULTS.transfer_delay_s = 0.03
    stop = threading.Event()

    def stream(dst: CacheEntry) -> None:
        while not stop.is_set():
            pull(channel, a, src, dst, remote=remote)

    threads = [threading.Thread(target=stream, args=(dst,)) for dst in streams]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.01 * (i + 1))  # the scenario, not a wait: streams that start staggered keep the link busy
    try:
        fresh = b.cache(seed=4)  # needs a new link while the old one is never idle
        pull(channel, a, src, fresh, timeout=1.0, remote=remote)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert channel.connects == 2


def test_a_slow_link_set_up_never_blocks_the_engine_thread(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache(seed=2)
    remote = a.describe(src)
    b.backend.registration(dst)
    standin.FAULTS.links_held = made = threading.Event()  # the link is made when the test says so
    before = tensors(dst)
    puller = threading.Thread(target=pull, args=(channel, a, src, dst), kwargs={"remote": remote})
    puller.start()
    engine = standin.engine(b.backend.local_engine)
    wait_until(engine.links_being_made, what="the puller's link being set up")
    b.describe(b.cache())  # a registration on the engine thread (the event loop's describe_cache) meanwhile
    assert engine.links_being_made(), "the registration waited for the link set-up to end"
    made.set()
    puller.join()
    assert_pulled(src, dst, before)
    assert "connect_async" in [m for m, _ in engine_calls(b.backend.local_engine)]


def test_without_async_links_a_bounded_connect_is_used(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    standin.FAULTS.connect_async_unsupported = True
    src, dst = a.cache(seed=1), b.cache(seed=2)
    before = tensors(dst)
    pull(link(a, b), a, src, dst)
    assert_pulled(src, dst, before)
    assert "connect" in [m for m, _ in engine_calls(b.backend.local_engine)]


def test_a_link_not_made_before_the_deadline_is_a_timeout_and_is_abandoned(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache()
    remote = a.describe(src)
    # The link is never made. A pull that outwaited its deadline would see HIXL give up on the link (a little after
    # the timeout kvbroker passes) and fail with LLM_LINK_FAILED, not end with its own LLM_TIMEOUT.
    standin.FAULTS.links_held = threading.Event()
    with pytest.raises(LlmError) as err:
        pull(channel, a, src, dst, timeout=0.3, remote=remote)
    assert err.value.status == LlmStatus.LLM_TIMEOUT
    assert [m for m, _ in engine_calls(b.backend.local_engine)][-1] == "disconnect"  # the pending link is dropped
    standin.FAULTS.links_held = None
    pull(channel, a, src, dst, remote=remote)


# -- liveness: one-sided transfers never use a removed cache's description ---------------------------------------------
def test_a_stale_description_never_reads_memory_registered_again(nodes: tuple[Node, Node]) -> None:
    """The source forgets a cache and registers memory at the same address again (what a new cache placed where a
    removed one was looks like); a puller holding the old description re-links for the new registration and must
    not read through the old one."""
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache(seed=2)
    stale = a.describe(src)
    pull(channel, a, src, dst, remote=stale)
    a.backend.forget_cache(src)
    fresh = a.describe(src)  # registered again: same addresses, new epoch, new token
    pull(channel, a, src, dst, remote=fresh)  # the puller re-links to see the new registration
    plan = blocks_plan(src, dst)
    progress = Progress(plan)
    with pytest.raises(LlmError) as err:
        channel.pull(stale, dst, plan, progress, time.monotonic() + 5)
    assert err.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
    assert channel.connects == 2  # the re-link happened, so HIXL itself served the bytes: only the word says no
    assert progress.failed_dst_blocks().tolist() == DST_BLOCKS


def test_a_push_never_writes_through_a_stale_description(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    local, target = b.cache(seed=3), a.cache(seed=4)
    stale = a.describe(target)
    a.backend.forget_cache(target)
    a.describe(target)
    before = tensors(target)
    plan = blocks_plan(local, target)
    with pytest.raises(LlmError) as err:
        channel.push(local, stale, plan, Progress(plan), time.monotonic() + 5)
    assert err.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
    assert all(np.array_equal(x, y) for x, y in zip(tensors(target), before, strict=True))


def test_a_cache_removed_during_a_pull_fails_it_whole(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    channel = link(a, b)
    src, dst = a.cache(seed=1), b.cache()
    remote = a.describe(src)
    b.backend.registration(dst)
    standin.FAULTS.transfer_delay_s = 0.3
    threading.Timer(0.1, a.backend.forget_cache, args=(src,)).start()
    plan = blocks_plan(src, dst)
    progress = Progress(plan)
    with pytest.raises(LlmError) as err:
        channel.pull(remote, dst, plan, progress, time.monotonic() + 5)
    assert err.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
    assert progress.failed_dst_blocks().tolist() == DST_BLOCKS
