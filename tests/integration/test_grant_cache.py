"""A decode daemon remembers what a grant's renewal told it (links/grantcache.py), and a pull by that grant skips the
`Peer.RedeemGrant` round trip only when that is safe: same secret, lease long enough for the pull, grant not released
through us, link not re-made. Counted on both daemons' metrics (kvbroker_grants_redeemed_total on the prefill side,
kvbroker_grant_pulls_total {source} on the decode side): behaviour, never timing. Over shm and tcp."""

from __future__ import annotations

import signal
import socket
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbroker import CacheDesc, Grant, KvCacheNotExistError
from kvbroker._client import Client
from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.grants import GrantKeeper, PeerLinks, renewal_lease
from kvbroker.shm import Cache
from kvbroker.types import LinkState
from kvbroker.v1 import broker_pb2
from kvbrokerd import backends
from tests.conftest import cluster_of
from tests.helpers import assert_bytes_equal, expected_pull, fill, snapshot, wait_until

DESC = CacheDesc(num_tensors=2, shape=(8, 64))
TOPIC = "grant-cache/test"
METRICS = ["--metrics-listen", "127.0.0.1:0"]


def _metric(d: Client, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{d.get_cluster_info().metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and set(labels.items()) <= set(s.labels.items()))


class Pd:
    """A prefill daemon that grants, a decode daemon linked to it that renews and pulls, a cache on each."""

    def __init__(self, p: LocalDaemon, d: LocalDaemon) -> None:
        self.p, self.d = p, d
        # Pulls of 10 s deadline: a 30 s lease outlives them with the hold margin (the connector asks for such a lease).
        self.pc, self.dc = p.client(lease_ttl=None), d.client(timeout=10.0)
        self.src: Cache = self.pc.allocate_cache(DESC)
        self.dst: Cache = self.dc.allocate_cache(DESC)
        fill(self.src, 1)
        fill(self.dst, 2)

    def grant(self, blocks: list[int], lease: float = 30.0, cache: Cache | None = None) -> Grant:
        return self.pc.create_grant([(cache or self.src).cache_id], blocks, lease, label="req",
                                    event_topics=[TOPIC])

    def renew(self, grant: Grant) -> float:
        return self.dc.renew_grant(grant, cluster_id=self.p.cluster_id)

    def counts(self) -> tuple[float, float, float]:
        """(RedeemGrant calls the prefill daemon answered, pulls the decode daemon made from a remembered answer,
        RedeemGrant calls the decode daemon made)."""
        return (_metric(self.pc, "kvbroker_grants_redeemed_total"),
                _metric(self.dc, "kvbroker_grant_pulls_total", source="remembered"),
                _metric(self.dc, "kvbroker_grant_pulls_total", source="redeemed"))

    def pull_checked(self, grant: Grant, src_blocks: list[int], dst_blocks: list[int], *,
                     src: Cache | None = None, timeout: float | None = None) -> None:
        before = snapshot(self.dst)
        self.dc.pull_granted_kv_blocks(self.p.cluster_id, grant, self.dst, dst_blocks, timeout=timeout)
        assert_bytes_equal(self.dst.tensors, expected_pull(src or self.src, before, src_blocks, dst_blocks,
                                                           range(2), range(2)))

    def refused_untouched(self, grant: Grant) -> None:
        before = snapshot(self.dst)
        with pytest.raises(KvCacheNotExistError):
            self.dc.pull_granted_kv_blocks(self.p.cluster_id, grant, self.dst, [0])
        assert_bytes_equal(self.dst.tensors, before)

    def events(self) -> list[str]:
        out = []
        for note in self.pc.fetch_notifications(TOPIC):
            event = broker_pb2.GrantEvent()
            event.ParseFromString(note.payload)
            out.append(event.outcome)
        return out

    def close(self) -> None:
        self.pc.close()
        self.dc.close()


def _host_backends() -> list[str]:
    return [name for name in ("shm", "tcp") if name in backends.registered()]


@pytest.fixture(scope="module", params=_host_backends())
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pd]:
    reason = backends.unavailable(request.param)
    if reason is not None:
        pytest.skip(reason)
    root: Path = tmp_path_factory.mktemp(f"grant-cache-{request.param}")
    first = 81 if request.param == "shm" else 83
    with LocalDaemon(root, first, backends=(request.param,), extra_args=METRICS) as p, \
            LocalDaemon(root, first + 1, backends=(request.param,), extra_args=METRICS) as d:
        pair = Pd(p, d)
        try:
            assert pair.dc.link_clusters([cluster_of(p)])[0].ok
            yield pair
        finally:
            pair.close()


def test_a_renewed_grants_pull_makes_no_redeem_call_until_released(pd: Pd) -> None:
    grant = pd.grant([5, 2, 7])
    assert pd.renew(grant) > 25.0
    redeemed, remembered, asked = pd.counts()
    pd.pull_checked(grant, [5, 2, 7], [0, 1, 2])
    pd.pull_checked(grant, [5, 2], [3, 4])  # again, from the same answer
    assert pd.counts() == (redeemed, remembered + 2, asked)
    # Released by its holder through the decode daemon: forgotten there, so the next pull asks, and is refused.
    pd.dc.release_grant(grant, cluster_id=pd.p.cluster_id)
    assert pd.events() == ["released"]
    pd.refused_untouched(grant)
    assert pd.counts() == (redeemed, remembered + 2, asked + 1)


def test_a_pull_during_the_grants_renewal_waits_for_its_answer_instead_of_redeeming(pd: Pd) -> None:
    """A decode engine pulls a request as soon as it is scheduled, usually while the first renewal of its grant is
    on its way: the pull takes that renewal's answer (the prefill daemon is stopped until both are waiting on it)."""
    grant = pd.grant([6, 3])
    redeemed, remembered, asked = pd.counts()
    pd.p.signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            renewal = pool.submit(pd.renew, grant)
            wait_until(lambda: _metric(pd.dc, "kvbroker_grant_renewals_in_flight") == 1, what="the renewal sent")
            pull = pool.submit(pd.pull_checked, grant, [6, 3], [0, 1])
            wait_until(lambda: _metric(pd.dc, "kvbroker_grant_pulls_waiting") == 1, what="the pull waiting")
            pd.p.signal(signal.SIGCONT)
            assert renewal.result(timeout=30) > 25.0
            pull.result(timeout=30)
    finally:
        pd.p.signal(signal.SIGCONT)
    assert pd.counts() == (redeemed, remembered + 1, asked)
    assert _metric(pd.dc, "kvbroker_grant_renewals_in_flight") == _metric(pd.dc, "kvbroker_grant_pulls_waiting") == 0
    pd.dc.release_grant(grant, cluster_id=pd.p.cluster_id)
    assert pd.events() == ["released"]


def test_a_pull_whose_deadline_outlasts_the_remembered_lease_redeems(pd: Pd) -> None:
    grant = pd.grant([3], lease=2.0)
    pd.renew(grant)
    redeemed, remembered, asked = pd.counts()
    # 5 s of deadline + the hold margin is more than the 2 s lease the renewal stated: the peer must hold it.
    pd.pull_checked(grant, [3], [0], timeout=5.0)
    assert pd.counts() == (redeemed + 1, remembered, asked + 1)
    pd.dc.release_grant(grant, cluster_id=pd.p.cluster_id)
    assert pd.events() == ["released"]


def test_a_wrong_secret_never_uses_the_remembered_answer(pd: Pd) -> None:
    grant = pd.grant([4, 1])
    pd.renew(grant)
    redeemed, remembered, asked = pd.counts()
    pd.refused_untouched(Grant(grant.grant_id, bytes(32)))
    assert pd.counts() == (redeemed, remembered, asked + 1)  # it went to the peer, which refused it
    pd.pull_checked(grant, [4, 1], [6, 7])  # the holder's answer is still there
    assert pd.counts() == (redeemed, remembered + 1, asked + 1)
    pd.dc.release_grant(grant, cluster_id=pd.p.cluster_id)
    assert pd.events() == ["released"]


def test_a_release_elsewhere_keeps_the_blocks_until_the_promised_lease_ends(pd: Pd) -> None:
    """The creator releases a grant whose renewal told the decode daemon it lives on: the grant is over for every
    use at once, but its blocks are freed (its event posted) only when that stated lease has ended, so a pull from
    the remembered answer never reads blocks given to another request."""
    grant = pd.grant([6], lease=1.0)
    pd.renew(grant)
    pd.pc.release_grant(grant)
    assert pd.events() == []  # not freed yet
    with pytest.raises(KvCacheNotExistError):
        pd.renew(grant)  # over for every use (and so forgotten on the decode side)
    pd.refused_untouched(grant)
    assert wait_until(pd.events, what="the blocks freed once the promised lease is over") == ["released"]


def test_a_removed_cache_is_refused_by_the_data_plane(pd: Pd) -> None:
    extra = pd.pc.allocate_cache(DESC)
    fill(extra, 9)
    grant = pd.grant([1, 2], cache=extra)
    pd.renew(grant)
    _, remembered, _ = pd.counts()
    pd.pull_checked(grant, [1, 2], [0, 1], src=extra)
    pd.pc.deallocate_cache(extra)
    assert wait_until(pd.events, what="the grant's end posted") == ["cache removed"]
    pd.refused_untouched(grant)  # from the remembered answer: the removed cache is refused, no byte lands
    assert pd.counts()[1] in (remembered + 1, remembered + 2)


def test_the_connectors_first_renewal_lets_a_pull_scheduled_at_once_skip_the_redeem(pd: Pd) -> None:
    """The GrantKeeper renews as soon as it watches a request, asking for a lease that outlasts a pull (the prefill
    engine's own, 2 s here, would not): a pull right after finds the answer remembered."""
    grant = pd.grant([2, 5], lease=2.0)
    keeper = GrantKeeper(PeerLinks(pd.dc, {pd.p.cluster_id: pd.p.peer_address}, 5.0), renewal_lease(10.0))
    try:
        keeper.watch("req", pd.p.cluster_id, grant)
        wait_until(lambda: keeper.renewals, what="the first renewal")
        redeemed, remembered, asked = pd.counts()
        pd.pull_checked(grant, [2, 5], [0, 1], timeout=10.0)
        assert pd.counts() == (redeemed, remembered + 1, asked)
        keeper.release("req", "pulled")
        assert wait_until(pd.events, what="the grant released") == ["released"]
    finally:
        keeper.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_prefill_restart_drops_the_remembered_answers(tmp_path: Path) -> None:
    peer_args = [*METRICS, "--peer-listen", f"127.0.0.1:{_free_port()}"]
    with LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=[*METRICS, "--auto-relink"]) as d:
        p = LocalDaemon(tmp_path, 1, backends=("tcp",), extra_args=peer_args).start()
        try:
            pair = Pd(p, d)
            assert pair.dc.link_clusters([cluster_of(p)])[0].ok
            grant = pair.grant([1, 2])
            pair.renew(grant)
            old_epoch = pair.dc.list_links()[0].remote_epoch
            pair.pc.close()
            p.stop()
            p = LocalDaemon(tmp_path, 1, backends=("tcp",), extra_args=peer_args).start()
            pair.pc = p.client(lease_ttl=None)
            wait_until(lambda: pair.dc.list_links()[0].remote_epoch not in ("", old_epoch)
                       and pair.dc.list_links()[0].state == LinkState.READY, what="the link re-made")
            _, remembered, asked = pair.counts()
            pair.refused_untouched(grant)  # asked the new incarnation, which never made it
            assert pair.counts()[1:] == (remembered, asked + 1)
        finally:
            pair.close()
            p.stop()


def test_a_renewal_remembers_the_grants_views_and_a_pull_from_one_makes_no_redeem_call(pd: Pd) -> None:
    """A grant's views (other blocks over its caches' memory: the vLLM connector's token units) ride in the renewal's
    answer too: a pull from a view's slot by the renewed grant goes without a RedeemGrant, in the view's units."""
    quarter = CacheDesc(num_tensors=2, shape=(32, 16))
    with pd.p.client() as owner:  # (a view is made of a cache of the caller's own session)
        base = owner.allocate_cache(DESC)
        fill(base, 5)
        view = owner.allocate_cache(quarter, view_of=base)
        grant = owner.create_grant([base.cache_id], [3, 1], 30.0, view_cache_ids=[view.cache_id],
                                   view_units_per_block=4)
        dst_view = pd.dc.allocate_cache(quarter, view_of=pd.dst)
        try:
            pd.renew(grant)
            redeemed, remembered, asked = pd.counts()
            before = snapshot(pd.dst)
            pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, dst_view, [0, 5], src_blocks=[13, 4], cache_slot=1)
            assert pd.counts() == (redeemed, remembered + 1, asked)
            for t in range(2):
                src, got, old = (x.view("uint8").reshape(32, -1) for x in (base.tensors[t], pd.dst.tensors[t],
                                                                          before[t]))
                assert (got[[0, 5]] == src[[13, 4]]).all()
                assert (got[[q for q in range(32) if q not in (0, 5)]] == old[[q for q in range(32)
                                                                               if q not in (0, 5)]]).all()
        finally:
            owner.release_grant(grant)
            pd.dc.deallocate_cache(dst_view)
            owner.deallocate_cache(view)
            owner.deallocate_cache(base)
