"""Worker side of the connector: owns the engine's KV memory (through the daemon), runs pulls, keeps held blocks.

Decode role: each pull runs on a small thread pool (the engine keeps stepping meanwhile); a finished pull, good or
bad, is reported through `get_finished` in the same step as the blocks that did not land, so vLLM recomputes those
instead of reading them. The decode node then tells the prefill node's daemon (a notification over the link it
pulled through) that the request's blocks may be freed.

Prefill role: a finished request's blocks stay allocated until the decode node's notification arrives, or until
`release_timeout_s` passes (logged), whichever comes first.
"""

from __future__ import annotations

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
from kvbroker.integrations.vllm.layout import MEMORY_MLA, KvLayout, layout_of_tag
from kvbroker.integrations.vllm.memory import DaemonKvAllocation
from kvbroker.integrations.vllm.params import (
    PullSpec,
    ReleaseSpec,
    RemoteKv,
    WorkerEndpoint,
    parse_release,
    release_count,
    release_payload,
    release_topic,
)
from kvbroker.integrations.vllm.remap import blocks_of_units, plan_pull, refusal, release_targets
from kvbroker.integrations.vllm.stats import TransferLog
from kvbroker.shm import Cache
from kvbroker.status import LlmError, LlmStatus, NotYetLinkError
from kvbroker.types import CacheIndex, ClusterInfo, KvCacheExtParam, LinkState, PullBlocks, TransferResult

# Under "vllm." so that the lines join vLLM's own log output (vLLM configures only its logger tree).
log = logging.getLogger(f"vllm.{__name__}")

# One tensor per layer, addressed in units of a few tokens of one head (layout.KvLayout.desc).
_ONE_TENSOR_PER_LAYER = KvCacheExtParam(tensor_num_per_layer=1)
_POLL_WAIT_S = 1.0
# A pull must end this long before the prefill node's hold on the blocks expires (covers clock skew between hosts):
# past the hold the blocks may already serve another request there, and their bytes are not this request's KV.
HOLD_MARGIN_S = 1.0


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
        self._lock = threading.Lock()
        self._pull_ended = threading.Condition(self._lock)
        self._in_flight = 0
        self._pulls = ThreadPoolExecutor(config.max_concurrent_pulls, thread_name_prefix="kvbroker-pull")
        # Releases go out on their own thread: a slow or unreachable prefill daemon (up to `link_timeout_s` per
        # notification) must not hold a pull slot while other requests wait for their KV.
        self._notifier = ThreadPoolExecutor(1, thread_name_prefix="kvbroker-notify")
        self._pulled: list[PullOutcome] = []
        self._load_errors: set[int] = set()
        self._links: dict[int, str] = {}
        self._link_lock = threading.Lock()
        self._held: dict[str, float] = {}
        self._released: dict[str, tuple[float, str]] = {}
        self._votes: dict[str, tuple[float, set[int]]] = {}
        """Releases heard from some, not yet all, of the decode ranks that read a request (first heard, ranks)."""
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
    def start(self, pulls: Iterable[PullSpec], releases: Iterable[ReleaseSpec], holds: dict[str, float]) -> None:
        pulls = list(pulls)
        with self._lock:
            self._held.update(holds)
            self._in_flight += len(pulls)
        for spec in pulls:
            self._pulls.submit(self._pull_and_release, spec)
        for rel in releases:
            self._notifier.submit(self._release, rel.remote, rel.reason)

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
            for req_id, deadline in list(self._held.items()):
                if req_id in self._released:
                    sending.add(req_id)
                elif now >= deadline:
                    log.warning("request %s: no decode node released its KV blocks within %.0f s; freeing them",
                                req_id, self.config.release_timeout_s)
                    sending.add(req_id)
            for req_id in sending:
                del self._held[req_id]
                self._released.pop(req_id, None)
            # Releases for requests this worker never held (or no longer holds) are forgotten after the timeout.
            for req_id, (at, _) in list(self._released.items()):
                if now - at > self.config.release_timeout_s:
                    del self._released[req_id]
            for req_id, (at, _) in list(self._votes.items()):
                if now - at > self.config.release_timeout_s:
                    del self._votes[req_id]
        return sending, {o.request_id for o in pulled}

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- decode: pulls --------------------------------------------------------------------------------------------
    def _pull_and_release(self, spec: PullSpec) -> None:
        failed: frozenset[int] = frozenset()
        try:
            failed = self._pull(spec)
        except Exception:  # a bug must not strand the request in WAITING_FOR_REMOTE_KVS
            log.exception("request %s: pull crashed; recomputing its KV", spec.request_id)
            failed = frozenset(spec.local_blocks)
        finally:
            if failed:  # reported too: the request's output says its tokens were recomputed, not pulled
                self.transfers.record_failed(spec.request_id)
            with self._lock:
                self._pulled.append(PullOutcome(spec.request_id, failed))
                self._in_flight -= 1
                self._pull_ended.notify_all()
        self.transfers.record_outcome(ok=not failed)
        self._notifier.submit(self._release, spec.remote, "failed" if failed else "pulled", spec.request_id, True)

    def _pull(self, spec: PullSpec) -> frozenset[int]:
        """Returns the local blocks that did not land."""
        everything = frozenset(spec.local_blocks)
        if spec.refused:
            log.error("request %s: not pulling from prefill engine %s: %s", spec.request_id, spec.remote.engine_id,
                      spec.refused)
            return everything
        assert self.cache is not None
        remote = spec.remote
        refused = refusal(self.layout, remote.layout_tag)
        if refused is not None:
            log.error("request %s: incompatible KV layouts, recomputing: %s", spec.request_id, refused.message)
            return everything
        theirs = layout_of_tag(remote.layout_tag)
        if theirs.tp_size != len(remote.cache_ids):
            log.error("request %s: prefill engine names %d caches for tp %d; recomputing", spec.request_id,
                      len(remote.cache_ids), theirs.tp_size)
            return everything
        try:
            start, end = (spec.start_token, spec.end_token) if spec.end_token else (
                0, len(spec.local_blocks) * self.layout.block_size)
            pulls = plan_pull(self.layout, self.rank, theirs, spec.local_blocks, spec.remote_blocks, start, end)
        except ValueError as e:
            log.error("request %s: cannot map the prefill engine's blocks, recomputing: %s", spec.request_id, e)
            return everything
        if self._hold_expired(remote):
            log.error("request %s: the prefill node's hold on its blocks has expired; recomputing (raise "
                      "kvbroker_release_timeout_s on the prefill node if this recurs)", spec.request_id)
            return everything
        dst = self.cache.cache_id
        if len(pulls) == 1:
            (one,) = pulls
            src = CacheIndex(cluster_id=remote.cluster_id, cache_id=remote.cache_ids[one.remote_rank])
            src_units: Any = one.src_units  # uint64 arrays: the client takes them as they are
            dst_units: Any = one.dst_units
            call: Callable[[], TransferResult] = lambda: self.client.pull_kv_blocks(  # noqa: E731
                src, dst, src_units, dst_units, _ONE_TENSOR_PER_LAYER, timeout=self.config.pull_timeout_s)
        else:  # several prefill ranks (prefill TP larger): one transfer, validated whole before any byte moves
            groups = [PullBlocks(CacheIndex(cluster_id=remote.cluster_id, cache_id=remote.cache_ids[p.remote_rank]),
                                 dst, tuple(p.src_units.tolist()), tuple(p.dst_units.tolist()), _ONE_TENSOR_PER_LAYER)
                      for p in pulls]
            call = lambda: self.client.transfer_kv_blocks_batch(  # noqa: E731
                groups, timeout=self.config.pull_timeout_s)
        outcome = self._pull_units(spec, call)
        if isinstance(outcome, frozenset):
            return outcome
        nbytes, seconds, backend = outcome.bytes_moved, outcome.seconds, outcome.backend
        if self._hold_expired(remote):
            log.error("request %s: the pull ended after the prefill node's hold on its blocks expired; its bytes "
                      "cannot be trusted, recomputing", spec.request_id)
            return everything
        self.transfers.record(spec.request_id, nbytes, seconds, backend, tokens=end - start)
        if self.config.log_transfers:
            log.info("kvbroker pull: request %s, %d blocks, %d bytes in %.2f ms over %s (%.2f GB/s) from %d prefill "
                     "rank(s)", spec.request_id, len(spec.local_blocks), nbytes, seconds * 1e3, backend,
                     nbytes / max(seconds, 1e-9) / 1e9, len(pulls))
        return frozenset()

    def _pull_units(self, spec: PullSpec, call: Callable[[], TransferResult]) -> _Pulled | frozenset[int]:
        """Runs the request's transfer (linking first, and once more if the link went away); the failed local
        blocks if it did not land."""
        assert self.cache is not None
        everything = frozenset(spec.local_blocks)
        remote = spec.remote
        for attempt in (1, 2):
            try:
                self._ensure_link(remote)
                started = time.monotonic()  # the pull alone: linking on first use is not transfer time
                result = call()
            except NotYetLinkError:
                self._forget_link(remote.cluster_id)  # the daemon dropped the link (peer restart): link again once
                if attempt == 2:
                    log.warning("request %s: cluster %d is not linked; recomputing", spec.request_id,
                                remote.cluster_id)
                    return everything
                continue
            except LlmError as e:
                if e.status in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_TIMEOUT):
                    self._forget_link(remote.cluster_id)
                landed_partly = e.failed_dst_blocks
                failed = blocks_of_units(self.layout, landed_partly) & everything if landed_partly else everything
                log.warning("request %s: pull from cluster %d failed (%s: %s); recomputing %d of %d blocks",
                            spec.request_id, remote.cluster_id, e.status.name, e.message, len(failed or everything),
                            len(everything))
                return failed or everything
            # A batch names each group's backend ("shm,shm"): the request's report names each backend once.
            backend = ",".join(dict.fromkeys(result.backend.split(",")))
            return _Pulled(result.bytes_moved, time.monotonic() - started, backend)
        return everything

    @staticmethod
    def _hold_expired(remote: RemoteKv) -> bool:
        return bool(remote.hold_expires_unix) and time.time() > remote.hold_expires_unix - HOLD_MARGIN_S

    def _ensure_link(self, remote: RemoteKv) -> None:
        with self._link_lock:
            if self._links.get(remote.cluster_id) == remote.peer_address:
                return
            info = ClusterInfo(remote_cluster_id=remote.cluster_id, remote_address=remote.peer_address)
            result = self.client.link_clusters([info], timeout=self.config.link_timeout_s)[0]
            if result.status == LlmStatus.LLM_PROCESSING_LINK:
                # Another TP rank of this engine (same daemon, another process) is making this link: wait for it.
                deadline = time.monotonic() + self.config.link_timeout_s
                while not self._link_usable(info) and time.monotonic() < deadline:
                    self._stop.wait(0.02)
                result = self.client.link_clusters([info], timeout=self.config.link_timeout_s)[0]
            if result.status == LlmStatus.LLM_ALREADY_LINK and not self._link_usable(info):
                # The daemon keeps a link we cannot use (the peer restarted, or moved): make it anew.
                self.client.unlink_clusters([info], force=True, timeout=self.config.link_timeout_s)
                result = self.client.link_clusters([info], timeout=self.config.link_timeout_s)[0]
            if not result.ok and result.status != LlmStatus.LLM_ALREADY_LINK:
                raise LlmError(result.status, f"cannot link to cluster {remote.cluster_id} at {remote.peer_address}: "
                                              f"{result.message}")
            self._links[remote.cluster_id] = remote.peer_address
            log.info("kvbroker connector: linked to cluster %d at %s", remote.cluster_id, remote.peer_address)

    def _link_usable(self, info: ClusterInfo) -> bool:
        for link in self.client.list_links(timeout=self.config.link_timeout_s):
            if link.remote_cluster_id == info.remote_cluster_id:
                return link.state == LinkState.READY and link.remote_address == info.remote_address
        return False

    def _forget_link(self, cluster_id: int) -> None:
        with self._link_lock:
            self._links.pop(cluster_id, None)

    def _release(self, remote: RemoteKv, outcome: str, request_id: str = "", mapped: bool = False) -> None:
        """Tells the prefill node it may free the request's blocks. Best effort: its timeout covers a lost one.

        Goes to every prefill rank this rank read (`mapped`: a pull ran) and to the ranks it answers for; each
        notification says how many decode ranks will notify that prefill rank (remap.release_targets)."""
        theirs = None
        if mapped and refusal(self.layout, remote.layout_tag) is None:
            theirs = layout_of_tag(remote.layout_tag)
            if theirs.tp_size != len(remote.cache_ids):
                theirs = None
        targets = release_targets(self.layout, self.rank, len(remote.cache_ids), theirs)
        for prefill_rank, of in sorted(targets.items()):
            try:
                self.client.send_notification(
                    remote.cluster_id, release_topic(remote.engine_id, prefill_rank),
                    release_payload(remote.request_id, outcome, self.rank, of), timeout=self.config.link_timeout_s)
            except LlmError as e:
                log.warning("request %s: could not tell cluster %d to free its blocks (%s); it frees them after its "
                            "timeout", request_id or remote.request_id, remote.cluster_id, e.message)
                return

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
                    log.warning("kvbroker connector: cannot fetch release notifications (%s); held blocks are freed "
                                "after %.0f s until this recovers", e.message, self.config.release_timeout_s)
                self._stop.wait(_POLL_WAIT_S)
                continue
            now = time.monotonic()
            for note in notes:
                try:
                    req_id, outcome = parse_release(note.payload)
                    rank, of = release_count(note.payload)
                except ValueError:
                    log.warning("kvbroker connector: ignoring a malformed release from cluster %d", note.cluster_id)
                    continue
                self.note_release(req_id, outcome, now, rank=rank, of=of)

    def note_release(self, request_id: str, outcome: str, at: float | None = None, rank: int = 0,
                     of: int = 1) -> None:
        """Decode rank `rank` is done with a request's blocks (its notification arrived, possibly before the hold);
        they are released once `of` distinct decode ranks have said so."""
        at = time.monotonic() if at is None else at
        with self._lock:
            ranks = self._votes.setdefault(request_id, (at, set()))[1]
            ranks.add(rank)
            if len(ranks) >= of:
                del self._votes[request_id]
                self._released[request_id] = (at, outcome)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the threads and gives the KV memory back to the daemon; idempotent."""
        self._stop.set()
        self._pulls.shutdown(wait=True, cancel_futures=True)
        self._notifier.shutdown(wait=True)  # after the pulls, which queue releases; each is bounded by its timeout
        if self._poller is not None:
            self._poller.join(timeout=_POLL_WAIT_S + 11.0)
            self._poller = None
        if self.cache is not None:
            try:
                self.client.deallocate_cache(self.cache.cache_id, timeout=5.0)
            except LlmError as e:  # the lease frees it anyway
                log.warning("kvbroker connector: could not free KV cache %d (%s)", self.cache.cache_id, e.message)
            self.cache = None
        self.client.close()
