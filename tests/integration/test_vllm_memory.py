"""The vLLM connector without vLLM, against real daemons: the buffer vLLM would allocate is daemon memory, pulls
between two such buffers land in place (one tensor per layer), the memory goes back to the daemon when its engine
dies, and the decode worker links on first use, relinks to a restarted prefill daemon and reports failed blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

# The connector's worker side and the buffer vLLM would allocate are torch tensors.
pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

import torch

from kvbroker import CacheIndex, Client, Grant, KvCacheExtParam
from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.layout import KvLayout
from kvbroker.integrations.vllm.memory import DaemonKvAllocation
from kvbroker.integrations.vllm.params import PullSpec, RemoteKv
from kvbroker.integrations.vllm.worker import WorkerSide
from kvbroker.shm import Cache
from tests.helpers import wait_until

LAYOUT = KvLayout(num_layers=3, num_blocks=8, block_size=32, num_kv_heads=1, head_size=64, dtype="float32",
                  page_bytes=32 * 128 * 4, model_id="m", tp_size=1)


def _layer_views(buffer: torch.Tensor) -> list[torch.Tensor]:
    """What vLLM's CPU attention does with the buffer: one [blocks, heads, block_size, 2*head] view per layer."""
    per_layer = LAYOUT.num_blocks * LAYOUT.page_bytes
    return [buffer[i * per_layer:(i + 1) * per_layer].view(torch.float32).view(LAYOUT.num_blocks, 1, 32, 128)
            for i in range(LAYOUT.num_layers)]


def _allocate(daemon: LocalDaemon, lease_ttl: float = 30.0) -> tuple[DaemonKvAllocation, torch.Tensor, Client]:
    client = daemon.client(lease_ttl=lease_ttl)
    alloc = DaemonKvAllocation(LAYOUT, lambda: client.allocate_cache(LAYOUT.desc()))
    with alloc:
        buffer = torch.zeros(LAYOUT.buffer_bytes, dtype=torch.int8, device="cpu")
        unrelated = torch.zeros(LAYOUT.buffer_bytes, dtype=torch.float32)
    assert alloc.cache is not None and buffer is alloc.buffer
    assert unrelated.data_ptr() != buffer.data_ptr()
    return alloc, buffer, client


def test_kv_buffer_is_daemon_memory_and_pulls_land_in_place(linked_pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    src_daemon, dst_daemon = linked_pair
    src, src_buf, src_client = _allocate(src_daemon)
    dst, dst_buf, dst_client = _allocate(dst_daemon)
    try:
        assert src.cache is not None and dst.cache is not None
        assert not torch.count_nonzero(src_buf)  # vLLM asked for zeros
        src_layers, dst_layers = _layer_views(src_buf), _layer_views(dst_buf)
        for i, layer in enumerate(src_layers):
            layer[2].fill_(i + 1.5)
            layer[5].fill_(-(i + 1.0))
        # The daemon sees the engine's writes without a copy: its own mapping of the cache holds them.
        with src_daemon.client() as c:
            record = next(r for r in c.list_caches() if r.cache_id == src.cache.cache_id)
        view = Cache.map(record)
        assert float(view.tensors[1].reshape(LAYOUT.num_blocks, -1)[2][0]) == 2.5
        view.close()
        # The daemon addresses units of a block (a few tokens of one head's K or V): blocks 2 and 5 are units
        # [8, 12) and [20, 24).
        per = LAYOUT.units_per_block
        src_units = [*range(2 * per, 3 * per), *range(5 * per, 6 * per)]
        dst_units = [*range(7 * per, 8 * per), *range(0, per)]
        dst_client.pull_kv_blocks(CacheIndex(src_daemon.cluster_id, src.cache.cache_id),
                                  dst.cache.cache_id, src_units, dst_units, KvCacheExtParam(tensor_num_per_layer=1))
        for i, layer in enumerate(dst_layers):
            assert torch.equal(layer[7], src_layers[i][2]) and torch.equal(layer[0], src_layers[i][5])
            assert not torch.count_nonzero(layer[1:7])
    finally:
        src_client.close()
        dst_client.close()
        for daemon, alloc in ((src_daemon, src), (dst_daemon, dst)):
            with daemon.client() as c:
                assert alloc.cache is not None
                c.deallocate_cache(alloc.cache.cache_id)


def test_kv_memory_of_a_dead_engine_returns_to_the_daemon(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1) as daemon:
        alloc, _, client = _allocate(daemon, lease_ttl=1.0)
        client.close()  # stops renewing the lease, as a dead engine does
        with daemon.client() as c:
            wait_until(lambda: not c.list_caches(), what="the lease releasing the KV memory")
        assert alloc.cache is not None
        record = alloc.cache.record
        assert not (Path(record.shm_dir) / record.tensors[0].segment).exists()



def _pull_spec(request_id: str, src: LocalDaemon, cache_id: int, src_blocks: list[int], dst_blocks: list[int]
               ) -> PullSpec:
    with src.client() as c:
        grant = c.create_grant([cache_id], src_blocks, 60.0)
    remote = RemoteKv(cluster_id=src.cluster_id, grant=grant, block_ids=(tuple(src_blocks),),
                      request_id=f"p-{request_id}", engine_id="engine-p", layout_tag=LAYOUT.tag(),
                      num_tokens=len(src_blocks) * 32, tp_size=1)
    return PullSpec(request_id, tuple(dst_blocks), tuple(src_blocks), remote)


def _finish(worker: WorkerSide, request_id: str) -> set[int]:
    wait_until(lambda: request_id in worker.finished()[1], timeout=30, poll=0.02, what=f"pull {request_id} finished")
    return worker.take_load_errors()


def test_decode_worker_links_on_first_use_and_relinks_to_a_restarted_prefill_daemon(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 2) as d_daemon:
        worker = WorkerSide(ConnectorConfig(target=d_daemon.target, link_timeout_s=3), "engine-d", 0, LAYOUT)
        with worker.allocation_context():
            buffer = torch.zeros(LAYOUT.buffer_bytes, dtype=torch.int8)
        layers = _layer_views(buffer)
        worker.register({f"layer{i}": t for i, t in enumerate(layers)})
        try:
            for attempt in range(2):  # the second prefill daemon is the first one restarted, on another port
                with LocalDaemon(tmp_path, 1) as p_daemon, p_daemon.client() as p:
                    worker.links.trusted[1] = p_daemon.peer_address  # its new address, as the operator configures it
                    src = p.allocate_cache(LAYOUT.desc())
                    src.tensors[0].reshape(LAYOUT.num_blocks, -1)[3] = 7.0 + attempt
                    assert _finish(worker, worker_pull(worker, p_daemon, src.cache_id, attempt)) == set()
                    assert float(layers[0][4].reshape(-1)[0]) == 7.0 + attempt
                with d_daemon.client() as d:
                    assert len(d.list_links()) == 1
            # A prefill daemon nobody can reach: every block is reported, so that vLLM recomputes them.
            remote = RemoteKv(cluster_id=1, grant=Grant(bytes(16), bytes(32)), block_ids=((3, 5),), request_id="p-gone",
                              engine_id="engine-p", layout_tag=LAYOUT.tag(), num_tokens=64, tp_size=1)
            worker.start([PullSpec("gone", (4, 6), (3, 5), remote)], {})
            assert _finish(worker, "gone") == {4, 6}
        finally:
            worker.shutdown()


def worker_pull(worker: WorkerSide, p_daemon: LocalDaemon, cache_id: int, attempt: int) -> str:
    request_id = f"d-{attempt}"
    worker.start([_pull_spec(request_id, p_daemon, cache_id, [3], [4])], {})
    return request_id
