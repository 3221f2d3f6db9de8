"""Grants and links, as the connector uses them: which prefill daemons a decode node may dial (configuration only),
and the thread that renews and releases a decode node's grants on prefill blocks.

Trust: a request's `kv_transfer_params` come from the HTTP client. They name a grant (an unguessable capability for
one request's blocks, made by the prefill daemon) and the prefill daemon's cluster id; the address dialled for that
cluster comes only from `kvbroker_prefill_daemons`. A link that is READY is never torn down here (a request cannot
make us drop a healthy link); only one the daemon reports BROKEN by a peer restart is made anew. Each cluster has its
own lock, so linking to one slow prefill daemon never stalls pulls from another.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from kvbroker._client import Client
from kvbroker.status import LlmError, LlmStatus
from kvbroker.types import ClusterInfo, ClusterResult, Grant, LinkState

log = logging.getLogger(f"vllm.{__name__}")

MIN_RENEW_S = 0.05
LINK_POLL_S = 0.05
PULL_MARGIN_S = 3.0
"""What the decode daemon wants a renewed grant to outlive a pull's deadline by before it pulls on the renewal's
answer instead of redeeming the grant first (its hold margin, 2 s, its safety margin, 0.5 s, and slack)."""


def renewal_lease(pull_timeout_s: float) -> float:
    """The lease a decode node's renewals ask for: long enough that, at any point between two renewals (they come
    when a third of it has passed, so two thirds of it are left at worst), the decode daemon can pull on the renewal's
    answer without a `RedeemGrant` round trip (docs/vllm.md). It is also how long a dead decode node's grant keeps
    the prefill blocks (within the grant's cap), as the prefill's own `kvbroker_hold_lease_s` does otherwise."""
    return min(3600.0, max(0.1, 1.5 * (pull_timeout_s + PULL_MARGIN_S)))


class UntrustedPrefill(LlmError):
    """The request names a prefill daemon that is not in `kvbroker_prefill_daemons`."""


class PeerLinks:
    def __init__(self, client: Client, trusted: dict[int, str], timeout_s: float) -> None:
        self.client = client
        self.trusted = dict(trusted)
        self.timeout_s = timeout_s
        self._ready: set[int] = set()
        self._locks: dict[int, threading.Lock] = {}

    def refusal(self, cluster_id: int) -> str:
        if cluster_id in self.trusted:
            return ""
        return (f"prefill daemon cluster {cluster_id} is not one this decode node trusts (kvbroker_prefill_daemons: "
                f"{sorted(self.trusted) or 'none'})")

    def ensure(self, cluster_id: int) -> None:
        """A READY link to a trusted prefill daemon (LlmError if there is none)."""
        if cluster_id in self._ready:
            return
        if why := self.refusal(cluster_id):
            raise UntrustedPrefill(LlmStatus.LLM_PARAM_INVALID, why)
        with self._locks.setdefault(cluster_id, threading.Lock()):  # atomic: one lock per cluster
            if cluster_id in self._ready:
                return
            info = ClusterInfo(remote_cluster_id=cluster_id, remote_address=self.trusted[cluster_id])
            result = self.client.link_clusters([info], timeout=self.timeout_s)[0]
            if result.status == LlmStatus.LLM_PROCESSING_LINK:
                # Another client of the daemon (this engine's scheduler renewing a grant, or another rank) is making
                # the same link right now: wait for it instead of failing this pull.
                result = self._await_link(info)
            if result.status == LlmStatus.LLM_ALREADY_LINK and self._stale(info):
                # The peer restarted (the link is BROKEN) or the operator moved it: only then is the link made anew,
                # and only to the configured address.
                self.client.unlink_clusters([info], force=True, timeout=self.timeout_s)
                result = self.client.link_clusters([info], timeout=self.timeout_s)[0]
            if not result.ok and result.status != LlmStatus.LLM_ALREADY_LINK:
                raise LlmError(result.status, f"cannot link to cluster {cluster_id} at {info.remote_address}: "
                                              f"{result.message}")
            self._ready.add(cluster_id)
            if result.ok:  # logged by whichever of this engine's clients made the link, once
                log.info("kvbroker connector: linked to cluster %d at %s", cluster_id, info.remote_address)

    def _await_link(self, info: ClusterInfo) -> ClusterResult:
        deadline = time.monotonic() + self.timeout_s
        while True:
            state = next((link.state for link in self.client.list_links(timeout=self.timeout_s)
                          if link.remote_cluster_id == info.remote_cluster_id), None)
            if state != LinkState.LINKING or time.monotonic() >= deadline:
                break  # up, or the other attempt failed (then this one links, or says why it cannot)
            time.sleep(LINK_POLL_S)
        return self.client.link_clusters([info], timeout=self.timeout_s)[0]  # ALREADY_LINK once it is up

    def _stale(self, info: ClusterInfo) -> bool:
        for link in self.client.list_links(timeout=self.timeout_s):
            if link.remote_cluster_id == info.remote_cluster_id:
                return link.state == LinkState.BROKEN or link.remote_address != info.remote_address
        return False

    def forget(self, cluster_id: int) -> None:
        self._ready.discard(cluster_id)


@dataclass
class _Held:
    cluster_id: int
    grant: Grant
    renew_at: float  # time.monotonic()


@dataclass
class _Release:
    request_id: str
    cluster_id: int
    grant: Grant
    reason: str
    due: float  # time.monotonic()


class GrantKeeper:
    """Decode side: renews the grant of each request waiting for its KV, and releases grants, on its own thread
    (the engine's scheduler never waits for a prefill daemon)."""

    def __init__(self, links: PeerLinks, lease_s: float = 0.0) -> None:
        """`lease_s`: the lease each renewal asks for (0: the grant's own; see `renewal_lease`)."""
        self.links = links
        self.lease_s = lease_s
        self._held: dict[str, _Held] = {}
        self._releases: list[_Release] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.renewals = 0

    def watch(self, request_id: str, cluster_id: int, grant: Grant) -> None:
        """Renews the grant from now until `release`: a renewal right away learns the lease's length, and leaves
        the decode daemon the grant's description, so that a pull scheduled at once skips the redemption."""
        with self._cond:
            self._held[request_id] = _Held(cluster_id, grant, 0.0)
            self._start()
            self._cond.notify_all()

    def release(self, request_id: str, reason: str, cluster_id: int = 0, grant: Grant | None = None,
                delay: float = 0.0) -> None:
        """Stops renewing and tells the prefill daemon (once) that the blocks may be freed: at once, or `delay`
        seconds from now unless `hurry` names the request first."""
        with self._cond:
            held = self._held.pop(request_id, None)
            if held is not None:
                cluster_id, grant = held.cluster_id, held.grant
            if grant is None:
                return
            self._releases.append(_Release(request_id, cluster_id, grant, reason, time.monotonic() + delay))
            self._start()
            self._cond.notify_all()

    def hurry(self, request_ids: set[str]) -> None:
        """Sends these requests' delayed releases now."""
        if not request_ids:
            return
        with self._cond:
            for r in self._releases:
                if r.request_id in request_ids:
                    r.due = 0.0
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._run, name="kvbroker-grants", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Sends the releases still delayed, then stops the thread."""
        with self._cond:
            for r in self._releases:
                r.due = 0.0
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.links.timeout_s * 2 + 1)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [(r, h) for r, h in self._held.items() if h.renew_at <= now]
                releases = [r for r in self._releases if r.due <= now]
                if not due and not releases:
                    if self._stop and not self._releases:
                        return
                    wait = min([h.renew_at for h in self._held.values()] + [r.due for r in self._releases],
                               default=now + 60.0) - now
                    # A renewal is never asked for sooner than MIN_RENEW_S; a delayed release goes when it is due.
                    self._cond.wait(max(MIN_RENEW_S if not self._releases else 0.0, wait))
                    continue
                self._releases = [r for r in self._releases if r.due > now]
            for r in releases:
                self._release(r.request_id, r.cluster_id, r.grant, r.reason)
            for request_id, held in due:
                self._renew(request_id, held)

    def _renew(self, request_id: str, held: _Held) -> None:
        try:
            self.links.ensure(held.cluster_id)
            left = self.links.client.renew_grant(held.grant, self.lease_s, cluster_id=held.cluster_id,
                                                 timeout=self.links.timeout_s)
            self.renewals += 1
            # A third of what is left: two renewals may fail (a slow moment) before the grant lapses.
            held.renew_at = time.monotonic() + max(MIN_RENEW_S, left / 3)
        except LlmError as e:
            if e.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST or isinstance(e, UntrustedPrefill):
                with self._cond:
                    self._held.pop(request_id, None)  # gone for good: its pull fails and the blocks are recomputed
                log.warning("request %s: its prefill grant cannot be renewed (%s)", request_id, e.message)
                return
            if e.status in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_NOT_YET_LINK):
                self.links.forget(held.cluster_id)
            held.renew_at = time.monotonic() + 1.0
            log.warning("request %s: could not renew its prefill grant (%s); retrying", request_id, e.message)

    def _release(self, request_id: str, cluster_id: int, grant: Grant, reason: str) -> None:
        try:
            self.links.ensure(cluster_id)
            self.links.client.release_grant(grant, cluster_id=cluster_id, timeout=self.links.timeout_s)
        except LlmError as e:
            if e.status != LlmStatus.LLM_KV_CACHE_NOT_EXIST:  # already ended: nothing to free
                log.warning("request %s: could not release its prefill grant (%s: %s); it lapses with its lease",
                            request_id, reason, e.message)
