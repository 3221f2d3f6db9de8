"""The connector's GPU-engine modes against real daemons, on a machine without a GPU.

- Host-staged: CPU TENSORS STAND IN FOR DEVICE TENSORS (vLLM-shaped per-layer views of one buffer). What is real:
  the daemon-allocated host buffers, the pull between two daemons, the run bookkeeping (which blocks of which run
  are copied when), and every byte compared. What is not: CUDA streams, pinning and device copies (on a GPU the same
  code runs the copies on a side stream: tests/device/cuda_check.py).
- Device-direct: REGISTRATION BOOKKEEPING ONLY, through tests/fakecuda.py: one IPC handle for vLLM's whole buffer,
  one daemon-side open of it for every run, the refusal closes it again and names the way out. The "device" memory
  is host memory, so the real NIXL refuses it as VRAM, as it should.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

import torch

from kvbroker._local import LocalDaemon
from kvbroker.device import ExportedAllocation, raw_locations
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.gpu import HOST_STAGED, HostStaged, mode_for, open_gpu_kv
from kvbroker.integrations.vllm.layout import KvLayout, UnsupportedLayoutError
from kvbroker.integrations.vllm.params import PullSpec, RemoteKv
from kvbroker.integrations.vllm.worker import WorkerSide
from tests.fakecuda import GPU0
from tests.helpers import wait_until

L, B, H, N, C = 3, 8, 2, 16, 64
LAYOUT = KvLayout(num_layers=L, num_blocks=B, block_size=N, num_kv_heads=H, head_size=C // 2, dtype="bfloat16",
                  page_bytes=H * N * C * 2, model_id="m", tp_size=1)


def _views(order: str = "LHBNC") -> dict[str, torch.Tensor]:
    """Stand-ins for a GPU worker's [B, H, N, C] views (physical order `order`), on the CPU."""
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C}
    strides, acc = {}, 1
    for d in reversed(order):
        strides[d] = acc
        acc *= sizes[d]
    flat = torch.zeros(acc, dtype=torch.bfloat16)
    return {f"model.layers.{i}.attn": torch.as_strided(flat, (B, H, N, C), tuple(strides[d] for d in "BHNC"),
                                                       i * strides["L"]) for i in range(L)}


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    with LocalDaemon(tmp_path, 1) as p, LocalDaemon(tmp_path, 2) as d:
        yield p, d


def _worker(daemon: LocalDaemon, engine: str, prefill: LocalDaemon | None = None) -> WorkerSide:
    """A worker of `daemon`; a decode one (`prefill` given) trusts that prefill daemon (kvbroker_prefill_daemons)."""
    trusted = f"{prefill.cluster_id}={prefill.peer_address}" if prefill is not None else ""
    return WorkerSide(ConnectorConfig(target=daemon.target, prefill_daemons=trusted), engine, 0, LAYOUT)


def _remote(p_daemon: LocalDaemon, prefill: WorkerSide, blocks: tuple[int, ...], request_id: str,
            num_tokens: int) -> RemoteKv:
    """What the prefill node's params carry: a grant of `blocks` of its cache, made by its own daemon."""
    assert prefill.cache is not None
    with p_daemon.client() as c:
        grant = c.create_grant([prefill.cache.cache_id], list(blocks), 60.0)
    return RemoteKv(cluster_id=p_daemon.cluster_id, grant=grant, block_ids=(blocks,), request_id=request_id,
                    engine_id="engine-p", layout_tag=prefill.layout.tag(), num_tokens=num_tokens, tp_size=1)


@pytest.mark.parametrize("order", ["LHBNC", "LBNHC", "BLHNC"])
def test_host_staged_prefill_stages_decode_pulls_and_copies_in(pair: tuple[LocalDaemon, LocalDaemon],
                                                               order: str) -> None:
    """CPU stand-ins for device tensors. Prefill: the blocks a step wrote reach the host buffer once every layer of
    a run has written (not before), and all of them by wait_for_save; decode: after the pull the blocks are in its
    (stand-in) device views, every byte equal, other blocks untouched."""
    p_daemon, d_daemon = pair
    prefill, decode = _worker(p_daemon, "engine-p"), _worker(d_daemon, "engine-d", p_daemon)
    p_views, d_views = _views(order), _views(order)
    try:
        prefill.register_gpu(p_views, HOST_STAGED, order, saves=True)
        decode.register_gpu(d_views, HOST_STAGED, order, saves=False)
        staged = prefill.gpu
        assert isinstance(staged, HostStaged) and prefill.layout.tag() == decode.layout.tag()
        assert f"phys={order}:" in prefill.layout.tag()
        gen = torch.Generator().manual_seed(7)
        for t in p_views.values():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))
        names = list(p_views)
        # vLLM's attention metadata: slot = block * block_size + offset; -1 pads (a stand-in object, not vLLM's).
        meta = SimpleNamespace(slot_mapping=torch.tensor([2 * N, 2 * N + 1, 5 * N + 3, 6 * N, -1]))
        for name in names[:-1]:
            staged.save_from_metadata(name, meta, N)
        if order.startswith("B"):  # one run holds every layer: nothing is copied before the last layer is done
            assert not any(bool(h.any()) for h in staged.host)
        staged.save_from_metadata(names[-1], meta, N)
        staged.wait_for_save()
        assert all(not bool(h[[0, 1, 3, 4, 7]].any()) for h in staged.host)  # only the written blocks
        assert prefill.cache is not None and decode.cache is not None

        remote = _remote(p_daemon, prefill, (2, 5, 6), "p-1", 3 * N)
        decode.start([PullSpec("d-1", (4, 0, 7), (2, 5, 6), remote)], {})
        wait_until(lambda: "d-1" in decode.finished()[1], timeout=30, poll=0.02, what="pull d-1 finished")
        assert decode.take_load_errors() == set()
        for name in names:
            assert torch.equal(d_views[name][[4, 0, 7]], p_views[name][[2, 5, 6]])
            assert not bool(d_views[name][[1, 2, 3, 5, 6]].view(torch.int16).any())
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_mismatched_physical_layouts_are_not_pulled(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    """Two GPU engines whose vLLM resolved different KV cache layouts: same runs, different byte order inside a
    block; the tags differ, so the decode node recomputes instead of reading permuted KV."""
    p_daemon, d_daemon = pair
    prefill, decode = _worker(p_daemon, "engine-p"), _worker(d_daemon, "engine-d", p_daemon)
    try:
        prefill.register_gpu(_views("LBNHC"), HOST_STAGED, "LBNHC")
        decode.register_gpu(_views("LBHNC"), HOST_STAGED, "LBHNC", saves=False)
        assert prefill.cache is not None
        remote = _remote(p_daemon, prefill, (1,), "p-2", N)
        decode.start([PullSpec("d-2", (3,), (1,), remote)], {})
        wait_until(lambda: "d-2" in decode.finished()[1], timeout=30, poll=0.02, what="pull d-2 finished")
        assert decode.take_load_errors() == {3}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_gpu_modes_refuse_at_start_up_with_the_reason(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    assert mode_for("cuda") == "device" and mode_for("cpu") == "host"
    with pytest.raises(ValueError, match="kv_buffer_device='xpu'"):
        mode_for("xpu")
    worker = _worker(pair[0], "engine-p")
    try:
        with pytest.raises(UnsupportedLayoutError, match="has not resolved its KV cache layout"):
            worker.register_gpu(_views(), HOST_STAGED, None)
        padded = {k: t[:, :, :8] for k, t in _views("LBNHC").items()}
        with pytest.raises(UnsupportedLayoutError, match="interleave"):
            worker.register_gpu(padded, HOST_STAGED, "LBNHC")
        assert worker.cache is None
        with worker.client as c:
            assert c.list_caches() == []  # refused before anything was allocated
    finally:
        worker.shutdown()


def test_host_staged_without_a_slot_mapping_fails_loudly(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    """A stale host buffer would hand decode nodes wrong KV: no slot mapping, no silent skip."""
    worker = _worker(pair[0], "engine-p")
    try:
        worker.register_gpu(_views(), HOST_STAGED, "LHBNC")
        assert isinstance(worker.gpu, HostStaged)
        with pytest.raises(RuntimeError, match="no slot_mapping"):
            worker.gpu.save_from_metadata("model.layers.0.attn", SimpleNamespace(), N)
    finally:
        worker.shutdown()


@pytest.fixture(scope="module")
def fake_cuda_nixl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, Path]]:
    """A nixl daemon whose CUDA runtime is tests/fakecuda.py (BOOKKEEPING ONLY: "device" memory is host memory)."""
    from kvbrokerd.backends import unavailable

    if unavailable("nixl") is not None:
        pytest.skip(str(unavailable("nixl")))
    work = tmp_path_factory.mktemp("gpufake")
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("from tests.fakecuda import install\ninstall()\n")
    root = Path(__file__).resolve().parents[2]
    calls = work / "cuda_calls.jsonl"
    env = {"PYTHONPATH": f"{site}:{root / 'client'}:{root / 'server'}:{root}", "KVBROKER_FAKE_CUDA_LOG": str(calls)}
    with LocalDaemon(work, 44, backends=("nixl",), env=env) as d:
        yield d, calls


def test_bookkeeping_device_direct_registers_every_run_under_one_handle(
        fake_cuda_nixl: tuple[LocalDaemon, Path]) -> None:
    """BOOKKEEPING ONLY (fake CUDA): every run of vLLM's buffer is one tensor of one registration, named by the ONE
    IPC handle of the buffer's allocation and the run's offset; the daemon opens that handle once, NIXL refuses host
    memory as VRAM, the mapping is closed again, and the start-up error says what to do."""
    daemon, calls = fake_cuda_nixl
    views = _views("LHBNC")
    storage = next(iter(views.values())).untyped_storage()
    allocation = ExportedAllocation("cuda", f"GPU-{GPU0}", b"RUNS" * 16, storage.data_ptr(), storage.nbytes())
    sent: list[object] = []

    def exporter(tensors: list[torch.Tensor]) -> list[object]:
        locations = raw_locations([(t.data_ptr(), t.numel(), allocation.device) for t in tensors], [allocation])
        sent.extend(locations)
        return locations  # type: ignore[return-value]

    with daemon.client() as client:
        with pytest.raises(RuntimeError) as info:
            open_gpu_kv(client, views, LAYOUT, "device", "LHBNC", exporter=exporter)  # type: ignore[arg-type]
        message = str(info.value)
        assert "device-direct" in message and "NIXL" in message and 'kv_buffer_device="cpu"' in message
        assert client.list_caches() == []
    per_run = B * N * C * 2
    assert [loc.offset for loc in sent] == [i * per_run for i in range(L * H)]  # type: ignore[attr-defined]
    assert {loc.device.ipc_handle for loc in sent} == {b"RUNS" * 16}  # type: ignore[attr-defined]
    log = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c[1] for c in log if c[0] == "open"] == ["RUNS"] and [c[1] for c in log if c[0] == "close"] == ["RUNS"]


def test_device_direct_on_a_daemon_without_nixl_says_which_backend(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    views = _views("LBNHC")
    storage = next(iter(views.values())).untyped_storage()
    allocation = ExportedAllocation("cuda", f"GPU-{GPU0}", b"H" * 64, storage.data_ptr(), storage.nbytes())
    with pair[0].client() as client, pytest.raises(RuntimeError, match="--backends nixl"):
        open_gpu_kv(client, views, LAYOUT, "device", "LBNHC", exporter=lambda ts: raw_locations(
            [(t.data_ptr(), t.numel(), allocation.device) for t in ts], [allocation]))


def test_device_direct_refuses_memory_it_cannot_export_before_registering(
        pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    """Without an exporter the connector exports through torch (`kvbroker.device.torch_locations`), which refuses
    what legacy CUDA IPC cannot export (here: CPU memory; on a GPU: VMM memory) before anything reaches the daemon,
    and the error names the host-staged way out."""
    with pair[0].client() as client:
        with pytest.raises(RuntimeError, match=r'cannot export .*kv_buffer_device="cpu"'):
            open_gpu_kv(client, _views("LBNHC"), LAYOUT, "device", "LBNHC")
        assert client.list_caches() == []
