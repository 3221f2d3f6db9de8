"""Worker side of the connector: owns the engine's KV memory (through the daemon), runs pulls, keeps held blocks.

Decode role: each pull runs on a small thread pool (the engine keeps stepping meanwhile); a finished pull, good or
bad, is reported through `get_finished` in the same step as the blocks that did not land, so vLLM recomputes those
instead of reading them. A pull names only the request's grant: the daemon redeems it with the prefill daemon (a
trusted one: `kvbroker_prefill_daemons`), which names the cache and blocks. The scheduler side releases the grant.

Prefill role: a finished request's blocks stay allocated until its grant ends (released by the decode node, lapsed,
or capped), which this node's own daemon posts on the rank's topic; notes from anyone else there are ignored.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvbroker._client import Client
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.gpu import GpuKv, open_gpu_kv
from kvbroker.integrations.vllm.grants import PeerLinks
from kvbroker.integrations.vllm.layout import MEMORY_MLA, KvLayout, layout_of_tag
from kvbroker.integrations.vllm.memory import DaemonKvAllocation
from kvbroker.integrations.vllm.params import (
    PullSpec,
    WorkerEndpoint,
    parse_release,
    release_topic,
)
from kvbroker.integrations.vllm.remap import blocks_of_units, plan_pull, refusal
from kvbroker.integrations.vllm.stats import TransferLog, reason_of
from kvbroker.shm import Cache
from kvbroker.status import LlmError, LlmStatus, NotYetLinkError
from kvbroker.types import KvCacheExtParam, TransferResult

# Under "vllm." so that the lines join vLLM's own log output (vLLM configures only its logger tree).
log = logging.getLogger(f"vllm.{__name__}")

# One tensor per layer, addressed in units of a few tokens of one head (layout.KvLayout.desc).
_ONE_TENSOR_PER_LAYER = KvCacheExtParam(tensor_num_per_layer=1)
_POLL_WAIT_S = 1.0
_RELEASED_KEPT_S = 600.0
"""A grant's end for a request this rank does not (yet) hold is kept this long (the daemon's notification age)."""


@dataclass(frozen=True, slots=True)
class _Pulled:
    bytes_moved: int
    seconds: float
    backend: str


@dataclass(frozen=True, slots=True)
class PullOutcome:
    request_id: str
    failed_blocks: frozenset[int]


class WorkerSide:
    def __init__(self, config: ConnectorConfig, engine_id: str, rank: int, layout: KvLayout,
                 client: Client | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.layout = layout
        self.client = client or Client(config.target, timeout=config.pull_timeout_s, lease_ttl=config.lease_ttl_s)
        self.cache: Cache | None = None
        self.endpoint: WorkerEndpoint | None = None
        self.transfers = TransferLog()
        self._allocation: DaemonKvAllocation | None = None
        self.gpu: GpuKv | None = None
        """Set on a GPU engine (register_gpu): the mode serving vLLM's device KV buffer."""
        self._lock = threading.Lock()
        self._pull_ended = threading.Condition(self._lock)
        self._in_flight = 0
        self._pulls = ThreadPoolExecutor(config.max_concurrent_pulls, thread_name_prefix="kvbroker-pull")
        self._pulled: list[PullOutcome] = []
        self._load_errors: set[int] = set()
        self.links = PeerLinks(self.client, config.trusted_prefill(), config.link_timeout_s)
        self._held: dict[str, float] = {}
        self._released: dict[str, tuple[float, str]] = {}
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # -- memory ---------------------------------------------------------------------------------------------------
    def allocation_context(self) -> DaemonKvAllocation:
        self._allocation = DaemonKvAllocation(self.layout, self._allocate)
        return self._allocation

    def _allocate(self) -> Cache:
        try:
            return self.client.allocate_cache(self.layout.desc())
        except LlmError as e:
            raise RuntimeError(f"KvBrokerConnector: cannot allocate the KV cache ({self.layout.buffer_bytes} bytes) "
                               f"through kvbrokerd at {self.config.target} (kvbroker_target): {e.status.name}: "
                               f"{e.message}") from e

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Checks that every layer vLLM will use lies in the daemon's cache, where the daemon expects it."""
        if self._allocation is None or self._allocation.cache is None or self._allocation.buffer is None:
            raise RuntimeError("vLLM allocated its KV cache outside the connector's allocation context (this vLLM "
                               "version is not supported by KvBrokerConnector)")
        self.cache = self._allocation.cache
        base = self._allocation.buffer.data_ptr()
        stride = self.cache.desc.tensor_nbytes
        layers = sorted({t.data_ptr() for t in kv_caches.values()})
        expected = [base + i * stride for i in range(self.layout.num_layers)]
        if layers != expected:
            raise RuntimeError(f"vLLM's KV layers start at offsets {[p - base for p in layers]} of the buffer, "
                               f"expected {[p - base for p in expected]}")
        # The tag says which byte is which token of which head: the attention backend's views must agree with it.
        lay = self.layout
        shape = ((lay.num_blocks, lay.block_size, lay.head_size) if lay.memory == MEMORY_MLA
                 else (lay.num_blocks, lay.num_kv_heads, lay.block_size, 2 * lay.head_size))
        for name, t in kv_caches.items():
            if tuple(t.shape) != shape:
                raise RuntimeError(f"vLLM's KV layer {name} has shape {tuple(t.shape)}, not the {shape} of memory "
                                   f"layout {lay.memory} (this attention backend is not supported by "
                                   "KvBrokerConnector)")
        self._serve()

    def register_gpu(self, kv_caches: dict[str, torch.Tensor], mode: str, vllm_layout: str | None,
                     saves: bool = True) -> None:
        """A GPU engine: vLLM keeps its KV buffer; the daemon serves it device-direct or host-staged (gpu.py)."""
        self.gpu, self.layout = open_gpu_kv(self.client, kv_caches, self.layout, mode, vllm_layout, saves=saves)
        self.cache = self.gpu.cache
        self._serve()

    def _serve(self) -> None:
        assert self.cache is not None
        info = self.client.get_cluster_info()
        self.endpoint = WorkerEndpoint(rank=self.rank, cluster_id=info.cluster_id,
                                       peer_address=self.config.peer_address or info.peer_address,
                                       cache_id=self.cache.cache_id, layout_tag=self.layout.tag())
        log.info("kvbroker connector rank %d: KV cache %d (%d layers x %d blocks x %d bytes) in daemon %d's memory",
                 self.rank, self.cache.cache_id, self.layout.num_layers, self.layout.num_blocks,
                 self.layout.page_bytes, info.cluster_id)
        self._poller = threading.Thread(target=self._poll_releases, name="kvbroker-release", daemon=True)
        self._poller.start()

    # -- per step -------------------------------------------------------------------------------------------------
    def start(self, pulls: Iterable[PullSpec], holds: dict[str, float]) -> None:
        pulls = list(pulls)
        with self._lock:
            self._held.update(holds)
            self._in_flight += len(pulls)
        for spec in pulls:
            self._pulls.submit(self._pull_and_report, spec)

    def finished(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """(requests whose held blocks may be freed, requests whose pull ended); the pulls' failed blocks are
        moved to `take_load_errors` in the same call. With `wait_s`, and pulls in flight but none ended yet, first
        waits up to that long for one to end (for a step that computed nothing: see `ConnectorConfig.idle_wait_s`)."""
        with self._lock:
            if wait_s > 0:
                self._pull_ended.wait_for(lambda: self._pulled or not self._in_flight, timeout=wait_s)
            now = time.monotonic()
            pulled, self._pulled = self._pulled, []
            for outcome in pulled:
                self._load_errors |= outcome.failed_blocks
            sending = set()
            for req_id in list(self._held):
                if req_id in self._released:
                    _, ended = self._released.pop(req_id)
                    if ended != "released":
                        log.warning("request %s: its grant ended (%s) before a decode node released it; freeing its "
                                    "KV blocks", req_id, ended)
                        self.transfers.record_expired_hold(ended.replace(" ", "_"))
                    del self._held[req_id]
                    sending.add(req_id)
            # Ends of grants this worker never held (or no longer holds) are forgotten after a while.
            for req_id, (at, _) in list(self._released.items()):
                if now - at > _RELEASED_KEPT_S:
                    del self._released[req_id]
        return sending, {o.request_id for o in pulled}

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- decode: pulls --------------------------------------------------------------------------------------------
    def _pull_and_report(self, spec: PullSpec) -> None:
        failed: frozenset[int] = frozenset()
        try:
            failed = self._pull(spec)
        except Exception:  # a bug must not strand the request in WAITING_FOR_REMOTE_KVS
            log.exception("request %s: pull crashed; recomputing its KV", spec.request_id)
            failed = frozenset(spec.local_blocks)
            self.transfers.record_recompute("error", pull_failed=True)
        finally:
            if failed:  # reported too: the request's output says its tokens were recomputed, not pulled
                self.transfers.record_failed(spec.request_id)
            with self._lock:
                self._pulled.append(PullOutcome(spec.request_id, failed))
                self._in_flight -= 1
                self._pull_ended.notify_all()
        self.transfers.record_outcome(ok=not failed)

    def _pull(self, spec: PullSpec) -> frozenset[int]:
        """Returns the local blocks that did not land."""
        everything = frozenset(spec.local_blocks)
        if spec.refused:
            log.error("request %s: not pulling from prefill engine %s: %s", spec.request_id, spec.remote.engine_id,
                      spec.refused)
            self.transfers.record_recompute("block_mismatch")
            return everything
        assert self.cache is not None
        remote = spec.remote
        dst = self.cache.cache_id
        refused = refusal(self.layout, remote.layout_tag)
        if refused is not None:
            log.error("request %s: incompatible KV layouts, recomputing: %s", spec.request_id, refused.message)
            self.transfers.record_recompute("layout")
            return everything
        if why := self.links.refusal(remote.cluster_id):
            log.error("request %s: not pulling: %s", spec.request_id, why)
            self.transfers.record_recompute("untrusted")
            return everything
        calls: list[Callable[[], TransferResult]] = []
        if self.layout.physical:  # a GPU engine: whole blocks, rank to rank (remap.refusal saw equal shapes)
            if self.rank >= remote.tp_size:
                log.error("request %s: prefill engine has %d TP ranks, this is rank %d", spec.request_id,
                          remote.tp_size, self.rank)
                self.transfers.record_recompute("layout")
                return everything
            calls.append(lambda: self.client.pull_granted_kv_blocks(
                remote.cluster_id, remote.grant, dst, spec.local_blocks, cache_slot=self.rank,
                first_block=spec.first_block, ext_param=_ONE_TENSOR_PER_LAYER, timeout=self.config.pull_timeout_s))
            sources = 1
        else:
            theirs = layout_of_tag(remote.layout_tag)
            start, end = (spec.start_token, spec.end_token) if spec.end_token else (
                0, len(spec.local_blocks) * self.layout.block_size)
            try:
                plan = plan_pull(self.layout, self.rank, theirs, spec.local_blocks, spec.remote_blocks, start, end)
            except ValueError as e:
                log.error("request %s: cannot map the prefill engine's blocks, recomputing: %s", spec.request_id, e)
                self.transfers.record_recompute("block_mismatch")
                return everything
            # One pull per prefill rank read, each naming units of that rank's cache that the grant must cover.
            for one in plan:
                src_units: Any = one.src_units  # uint64 arrays: the client takes them as they are
                dst_units: Any = one.dst_units
                calls.append(functools.partial(
                    self.client.pull_granted_kv_blocks, remote.cluster_id, remote.grant, dst, dst_units,
                    cache_slot=one.remote_rank, src_blocks=src_units, ext_param=_ONE_TENSOR_PER_LAYER,
                    timeout=self.config.pull_timeout_s))
            sources = len(plan)
        nbytes, seconds, backends = 0, 0.0, []
        for call in calls:
            outcome = self._pull_units(spec, call)
            if isinstance(outcome, frozenset):
                return outcome
            nbytes, seconds = nbytes + outcome.bytes_moved, seconds + outcome.seconds
            backends.append(outcome.backend)
        if self.gpu is not None:
            self.gpu.landed(spec.local_blocks)  # host-staged: into VRAM before vLLM may schedule the request
        whole = len(spec.local_blocks) * self.layout.block_size
        tokens = spec.end_token - spec.start_token if spec.end_token else whole
        backend = ",".join(dict.fromkeys(",".join(backends).split(",")))
        self.transfers.record(spec.request_id, nbytes, seconds, backend, tokens=tokens)
        if self.config.log_transfers:
            log.info("kvbroker pull: request %s, %d blocks, %d bytes in %.2f ms over %s (%.2f GB/s) from %d prefill "
                     "rank(s)", spec.request_id, len(spec.local_blocks), nbytes, seconds * 1e3, backend,
                     nbytes / max(seconds, 1e-9) / 1e9, sources)
        return frozenset()

    def _pull_units(self, spec: PullSpec, call: Callable[[], TransferResult]) -> _Pulled | frozenset[int]:
        """Runs one transfer of the request (linking first, and once more if the link went away); the failed local
        blocks if it did not land."""
        assert self.cache is not None
        everything = frozenset(spec.local_blocks)
        remote = spec.remote
        for attempt in (1, 2):
            try:
                self.links.ensure(remote.cluster_id)
                started = time.monotonic()  # the pull alone: linking on first use is not transfer time
                result = call()
            except NotYetLinkError:
                self.links.forget(remote.cluster_id)  # the daemon dropped the link (peer restart): link again once
                if attempt == 2:
                    log.warning("request %s: cluster %d is not linked; recomputing", spec.request_id,
                                remote.cluster_id)
                    self.transfers.record_recompute("unreachable", pull_failed=True)
                    return everything
                continue
            except LlmError as e:
                if e.status in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_TIMEOUT):
                    self.links.forget(remote.cluster_id)
                    if attempt == 1 and e.status == LlmStatus.LLM_LINK_FAILED and not e.failed_dst_blocks:
                        continue  # nothing moved: check the link (restarted or moved peer) and try once more
                landed_partly = e.failed_dst_blocks
                failed = blocks_of_units(self.layout, landed_partly) & everything if landed_partly else everything
                log.warning("request %s: pull from cluster %d failed (%s: %s); recomputing %d of %d blocks",
                            spec.request_id, remote.cluster_id, e.status.name, e.message, len(failed or everything),
                            len(everything))
                self.transfers.record_recompute(reason_of(e.status), pull_failed=True)
                return failed or everything
            return _Pulled(result.bytes_moved, time.monotonic() - started, result.backend)
        return everything

    # -- prefill: releases ----------------------------------------------------------------------------------------
    def _poll_releases(self) -> None:
        topic = release_topic(self.engine_id, self.rank)
        failing_since = 0.0
        while not self._stop.is_set():
            try:
                notes = self.client.fetch_notifications(
                    topic, wait=_POLL_WAIT_S, timeout=_POLL_WAIT_S + 10.0)
                failing_since = 0.0
            except LlmError as e:
                if not failing_since:
                    failing_since = time.monotonic()
                    log.warning("kvbroker connector: cannot fetch grant events (%s); held blocks stay held until "
                                "this recovers", e.message)
                self._stop.wait(_POLL_WAIT_S)
                continue
            now = time.monotonic()
            ours = self.endpoint.cluster_id if self.endpoint is not None else -1
            for note in notes:
                if note.cluster_id != ours:
                    # Only our daemon ends our grants; a peer's note on this topic frees nothing.
                    log.warning("kvbroker connector: ignoring a note on the grant topic from cluster %d",
                                note.cluster_id)
                    continue
                try:
                    req_id, outcome = parse_release(note.payload)
                except ValueError:
                    log.warning("kvbroker connector: ignoring a malformed grant event")
                    continue
                self.note_release(req_id, outcome, now)

    def note_release(self, request_id: str, outcome: str, at: float | None = None) -> None:
        """A request's grant ended (the event may arrive before the hold itself)."""
        with self._lock:
            self._released[request_id] = (time.monotonic() if at is None else at, outcome)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the threads and gives the KV memory back to the daemon; idempotent."""
        self._stop.set()
        self._pulls.shutdown(wait=True, cancel_futures=True)
        if self._poller is not None:
            self._poller.join(timeout=_POLL_WAIT_S + 11.0)
            self._poller = None
        if self.cache is not None:
            try:
                if self.gpu is not None:
                    self.gpu.close()
                else:
                    self.client.deallocate_cache(self.cache.cache_id, timeout=5.0)
            except LlmError as e:  # the lease frees it anyway
                log.warning("kvbroker connector: could not free KV cache %d (%s)", self.cache.cache_id, e.message)
            self.cache = None
        self.client.close()
