"""What the `nixl` backend accepts from a peer (advertisement, cache description) and how it maps plans onto NIXL
descriptors; no NIXL needed (the daemon-level tests are in tests/integration/test_nixl.py)."""

from __future__ import annotations

import struct
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from kvbroker import CacheDesc, DataType, LlmError, LlmStatus, TensorLocation
from kvbrokerd.backends import unavailable
from kvbrokerd.backends.nixl.agent import agent_name_of, llm_error
from kvbrokerd.backends.nixl.backend import (
    CHUNK_BYTES,
    DESCRIPTION,
    NixlBackend,
    NixlChannel,
    _block_indices,
    _chunks,
    _regions,
)
from kvbrokerd.dataplane.pairs import block_array
from kvbrokerd.dataplane.seam import BackendUnusable, LocalContext, PeerInfo, RemoteCache
from kvbrokerd.transfers.planner import LayerSelection, plan_blocks

DESC = CacheDesc(num_tensors=2, shape=(8, 16), data_type=DataType.UINT8)


def metadata(name: bytes, tail: bytes = b"|Conns\x00") -> bytes:
    """The head of NIXL 1.5 agent metadata as nixl_agent.get_agent_metadata() writes it."""
    return b"nixlSerDes|Agent" + struct.pack("<Q", len(name)) + name + tail


def test_agent_name_is_read_without_loading_the_metadata() -> None:
    assert agent_name_of(metadata(b"kvbroker-7-0a1b2c3d")) == "kvbroker-7-0a1b2c3d"
    for bad in (b"", b"garbage" * 10, metadata(b"x")[:20], metadata(b"a" * 200), metadata(b"kvb", tail=b"Conns"),
                b"nixlSerDes|Agent" + struct.pack("<Q", 1 << 60) + b"x|"):
        with pytest.raises(ValueError):
            agent_name_of(bad)


def _backend() -> NixlBackend:
    ctx = SimpleNamespace(cluster_id=8, registry=SimpleNamespace(instance="00ff00ff", max_caches=16))
    return NixlBackend(cast(LocalContext, ctx))


async def test_an_advertisement_must_name_the_peers_own_agent() -> None:
    backend = _backend()
    peer = PeerInfo(cluster_id=7, peer_address="127.0.0.1:1", secret=b"s" * 32)
    for advert in (b"", b"not nixl", metadata(b"kvbroker-9-00aa"), metadata(b"kvbroker-7-../x"),
                   metadata(b"kvbroker-70-00aa")):
        with pytest.raises(BackendUnusable):
            await backend.connect(peer, advert)


def _remote(info: bytes, desc: CacheDesc = DESC) -> RemoteCache:
    return RemoteCache(cache_id=42, desc=desc, tensors=(TensorLocation("s", 0), TensorLocation("s", 4096)),
                       backend_info={"nixl": info})


def _description(count: int = 2, nbytes: int = DESC.tensor_nbytes, magic: bytes = b"KVNX",
                 addresses: tuple[int, ...] = (1 << 20, 2 << 20), agent: bytes = b"kvbroker-7-00aa") -> bytes:
    return (DESCRIPTION.pack(magic, 1, 0, count, nbytes, 3 << 20) + np.asarray(addresses, "<u8").tobytes()
            + metadata(agent))


def test_a_peers_cache_description_is_checked_before_use() -> None:
    channel = NixlChannel(cast(Any, SimpleNamespace(agent=None)), "kvbroker-7-00aa", b"")
    layout = channel._parse(_remote(_description()))
    assert layout.addresses.tolist() == [1 << 20, 2 << 20] and layout.live_address == 3 << 20
    assert layout.block_nbytes == DESC.block_nbytes
    bad = [b"", _description()[:DESCRIPTION.size + 8], _description(magic=b"XXXX"), _description(count=3),
           _description(nbytes=DESC.tensor_nbytes + 1), _description(agent=b"kvbroker-9-00aa"),
           _description(addresses=(1 << 20, (1 << 64) - 8))]
    for info in bad:
        with pytest.raises(LlmError) as e:
            channel._parse(_remote(info))
        assert e.value.status == LlmStatus.LLM_LINK_FAILED


def test_runs_of_whole_blocks_map_to_descriptor_indices() -> None:
    src, dst = block_array([5, 6, 7, 0], "src"), block_array([1, 2, 3, 7], "dst")
    plan = plan_blocks(DESC, DESC, src, dst, LayerSelection())  # 2 runs x 2 tensors
    idx = _block_indices(plan.src_tensor, plan.src_offset, plan.length, DESC.block_nbytes, DESC.num_blocks)
    assert idx.tolist() == [5, 6, 7, 0, 13, 14, 15, 8]
    idx = _block_indices(plan.dst_tensor, plan.dst_offset, plan.length, DESC.block_nbytes, DESC.num_blocks)
    assert idx.tolist() == [1, 2, 3, 7, 9, 10, 11, 15]


def test_registration_covers_exactly_the_tensors() -> None:
    def entry(addresses: list[int], owned: bool) -> Any:
        return SimpleNamespace(desc=CacheDesc(num_tensors=len(addresses), shape=(1, 100), data_type=DataType.UINT8),
                               addresses=addresses, daemon_owned=owned)

    # A daemon-owned segment: tensors at 4 KiB strides are one region (the padding is ours).
    assert _regions(entry([0x10000, 0x11000, 0x12000], True)) == [(0x10000, 0x2064)]
    # A model server's memory: only the tensors' own bytes, adjacent ones merged.
    assert _regions(entry([0x10000, 0x11000, 0x10064], False)) == [(0x10000, 200), (0x11000, 100)]
    # Device tensors: neighbours in address space from two allocations are two regions.
    assert _regions(entry([0x10000, 0x10064, 0x100C8], False), ["a", "b", "b"]) == [(0x10000, 100), (0x10064, 200)]


def test_a_peers_vram_description_names_its_device_and_old_peers_refuse_it() -> None:
    channel = NixlChannel(cast(Any, SimpleNamespace(agent=None)), "kvbroker-7-00aa", b"")
    host = channel._parse(_remote(_description()))
    assert (host.mem, host.device) == ("DRAM", 0)
    vram = _description()
    vram = DESCRIPTION.pack(b"KVNX", 2, 3, *DESCRIPTION.unpack_from(vram)[3:]) + vram[DESCRIPTION.size:]
    layout = channel._parse(_remote(vram))
    assert (layout.mem, layout.device) == ("VRAM", 3)
    future = DESCRIPTION.pack(b"KVNX", 3, 0, *DESCRIPTION.unpack_from(vram)[3:]) + vram[DESCRIPTION.size:]
    with pytest.raises(LlmError, match="unknown nixl description"):
        channel._parse(_remote(future))


def test_nixl_errors_map_to_llm_statuses() -> None:
    def nixl_error(name: str) -> Exception:
        return cast(Exception, type(name, (Exception,), {})("boom"))

    cases = {"nixlRemoteDisconnectError": LlmStatus.LLM_LINK_FAILED,
             "nixlInvalidParamError": LlmStatus.LLM_PARAM_INVALID,
             "nixlNotFoundError": LlmStatus.LLM_KV_CACHE_NOT_EXIST,
             "nixlRepostActiveError": LlmStatus.LLM_FAILED}
    for name, status in cases.items():
        err = llm_error(nixl_error(name), "pull")
        assert err.status == status and err.details["nixl_error"] == name and name in err.message


def test_large_plans_are_cut_into_bounded_requests_at_run_boundaries() -> None:
    big = CacheDesc(num_tensors=2, shape=(64, 4 << 20), data_type=DataType.UINT8)  # 4 MiB blocks, 512 MiB in all
    order = np.random.default_rng(3).permutation(64)
    plan = plan_blocks(big, big, block_array(order, "src"), block_array(np.arange(64), "dst"), LayerSelection())
    chunks = _chunks(plan)
    assert len(chunks) == plan.total_bytes // CHUNK_BYTES
    assert [first for first, _ in chunks] == list(np.cumsum([0] + [p.num_runs for _, p in chunks[:-1]]))
    assert all(p.total_bytes <= CHUNK_BYTES for _, p in chunks)
    for name in ("src_tensor", "src_offset", "dst_tensor", "dst_offset", "length"):
        assert np.array_equal(np.concatenate([getattr(p, name) for _, p in chunks]), getattr(plan, name))
    small = plan_blocks(DESC, DESC, block_array([0], "s"), block_array([1], "d"), LayerSelection())
    assert _chunks(small) == [(0, small)]


def test_without_nixl_the_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("nixl_cu12", "nixl_cu13", "nixl_cu12._api", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    reason = unavailable("nixl")
    assert reason is not None
    assert "pip install 'kvbroker[nixl]' && pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1" in reason


@pytest.mark.skipif(unavailable("nixl") is not None, reason="NIXL is not installed")
def test_nixl_logs_through_the_daemons_handlers() -> None:
    """NIXL's own logging set-up (a stdout handler in its own format; raiseExceptions off) is undone on import.
    In a child process: NIXL's native libraries must not be loaded into the test process (they crash a later import
    of grpc_tools there), and checking that they are not is the next test's job."""
    check = (
        "import logging\n"
        "from kvbrokerd.backends.nixl.agent import load_api\n"
        "load_api()\n"
        "log = logging.getLogger('nixl')\n"
        "assert log.handlers == [] and log.propagate and log.level == logging.WARNING, log\n"
        "assert logging.raiseExceptions\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_asking_whether_nixl_is_there_loads_nothing_native() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom kvbrokerd.backends import unavailable\n"
                          "unavailable('nixl')\nassert not [m for m in sys.modules if m.startswith('nixl')]"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
