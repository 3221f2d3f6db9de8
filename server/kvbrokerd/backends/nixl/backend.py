"""`nixl` backend: one-sided READ (pull) and WRITE (push) through NVIDIA's NIXL over UCX (RDMA, shared memory / CMA
on one host, TCP), here on host memory.

One NIXL agent per daemon, named after the cluster id and the instance epoch, confined to one thread (nixlagent.py).
The handshake carries the agent's metadata (`advertise`, plain bytes). A cache is registered with the agent the first
time a peer asks for it (`describe_cache`) or a transfer uses it locally, and deregistered when it leaves the
registry. Its description holds the tensors' addresses, the address of its live-cache slot (liveslots.py), and the NIXL
metadata of its registration (peers load it into the agent they know: NIXL 1.5 sends registrations made after the
handshake only that way). Transfers use descriptor lists prepared once per (peer, cache): one descriptor per block,
selected by index arrays; plans that are not whole blocks get one descriptor per run.

One-sided reads bypass the owner's registry, and NIXL goes on reading a deregistered (even reused) address, so
every transfer first reads the cache's live-cache slot at the peer (reading unmapped memory would also cost the
UCX endpoint), and a pull reads it again after the data: a cache removed meanwhile gives LLM_KV_CACHE_NOT_EXIST,
never stale bytes. A push can only check before it writes (as `shm`). NIXL drops an endpoint after a transport
error for good: the channel then reloads the peer's agent before its next transfer. Large plans go as requests of
about CHUNK_BYTES.

Environment: UCX chooses its transports (same host: shared memory and CMA; across hosts: RDMA, else TCP); UCX_TLS
restricts them. When the peer API listens on loopback only, UCX_NET_DEVICES defaults to `lo`, so UCX opens no socket
beyond loopback either. Variables already set are kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import os
import queue
import re
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbroker.types import CacheDesc, TensorLocation
from kvbrokerd.backends.common import cudaipc
from kvbrokerd.backends.common.liveslots import LiveSlots
from kvbrokerd.backends.nixl.agent import (
    IMPLEMENTATIONS,
    AgentThread,
    agent_name_of,
    api_installed,
    is_nixl_error,
    llm_error,
    load_api,
)
from kvbrokerd.dataplane.seam import (
    Backend,
    BackendUnusable,
    Capabilities,
    DeviceKind,
    LocalContext,
    PeerChannel,
    PeerInfo,
    RemoteCache,
    engine_result,
)
from kvbrokerd.errors import LlmError, LlmStatus, fail, param_invalid
from kvbrokerd.registry import devicemem

if TYPE_CHECKING:
    from kvbrokerd.dataplane.plan import Plan, Progress
    from kvbrokerd.registry.caches import CacheEntry

log = logging.getLogger(__name__)

NAME = "nixl"
CAPABILITIES = Capabilities(memory_kinds=frozenset({"host", "cuda"}),
                            device_kinds=(DeviceKind("cuda", handle_bytes=(64, 64)),))  # a cudaIpcMemHandle_t
CONNECT_TIMEOUT_S = 10.0
"""Longest the agent thread may take to load a peer's agent (it may be busy with a large registration)."""
"""cuda: only where cuda-python, a CUDA device and NIXL's VRAM support are all there (`NixlBackend.memory_kinds`)."""
INSTALL = "pip install 'kvbroker[nixl]' && pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
MAX_PREPPED_DESCRIPTORS = 1 << 20
"""Caches with more blocks x tensors than this get per-run descriptors instead of a prepared list per block."""
CHUNK_BYTES = 64 << 20
"""Largest NIXL request. On one host UCX copies (CMA) inside the agent thread's post call: bounded requests keep
other agent commands (a peer's cache lookup; a deregistration, which the event loop waits for) from waiting long,
and let deadlines and cancellation be checked between requests."""
SCRATCH_SLOTS = 256
"""8-byte landing slots for reads of peers' live-cache slots: at most this many liveness checks run at once."""
DESCRIPTION = struct.Struct("<4sHHIQQ")
"""describe_cache: magic, version, device, tensor count, bytes per tensor, live-slot address; then one u64
address per tensor; then the NIXL metadata of the cache's registration. Version 1: host memory (device 0); version 2:
VRAM of CUDA device `device` (a peer that only knows version 1 refuses it instead of reading it as host memory)."""
_MAGIC, _VERSION, _VERSION_VRAM = b"KVNX", 1, 2
_DRAM, _VRAM = "DRAM", "VRAM"


def ucx_defaults(peer_host: str) -> dict[str, str]:
    """UCX settings this daemon applies where the environment has none."""
    try:
        loopback = peer_host == "localhost" or ipaddress.ip_address(peer_host).is_loopback
    except ValueError:
        loopback = False
    return {"UCX_NET_DEVICES": "lo"} if loopback else {}


def _block_indices(tensor: np.ndarray, offset: np.ndarray, length: np.ndarray, block: int, blocks_per_tensor: int
                   ) -> np.ndarray:
    """Indices, in a per-block descriptor list, of every block the runs cover (runs are whole blocks)."""
    counts = (length // np.uint64(block)).astype(np.int64)
    starts = tensor.astype(np.int64) * blocks_per_tensor + (offset // np.uint64(block)).astype(np.int64)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return (np.repeat(starts, counts) + within).astype(np.int32)


def _whole_blocks(offsets: tuple[np.ndarray, ...], length: np.ndarray, block: int) -> bool:
    b = np.uint64(block)
    return bool(np.all(length % b == 0) and all(np.all(o % b == 0) for o in offsets))


def _block_descriptors(addresses: np.ndarray, tensor_nbytes: int, block: int, device: int = 0) -> np.ndarray:
    """Nx3 (address, length, device) descriptors: every block of every tensor, tensor-major."""
    per = tensor_nbytes // block
    d = np.zeros((len(addresses) * per, 3), dtype=np.uint64)
    d[:, 0] = (addresses[:, None] + np.arange(per, dtype=np.uint64) * np.uint64(block)).ravel()
    d[:, 1] = block
    d[:, 2] = device
    return d


def _run_descriptors(addresses: np.ndarray, tensor: np.ndarray, offset: np.ndarray, length: np.ndarray,
                     device: int = 0) -> np.ndarray:
    d = np.zeros((len(length), 3), dtype=np.uint64)
    d[:, 0] = addresses[tensor.astype(np.int64)] + offset
    d[:, 1] = length
    d[:, 2] = device
    return d


def _chunks(plan: Plan) -> list[tuple[int, Plan]]:
    """(index of its first run, sub-plan): the plan cut at run boundaries into requests of about CHUNK_BYTES."""
    if plan.total_bytes <= CHUNK_BYTES:
        return [(0, plan)]
    ends = np.cumsum(plan.length.astype(np.int64))
    cuts = np.searchsorted(ends, np.arange(CHUNK_BYTES, int(ends[-1]), CHUNK_BYTES)) + 1
    bounds = sorted({0, plan.num_runs, *cuts.tolist()})
    return [(a, dataclasses.replace(plan, src_tensor=plan.src_tensor[a:b], src_offset=plan.src_offset[a:b],
                                    dst_tensor=plan.dst_tensor[a:b], dst_offset=plan.dst_offset[a:b],
                                    length=plan.length[a:b]))
            for a, b in itertools.pairwise(bounds) if a < b]


def _mark(progress: Progress, part: Plan, first: int) -> None:
    for i, n in enumerate(part.length.tolist(), first):
        progress.mark(i, n)


def _regions(entry: CacheEntry, allocations: Sequence[object] | None = None) -> list[tuple[int, int]]:
    """The byte ranges to register for `entry`: its tensors, merged where adjacent (a daemon-owned segment also
    across its alignment padding, which holds nothing else). `allocations`: per tensor, the allocation it lies in;
    ranges of different allocations are never merged (neighbours in address space are not one device allocation)."""
    n = entry.desc.tensor_nbytes
    slack = 4096 if entry.daemon_owned else 0
    owner = allocations or [None] * len(entry.addresses)
    merged: list[list[Any]] = []
    for start, allocation in sorted(zip(entry.addresses, owner, strict=True), key=lambda pair: pair[0]):
        if merged and merged[-1][2] == allocation and 0 <= start - merged[-1][1] <= slack:
            merged[-1][1] = start + n
        else:
            merged.append([start, start + n, allocation])
    return [(s, e - s) for s, e, _ in merged]


_RegionsKey = tuple[str, int, tuple[tuple[int, int], ...]]
"""(memory kind, device, registered byte ranges): caches whose regions are equal share one registration."""


@dataclasses.dataclass(eq=False)
class _Registration:
    """Memory registered with the agent once, for every cache over exactly these regions (agent thread only)."""

    key: _RegionsKey
    handle: Any
    metadata: bytes
    users: int = 0


@dataclasses.dataclass(eq=False)
class _LocalCache:
    """A cache of ours registered with the agent (agent thread only)."""

    registration: _Registration
    addresses: np.ndarray
    blocks: Any = None
    """Prepared per-block list (local side), made on first use."""
    mem: str = _DRAM
    device: int = 0
    imported: cudaipc.ImportedTensors | None = None
    """The CUDA IPC mappings of a device cache, released after its registration is (or after it let go of a
    registration other caches still hold: each of them holds these mappings too, so none closes before NIXL has
    deregistered the memory)."""


@dataclasses.dataclass(eq=False)
class _RemoteLayout:
    """A peer's cache as its nixl description gives it. The NIXL parts are made and released on the agent thread."""

    cache_id: int
    addresses: np.ndarray
    tensor_nbytes: int
    block_nbytes: int
    live_address: int
    metadata: bytes
    mem: str = _DRAM
    device: int = 0
    loaded: bool = False
    blocks: Any = None
    live: Any = None
    users: int = 0
    forgotten: bool = False


class NixlChannel(PeerChannel):
    """Transfers with one peer's agent."""

    name = NAME

    def __init__(self, backend: NixlBackend, agent_name: str, advertisement: bytes) -> None:
        self._backend = backend
        self._agent = backend.agent
        self.agent_name = agent_name
        self._advertisement = advertisement
        self._lock = threading.Lock()
        # Agent thread only:
        self._active = 0  # transfers in flight
        self._loaded: set[_RemoteLayout] = set()
        self._broken = False
        self._closed = False

    # -- descriptions ------------------------------------------------------------------------------------------------
    def _layout(self, remote: RemoteCache) -> _RemoteLayout:
        with self._lock:
            layout: _RemoteLayout | None = remote.backend_state.get(NAME)
            if layout is None:
                layout = remote.backend_state[NAME] = self._parse(remote)
            return layout

    def _parse(self, remote: RemoteCache) -> _RemoteLayout:
        """The peer's nixl description of `remote`, checked like any untrusted input."""
        info = remote.backend_info.get(NAME, b"")
        where = f"remote cache {remote.cache_id}"
        if len(info) < DESCRIPTION.size:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: the peer gave no nixl description of it")
        magic, version, device, count, tensor_nbytes, live = DESCRIPTION.unpack_from(info)
        end = DESCRIPTION.size + 8 * count
        if magic != _MAGIC or version not in (_VERSION, _VERSION_VRAM):
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: unknown nixl description (version {version})")
        if count != remote.desc.num_tensors or tensor_nbytes != remote.desc.tensor_nbytes or len(info) <= end:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: the nixl description does not match the cache")
        addresses = np.frombuffer(info, dtype="<u8", count=count, offset=DESCRIPTION.size).astype(np.uint64)
        if int(addresses.max()) > (1 << 64) - 1 - tensor_nbytes:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: tensor addresses out of range")
        metadata = info[end:]
        try:
            owner = agent_name_of(metadata)
        except ValueError as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: {e}")
        if owner != self.agent_name:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where}: registered by agent {owner[:80]!r}, not the peer's")
        return _RemoteLayout(remote.cache_id, addresses, tensor_nbytes, remote.desc.block_nbytes, live, metadata,
                             _VRAM if version == _VERSION_VRAM else _DRAM, device if version == _VERSION_VRAM else 0)

    # -- agent-thread helpers -----------------------------------------------------------------------------------------
    def _load(self, agent: Any, layout: _RemoteLayout) -> None:
        if self._closed or layout.forgotten:
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST if layout.forgotten else LlmStatus.LLM_NOT_YET_LINK,
                 f"remote cache {layout.cache_id} was forgotten" if layout.forgotten else "the link was closed")
        if not layout.loaded:
            agent.add_remote_agent(layout.metadata)
            layout.live = agent.prep_xfer_dlist(self.agent_name, [(layout.live_address, 8, 0)], _DRAM)
            layout.loaded = True
            self._loaded.add(layout)

    def _reconnect(self, agent: Any) -> None:
        """NIXL gives up on a peer's endpoint after a transport error (e.g. a read of memory the peer unmapped) and
        never reconnects it: reload the peer's agent, and lazily each cache's registration. Only while no other
        transfer uses them."""
        for layout in self._loaded:
            self._release_lists(layout)
            layout.loaded = False
        self._loaded.clear()
        with contextlib.suppress(Exception):
            agent.remove_remote_agent(self.agent_name)
        agent.add_remote_agent(self._advertisement)
        self._broken = False
        log.info("nixl: reconnected to agent %s after a transport error", self.agent_name)

    def _remote_blocks(self, agent: Any, layout: _RemoteLayout) -> Any:
        if layout.blocks is None and len(layout.addresses) * (layout.tensor_nbytes // layout.block_nbytes) <= \
                MAX_PREPPED_DESCRIPTORS:
            layout.blocks = agent.prep_xfer_dlist(self.agent_name, _block_descriptors(
                layout.addresses, layout.tensor_nbytes, layout.block_nbytes, layout.device), layout.mem)
        return layout.blocks

    def _began(self, layout: _RemoteLayout) -> None:
        layout.users += 1
        self._active += 1

    def _ended(self, agent: Any, layout: _RemoteLayout, error: BaseException | None) -> None:
        layout.users -= 1
        self._active -= 1
        if isinstance(error, LlmError) and error.details.get("nixl_error") == "nixlRemoteDisconnectError":
            self._broken = True
        self._tidy(agent, layout)

    @staticmethod
    def _release_lists(layout: _RemoteLayout) -> None:
        for handle in (layout.blocks, layout.live):
            if handle is not None:
                handle.release()
        layout.blocks = layout.live = None

    def _tidy(self, agent: Any, layout: _RemoteLayout) -> None:
        """Releases a forgotten cache's lists, and a closed channel's agent, once no transfer uses them."""
        if layout.forgotten and layout.users == 0:
            self._release_lists(layout)
            self._loaded.discard(layout)
        if self._closed and self._active == 0:
            self._backend.drop_peer(agent, self)

    def _request(self, agent: Any, op: str, local: CacheEntry, layout: _RemoteLayout, plan: Plan) -> Any:
        """The NIXL transfer request for `plan` (READ: remote -> local, WRITE: local -> remote)."""
        self._load(agent, layout)
        mine = self._backend.local_cache(agent, local)
        if op == "READ":
            lt, lo, rt, ro = plan.dst_tensor, plan.dst_offset, plan.src_tensor, plan.src_offset
        else:
            lt, lo, rt, ro = plan.src_tensor, plan.src_offset, plan.dst_tensor, plan.dst_offset
        block = layout.block_nbytes
        if block == local.desc.block_nbytes and _whole_blocks((lo, ro), plan.length, block):
            local_list = self._backend.local_blocks(agent, local, mine)
            remote_list = self._remote_blocks(agent, layout)
            if local_list is not None and remote_list is not None:
                return agent.make_prepped_xfer(
                    op, local_list, _block_indices(lt, lo, plan.length, block, local.desc.num_blocks),
                    remote_list, _block_indices(rt, ro, plan.length, block, layout.tensor_nbytes // block))
        local_descs = agent.get_xfer_descs(_run_descriptors(mine.addresses, lt, lo, plan.length, mine.device), mine.mem)
        remote_descs = agent.get_xfer_descs(_run_descriptors(layout.addresses, rt, ro, plan.length, layout.device),
                                            layout.mem)
        return agent.initialize_xfer(op, local_descs, remote_descs, self.agent_name)

    # -- transfers (data-plane threads) ------------------------------------------------------------------------------
    def _run(self, post: Any, layout: _RemoteLayout, deadline: float, progress: Progress | None, what: str) -> None:
        def start(agent: Any) -> Any:
            self._began(layout)
            if self._broken and self._active == 1 and not self._closed:
                self._reconnect(agent)
            return post(agent)

        self._agent.transfer(start, deadline, (lambda: progress.cancelled) if progress else (lambda: False), what,
                             lambda agent, error: self._ended(agent, layout, error))

    def _is_live(self, layout: _RemoteLayout, deadline: float) -> bool:
        """Reads the cache's live-cache slot at the peer: is it still registered there?"""
        slot = self._backend.take_slot()

        def read_slot(agent: Any) -> Any:
            self._load(agent, layout)
            return agent.make_prepped_xfer("READ", self._backend.scratch_list, [slot], layout.live, [0])

        try:
            self._backend.scratch[slot] = 0
            self._run(read_slot, layout, deadline, None, f"liveness check of remote cache {layout.cache_id}")
            return int(self._backend.scratch[slot]) == layout.cache_id
        finally:
            self._backend.give_slot(slot)

    def _check_live(self, remote: RemoteCache, layout: _RemoteLayout, deadline: float, when: str) -> None:
        if not self._is_live(layout, deadline):
            self.forget(remote)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id} no longer exists{when}")

    def _move(self, op: str, local: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress,
              deadline: float) -> int:
        layout = self._layout(remote)
        # Before: reading memory the peer has unmapped would also cost the connection (see _reconnect).
        self._check_live(remote, layout, deadline, "")
        what = f"{'pull from' if op == 'READ' else 'push to'} remote cache {remote.cache_id}"
        try:
            for first, part in _chunks(plan):
                if progress.cancelled:
                    fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
                if time.monotonic() > deadline:
                    fail(LlmStatus.LLM_TIMEOUT, f"{what}: deadline passed between NIXL requests")
                self._run(lambda agent, part=part: self._request(agent, op, local, layout, part), layout, deadline,
                          progress, what)
                if op == "WRITE":  # landed; a pull's bytes count only once the post-check has passed
                    _mark(progress, part, first)
        except LlmError as e:
            if e.status in (LlmStatus.LLM_TIMEOUT, LlmStatus.LLM_FAILED, LlmStatus.LLM_NOT_YET_LINK):
                raise
            # A cache the peer removed looks like a transport error (its memory is gone): say which it was.
            try:
                live = self._is_live(layout, deadline)
            except LlmError:
                live = True
            if not live:
                self.forget(remote)
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id} no longer exists")
            raise
        if op == "READ":
            self._check_live(remote, layout, deadline, " (it was removed during the pull: what landed is discarded)")
            if time.monotonic() > deadline:  # the fence: what landed late may have been read after the peer's hold
                fail(LlmStatus.LLM_TIMEOUT, f"{what}: deadline passed before the pull's bytes were checked")
            _mark(progress, plan, 0)
        return plan.total_bytes

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._move("READ", dst, remote, plan, progress, deadline)

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._move("WRITE", src, remote, plan, progress, deadline)

    def forget(self, remote: RemoteCache) -> None:
        with self._lock:
            layout: _RemoteLayout | None = remote.backend_state.pop(NAME, None)
        if layout is not None:
            def forget(agent: Any) -> None:
                layout.forgotten = True
                self._tidy(agent, layout)

            self._agent.submit(forget)

    def close(self) -> None:
        def close(agent: Any) -> None:
            if not self._closed:
                self._closed = True
                if self._active == 0:
                    self._backend.drop_peer(agent, self)

        self._agent.submit(close)


def _close_unused(future: concurrent.futures.Future[NixlChannel]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class NixlBackend(Backend):
    """Advertises this daemon's NIXL agent; a peer loads it and reads or writes our registered caches directly."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, ctx: LocalContext) -> None:
        super().__init__(ctx)
        self.agent = AgentThread(f"kvbroker-{ctx.cluster_id}-{ctx.registry.instance}")
        self._metadata = b""
        self._live_words = np.zeros(ctx.registry.max_caches, dtype=np.uint64)
        """Our live-cache slots (liveslots.py), registered with the agent: peers READ a cache's slot around a
        transfer."""
        self._live = LiveSlots(self._live_words)
        self.scratch = np.zeros(SCRATCH_SLOTS, dtype=np.uint64)
        self.scratch_list: Any = None
        self._free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(SCRATCH_SLOTS):
            self._free_slots.put(i)
        # Agent thread only:
        self._fixed: list[Any] = []
        self._caches: dict[int, _LocalCache] = {}
        self._registrations: dict[_RegionsKey, _Registration] = {}
        self._registered: dict[tuple[str, int, int, int], _Registration] = {}
        """Every registered byte range (memory kind, device, address, length) and the registration it is in."""
        self._peers: dict[str, NixlChannel] = {}
        self._closed = False
        self.cuda_missing = "the nixl backend has not started"
        """Why this daemon cannot import CUDA memory ("" when it can)."""
        self._cuda: cudaipc.CudaIpcImporter | None = None

    @property
    def memory_kinds(self) -> frozenset[str]:
        return CAPABILITIES.memory_kinds if not self.cuda_missing else frozenset({"host"})

    @classmethod
    def unavailable(cls) -> str | None:
        # Presence only: loading NIXL's native libraries is for the daemon that runs the backend (start() reports a
        # library that is installed but cannot load).
        if api_installed() is None:
            return (f"the nixl backend needs NIXL ({' or '.join(IMPLEMENTATIONS)} not installed); install it with: "
                    f"{INSTALL} (nixl-cu13 on CUDA 13; --no-deps because the wheel declares torch, which host "
                    "memory does not need)")
        return None

    async def start(self) -> None:
        try:
            api = load_api()
        except ImportError as e:
            raise OSError(f"nixl: {e}") from None
        for key, value in ucx_defaults(self.ctx.peer_host).items():
            os.environ.setdefault(key, value)
        cuda_missing = cudaipc.cuda_missing()

        def make_agent() -> Any:
            nonlocal cuda_missing
            if not cuda_missing:  # the context first: UCX threads started without one crash in CUDA calls
                try:
                    self._cuda = cudaipc.CudaIpcImporter()
                    self._cuda.make_current(0)
                except (LlmError, ImportError) as e:  # host memory still works: only device caches are refused
                    self._cuda = None
                    cuda_missing = f"no usable CUDA device ({e})"
            with _progress_delay(api, PROGRESS_DELAY_US):
                agent = api.nixl_agent(self.agent.name, api.nixl_agent_config(backends=[]))
            agent.create_backend("UCX", agent.get_plugin_params("UCX"))  # its default error mode is "peer"
            return agent

        try:
            self.agent.start(make_agent)
            self._metadata = self.agent.call(self._register_fixed)
            self.cuda_missing = cuda_missing or self.agent.call(
                lambda agent: "" if "VRAM_SEG" in agent.get_backend_mem_types("UCX") else
                f"this NIXL build ({api.__name__.split('.')[0]}) has no VRAM support in its UCX backend")
        except Exception as e:
            self.close()
            raise OSError(f"nixl: cannot start the NIXL agent: {type(e).__name__}: {e}") from None
        self._live.follow(self.ctx.registry)
        ucx = ", ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("UCX_"))
        log.info("nixl: agent %s ready (%s; %s; cuda memory: %s)", self.agent.name, api.__name__.split(".")[0],
                 ucx or "UCX defaults", self.cuda_missing or "yes")

    def _register_fixed(self, agent: Any) -> bytes:
        """Registers the live-cache slots (peers read them) and the scratch slots, before the metadata the handshake
        carries is taken."""
        words = self._live_words
        self._fixed.append(agent.register_memory([(int(words.ctypes.data), words.nbytes, 0, "")], _DRAM))
        self._fixed.append(agent.register_memory([(int(self.scratch.ctypes.data), self.scratch.nbytes, 0, "")], _DRAM))
        self.scratch_list = agent.prep_xfer_dlist(
            "", [(int(self.scratch.ctypes.data) + 8 * i, 8, 0) for i in range(SCRATCH_SLOTS)], _DRAM)
        metadata: bytes = agent.get_agent_metadata()
        return metadata

    def advertise(self) -> bytes:
        return self._metadata

    async def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            name = agent_name_of(info)
        except ValueError as e:
            raise BackendUnusable(f"unreadable nixl advertisement ({e})") from None
        if not re.fullmatch(rf"kvbroker-{peer.cluster_id}-[0-9A-Za-z]{{1,64}}", name):
            raise BackendUnusable(f"the peer's NIXL agent is named {name[:80]!r}, not after cluster {peer.cluster_id}")

        def load(agent: Any) -> NixlChannel:
            loaded = agent.add_remote_agent(info)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:  # pragma: no cover - NIXL loads the name we read
                agent.remove_remote_agent(loaded)
                raise BackendUnusable(f"NIXL loaded agent {loaded!r} from an advertisement of {name!r}")
            channel = self._peers[name] = NixlChannel(self, name, info)
            return channel

        future = self.agent.submit(load)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), CONNECT_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError) as e:
            if not future.cancel():  # it loads later: close what nobody will use
                future.add_done_callback(_close_unused)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise BackendUnusable(f"NIXL did not load the peer's agent within {CONNECT_TIMEOUT_S:g} s (its agent "
                                  "thread is busy)") from None
        except LlmError as e:
            raise BackendUnusable(e.message) from None
        except Exception as e:
            if is_nixl_error(e):
                raise BackendUnusable(f"NIXL cannot load the peer's agent: {type(e).__name__}: {e}") from None
            raise

    def drop_peer(self, agent: Any, channel: NixlChannel) -> None:
        """Forgets a closed channel's agent, unless a newer channel (a re-link) loaded it again (agent thread)."""
        if self._peers.get(channel.agent_name) is channel:
            del self._peers[channel.agent_name]
            try:
                agent.remove_remote_agent(channel.agent_name)
            except Exception as e:
                log.warning("nixl: removing agent %s failed: %s", channel.agent_name, e)

    # -- local caches ----------------------------------------------------------------------------------------------
    def local_cache(self, agent: Any, entry: CacheEntry) -> _LocalCache:
        """`entry` registered with the agent, once (agent thread; the entry is pinned)."""
        mine = self._caches.get(entry.cache_id)
        if mine is None:
            if self._closed:
                fail(LlmStatus.LLM_FAILED, "the nixl backend is closed")
            if devicemem.memory_kind(entry.tensors) != "host":  # registered at import; gone means the cache is
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"cache {entry.cache_id} is being removed")
            registration = self._register(agent, entry.cache_id, _DRAM, 0, _regions(entry))
            mine = self._caches[entry.cache_id] = _LocalCache(registration,
                                                              np.asarray(entry.addresses, dtype=np.uint64))
        return mine

    def _register(self, agent: Any, cache_id: int, mem: str, device: int, regions: list[tuple[int, int]]
                  ) -> _Registration:
        """A registration of exactly `regions` for cache `cache_id`: the one another cache over them holds, or a new
        one. Refuses regions of which only some are registered already (NIXL would hold one range twice)."""
        key: _RegionsKey = (mem, device, tuple(regions))
        registration = self._registrations.get(key)
        if registration is None:
            for start, length in regions:
                other = self._registered.get((mem, device, start, length))
                if other is not None:
                    param_invalid(f"cache {cache_id}: bytes [{start:#x}, {start + length:#x}) are registered with "
                                  "NIXL for another cache whose tensors cover other memory besides; a second cache "
                                  "over the same memory must have the same tensor locations")
            handle = agent.register_memory([(a, n, device, "") for a, n in regions], mem)
            registration = _Registration(key, handle, agent.get_partial_agent_metadata(handle, False, []))
            self._registrations[key] = registration
            for start, length in regions:
                self._registered[(mem, device, start, length)] = registration
        registration.users += 1
        return registration

    def _let_go(self, agent: Any, registration: _Registration) -> None:
        """One cache fewer holds `registration`; the last one deregisters it."""
        registration.users -= 1
        if registration.users == 0:
            mem, device, regions = registration.key
            del self._registrations[registration.key]
            for start, length in regions:
                self._registered.pop((mem, device, start, length), None)
            agent.deregister_memory(registration.handle)

    def local_blocks(self, agent: Any, entry: CacheEntry, mine: _LocalCache) -> Any:
        block = entry.desc.block_nbytes
        if mine.blocks is None and entry.desc.num_tensors * entry.desc.num_blocks <= MAX_PREPPED_DESCRIPTORS:
            mine.blocks = agent.prep_xfer_dlist("", _block_descriptors(mine.addresses, entry.desc.tensor_nbytes,
                                                                       block, mine.device), mine.mem)
        return mine.blocks

    async def describe_cache(self, entry: CacheEntry) -> bytes:
        # Registering a large cache takes the agent thread a while, and it may be busy posting a transfer chunk.
        try:
            mine = await engine_result(self.agent.submit(lambda agent: self.local_cache(agent, entry)))
        except Exception as e:
            if is_nixl_error(e):
                raise llm_error(e, f"registering cache {entry.cache_id} with NIXL") from None
            raise
        live = self._live.address(entry.cache_id)
        version = _VERSION_VRAM if mine.mem == _VRAM else _VERSION
        return (DESCRIPTION.pack(_MAGIC, version, mine.device, entry.desc.num_tensors, entry.desc.tensor_nbytes, live)
                + mine.addresses.astype("<u8").tobytes() + mine.registration.metadata)

    def forget_cache(self, entry: CacheEntry) -> None:
        """Deregisters `entry` (it has no pins: no local transfer uses it) before the registry unmaps it; a device
        cache's IPC mappings are closed after that."""
        if not self._closed and entry.cache_id in self._caches:
            try:
                self.agent.call(lambda agent: self._forget_local(agent, entry.cache_id))
            except Exception:
                log.exception("nixl: deregistering cache %d failed", entry.cache_id)

    def _forget_local(self, agent: Any, cache_id: int) -> None:
        mine = self._caches.pop(cache_id, None)
        if mine is None:
            return
        try:
            if mine.blocks is not None:
                mine.blocks.release()
            self._let_go(agent, mine.registration)
        finally:
            if mine.imported is not None and self._cuda is not None:
                for error in self._cuda.release(mine.imported):
                    log.warning("nixl: cache %d: %s", cache_id, error)

    # -- device caches ---------------------------------------------------------------------------------------------
    def import_device_cache(self, desc: CacheDesc, tensors: Sequence[TensorLocation], owner: str) -> CacheEntry:
        """Opens the caches' CUDA IPC handles (once per allocation), registers the mapped memory with NIXL as VRAM
        and lists the cache: peers then read and write the model server's memory directly."""
        devices = [t.device for t in tensors if t.device is not None]
        kind = devices[0].kind
        if kind != "cuda" or self.cuda_missing:
            fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, f"the nixl backend cannot import {kind} memory on this daemon: "
                 f"{self.cuda_missing or 'it moves host and cuda memory only'}")
        if len({d.device for d in devices}) != 1:
            param_invalid("the tensors of a device cache are on one device")

        def run(agent: Any) -> CacheEntry:
            assert self._cuda is not None
            imported = self._cuda.import_tensors(devices[0].device, [d.ipc_handle for d in devices],
                                                 [t.offset for t in tensors], [d.allocation_bytes for d in devices],
                                                 desc.tensor_nbytes)
            listed: list[int] = []

            def register(entry: CacheEntry) -> None:
                try:
                    registration = self._register(agent, entry.cache_id, _VRAM, imported.device,
                                                  _regions(entry, imported.keys))
                except Exception as e:
                    if is_nixl_error(e):
                        raise llm_error(e, "NIXL cannot register the imported VRAM (its UCX lacks CUDA support, or "
                                        "does not take memory imported by IPC: docs/device.md)",
                                        LlmStatus.LLM_FEATURE_NOT_ENABLED) from None
                    raise
                listed.append(entry.cache_id)
                self._caches[entry.cache_id] = _LocalCache(
                    registration, np.asarray(entry.addresses, dtype=np.uint64), mem=_VRAM, device=imported.device,
                    imported=imported)

            try:
                return self.ctx.registry.add_device(desc, tensors, imported.addresses, owner, register)
            except BaseException:
                if listed:
                    self._forget_local(agent, listed[0])
                else:
                    self._cuda.release(imported)
                raise

        return self.agent.call(run)

    # -- scratch slots ---------------------------------------------------------------------------------------------
    def take_slot(self) -> int:
        return self._free_slots.get()

    def give_slot(self, slot: int) -> None:
        self._free_slots.put(slot)

    def close(self) -> None:
        def teardown(agent: Any) -> None:
            for name in list(self._peers):
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(name)
            self._peers.clear()
            for mine in self._caches.values():
                with contextlib.suppress(Exception):
                    if mine.blocks is not None:
                        mine.blocks.release()
            for registration in self._registrations.values():
                with contextlib.suppress(Exception):
                    agent.deregister_memory(registration.handle)
            self._caches.clear()
            self._registrations.clear()
            self._registered.clear()
            if self._cuda is not None:  # after NIXL let go of the memory; before the owner may free it
                for error in self._cuda.close_all():
                    log.warning("nixl: %s", error)
            if self.scratch_list is not None:
                self.scratch_list.release()
                self.scratch_list = None
            for registration in self._fixed:
                with contextlib.suppress(Exception):
                    agent.deregister_memory(registration)
            self._fixed.clear()

        if not self._closed:
            self._closed = True
            self._live.stop()  # peers see every cache gone before the agent deregisters anything
            self.agent.close(teardown)


BACKEND = NixlBackend
"""The `nixl` backend class (backends/__init__.py)."""


PROGRESS_DELAY_US = 500
"""Pause of NIXL's progress thread between rounds. NIXL's Python wrapper hard-codes 0, and its progress thread then
spins a whole core for as long as the daemon runs, idle or not. It is needed for what a peer does to us (UCX
transports that emulate one-sided reads need the target's progress); initiators poll their own transfers."""


@contextlib.contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """Makes the nixl_agent constructed inside use `delay_us` for its progress thread's pause (the wrapper sets the
    C++ config field to 0 and offers no parameter): the config class is swapped for one that keeps our value."""
    bind = api.nixlBind
    original = bind.nixlAgentConfig

    class _Config(original):  # type: ignore[misc,valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    bind.nixlAgentConfig = _Config
    try:
        yield
    finally:
        bind.nixlAgentConfig = original
