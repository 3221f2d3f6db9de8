"""Grants of held blocks between real daemons: grant, redeem (a pull of exactly the granted blocks), renew, release,
expiry, and every refusal, each before any byte moves."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbroker import (
    CacheDesc,
    Grant,
    KvCacheNotExistError,
    LinkFailedError,
    OutOfMemoryError,
    ParamInvalidError,
)
from kvbroker._local import LocalDaemon
from kvbroker.shm import Cache
from kvbroker.v1 import broker_pb2
from tests.conftest import cluster_of
from tests.helpers import assert_bytes_equal, expected_pull, fill, snapshot, wait_until

DESC = CacheDesc(num_tensors=2, shape=(8, 64))
TOPIC = "grants/test"


class Pd:
    """A prefill daemon (makes grants) and a decode daemon linked to it (redeems them), with a cache on each."""

    def __init__(self, p: LocalDaemon, d: LocalDaemon) -> None:
        self.p, self.d = p, d
        self.pc, self.dc = p.client(), d.client()
        self.src: Cache = self.pc.allocate_cache(DESC)
        self.src2: Cache = self.pc.allocate_cache(DESC)
        self.dst: Cache = self.dc.allocate_cache(DESC)
        fill(self.src, 1)
        fill(self.src2, 3)
        fill(self.dst, 2)

    def grant(self, blocks: list[int], lease: float = 30.0, **kwargs: object) -> Grant:
        return self.pc.create_grant([self.src.cache_id, self.src2.cache_id], blocks, lease, label="req-1",
                                    event_topics=[TOPIC], **kwargs)  # type: ignore[arg-type]

    def events(self) -> list[tuple[int, broker_pb2.GrantEvent]]:
        out = []
        for note in self.pc.fetch_notifications(TOPIC):
            event = broker_pb2.GrantEvent()
            event.ParseFromString(note.payload)
            out.append((note.cluster_id, event))
        return out

    def refused_untouched(self, exc: type[Exception], match: str, grant: Grant, dst_blocks: list[int],
                          **kwargs: object) -> None:
        """The pull is refused with `exc` and the destination holds exactly what it held."""
        before = snapshot(self.dst)
        kwargs.setdefault("timeout", 2.0)  # a redeemed pull's blocks stay held until its deadline (plus a margin)
        with pytest.raises(exc, match=match):
            self.dc.pull_granted_kv_blocks(self.p.cluster_id, grant, self.dst, dst_blocks,
                                           **kwargs)  # type: ignore[arg-type]
        assert_bytes_equal(self.dst.tensors, before)


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pd]:
    root: Path = tmp_path_factory.mktemp("grants")
    with LocalDaemon(root, 61) as p, LocalDaemon(root, 62) as d:
        with d.client() as c:
            assert c.link_clusters([cluster_of(p)])[0].ok
        pd = Pd(p, d)
        try:
            yield pd
        finally:
            pd.pc.close()
            pd.dc.close()


def test_a_pull_with_a_grant_reads_exactly_the_granted_blocks_of_the_slot(pd: Pd) -> None:
    grant = pd.grant([5, 2, 7])
    assert 29 < grant.expires_in <= 30
    before = snapshot(pd.dst)
    # The grant's blocks from its second on (the decode side had the first one cached), from the second cache.
    result = pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [0, 1], cache_slot=1, first_block=1)
    assert result.bytes_moved == 2 * DESC.block_nbytes * 2
    assert_bytes_equal(pd.dst.tensors, expected_pull(pd.src2, before, [2, 7], [0, 1], range(2), range(2)))
    # Named blocks are fine when the grant covers them.
    before = snapshot(pd.dst)
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [3], src_blocks=[7])
    assert_bytes_equal(pd.dst.tensors, expected_pull(pd.src, before, [7], [3], range(2), range(2)))
    pd.dc.release_grant(grant, cluster_id=pd.p.cluster_id)
    assert [(c, e.grant_id, e.label, e.outcome) for c, e in pd.events()] == [
        (pd.p.cluster_id, grant.grant_id, "req-1", "released")]


def test_a_grant_of_units_covers_every_unit_of_its_blocks_and_no_other(pd: Pd) -> None:
    """An engine block addressed in finer units (the vLLM connector's head or token units): granted block b stands
    for the caches' blocks 2b and 2b + 1."""
    grant = pd.grant([3, 1], units_per_block=2)
    before = snapshot(pd.dst)
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [0, 4, 5], src_blocks=[7, 2, 3], timeout=2.0)
    assert_bytes_equal(pd.dst.tensors, expected_pull(pd.src, before, [7, 2, 3], [0, 4, 5], range(2), range(2)))
    before = snapshot(pd.dst)  # without src_blocks: the units of the granted blocks, in the grant's order
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [1, 2, 6], first_block=1, cache_slot=1, timeout=2.0)
    assert_bytes_equal(pd.dst.tensors, expected_pull(pd.src2, before, [7, 2, 3], [1, 2, 6], range(2), range(2)))
    pd.refused_untouched(ParamInvalidError, r"does not cover src blocks \[4, 5\]", grant, [0, 1], src_blocks=[4, 5],
                         timeout=2.0)
    pd.refused_untouched(ParamInvalidError, "covers 4 blocks; 2 from its block 3", grant, [0, 1], first_block=3,
                         timeout=2.0)
    # A release here cannot know that the redeemed pulls are over: their blocks stay until their holds end.
    pd.pc.release_grant(grant)
    pd.refused_untouched(KvCacheNotExistError, "released", grant, [0], src_blocks=[7], timeout=2.0)
    assert [e.outcome for _, e in wait_until(pd.events, what="the release's event, once the holds are over")] == [
        "released"]


def test_a_view_is_the_same_memory_in_other_blocks_and_a_grant_covers_it_in_its_own_units(pd: Pd) -> None:
    """A cache of 8 blocks viewed as 32 quarter blocks (the vLLM connector's token units over its head units): a
    grant of blocks [3, 1] in units of 2 (the cache's blocks 6, 7 and 2, 3) covers the view's quarters 24..31 and
    8..15 in the slots after the caches, in units of 8, and nothing else."""
    quarter = CacheDesc(num_tensors=2, shape=(32, 16))
    view = pd.pc.allocate_cache(quarter, view_of=pd.src)
    assert view.cache_id != pd.src.cache_id
    assert bytes(view.tensors[1]) == bytes(pd.src.tensors[1])
    grant = pd.grant([3, 1], units_per_block=2, view_cache_ids=[view.cache_id], view_units_per_block=8)
    before = snapshot(pd.dst)
    # Into quarters of the destination: it is viewed too.
    dst_view = pd.dc.allocate_cache(quarter, view_of=pd.dst)
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, dst_view, [0, 9], src_blocks=[13, 27], cache_slot=2,
                                 timeout=2.0)
    after = snapshot(pd.dst)
    for t in range(2):
        src, dst, old = (np.asarray(x).view(np.uint8).reshape(32, -1) for x in (pd.src.tensors[t], after[t], before[t]))
        assert np.array_equal(dst[[0, 9]], src[[13, 27]])
        untouched = [q for q in range(32) if q not in (0, 9)]
        assert np.array_equal(dst[untouched], old[untouched])
    for match, kwargs in ((r"does not cover src blocks \[16\]", {"src_blocks": [16], "cache_slot": 2}),
                          ("no cache_slot 3", {"cache_slot": 3})):
        with pytest.raises(ParamInvalidError, match=match):
            pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, dst_view, [0], timeout=2.0,
                                         **kwargs)
    assert [bytes(t) for t in pd.dst.tensors] == [bytes(t) for t in after]
    with pytest.raises(KvCacheNotExistError, match="does not exist"):
        pd.dc.allocate_cache(quarter, view_of=pd.dst.cache_id + 1000)
    with pd.p.client() as stranger, pytest.raises(ParamInvalidError, match="not a live cache this daemon allocated "
                                                                         "for this session"):
        stranger.allocate_cache(quarter, view_of=pd.src)  # only the session that holds the memory views it
    with pytest.raises(ParamInvalidError, match="has 2 tensors of 1024 bytes, not 2 of 512"):
        pd.pc.allocate_cache(CacheDesc(num_tensors=2, shape=(16, 16)), view_of=pd.src)
    # The view outlives the release of its base's name, and its own release leaves the base's memory alone.
    pd.dc.deallocate_cache(dst_view)
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [2], src_blocks=[6], timeout=2.0)
    pd.pc.deallocate_cache(view)  # a granted view removed: the grant ends, as for any of its caches
    (_, event), = wait_until(pd.events, what="the grant's end posted")
    assert event.outcome == "cache removed"
    assert bytes(pd.src.tensors[0])  # still mapped and readable


def test_pulls_a_grant_does_not_cover_are_refused_before_any_byte_moves(pd: Pd) -> None:
    grant = pd.grant([5, 2, 7])
    pd.refused_untouched(ParamInvalidError, r"does not cover src blocks \[1\]", grant, [0, 1], src_blocks=[2, 1])
    pd.refused_untouched(ParamInvalidError, "covers 3 blocks; 2 from its block 2", grant, [0, 1], first_block=2)
    pd.refused_untouched(ParamInvalidError, "no cache_slot 2", grant, [0], cache_slot=2)
    with pytest.raises(ParamInvalidError, match="not cache"):  # a cache of the caller's choosing: never
        req = broker_pb2.PullKvBlocksRequest(dst_cache_id=pd.dst.cache_id, dst_blocks=[0])
        req.src_cache_index.cluster_id = pd.p.cluster_id
        req.src_cache_index.cache_id = pd.src.cache_id + 1000
        req.grant.grant.grant_id, req.grant.grant.secret = grant.grant_id, grant.secret
        pd.dc._call("PullKvBlocks", req, 10.0)
    forged = Grant(grant.grant_id, bytes(32))
    pd.refused_untouched(KvCacheNotExistError, "grant unknown, lapsed or released", forged, [0])
    stranger = Grant(bytes(16), grant.secret)
    pd.refused_untouched(KvCacheNotExistError, "grant unknown, lapsed or released", stranger, [0])
    pd.refused_untouched(ParamInvalidError, "16-byte id and a 32-byte secret", Grant(b"short", b"x"), [0])
    # Nobody but the holder renews or releases it.
    for wrong in (forged, stranger):
        with pytest.raises(KvCacheNotExistError):
            pd.dc.renew_grant(wrong, cluster_id=pd.p.cluster_id)
        with pytest.raises(KvCacheNotExistError):
            pd.dc.release_grant(wrong, cluster_id=pd.p.cluster_id)
    assert pd.events() == []
    pd.pc.release_grant(grant)  # the creator holds it too (cluster_id 0: this daemon)
    pd.refused_untouched(KvCacheNotExistError, "grant unknown, lapsed or released", grant, [0])
    with pytest.raises(KvCacheNotExistError):
        pd.dc.release_grant(grant, cluster_id=pd.p.cluster_id)
    # The refused pulls had redeemed it: the blocks stay held until their deadlines (plus a margin) are over.
    assert [e.outcome for _, e in wait_until(pd.events, what="the release's event")] == ["released"]


def test_a_grant_lapses_unless_renewed_and_its_end_is_posted(pd: Pd) -> None:
    renewed, lapsing = pd.grant([1], lease=1.0), pd.grant([2], lease=0.2)
    assert pd.dc.renew_grant(renewed, 5.0, cluster_id=pd.p.cluster_id) > 1.0  # a longer lease from now on
    (cluster, event), = wait_until(pd.events, what="the unrenewed grant's lapse posted")
    assert (cluster, event.grant_id, event.outcome) == (pd.p.cluster_id, lapsing.grant_id, "lapsed")
    pd.refused_untouched(KvCacheNotExistError, "grant unknown, lapsed or released", lapsing, [0])
    with pytest.raises(KvCacheNotExistError):
        pd.dc.renew_grant(lapsing, cluster_id=pd.p.cluster_id)
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, renewed, pd.dst, [0], timeout=2.0)
    pd.pc.release_grant(renewed)
    # The decode daemon's renewal was told the grant lives 5 s more (it may pull on that answer): the creator's
    # release frees the blocks only then (test_grant_cache.py).
    assert [e.outcome for _, e in wait_until(pd.events, what="the released grant's end posted")] == ["released"]


def test_renewals_never_pass_the_cap(pd: Pd) -> None:
    grant = pd.grant([1], lease=0.2, max_hold=0.4)

    def capped() -> list[tuple[int, broker_pb2.GrantEvent]]:
        with contextlib.suppress(KvCacheNotExistError):
            pd.dc.renew_grant(grant, cluster_id=pd.p.cluster_id)
        return pd.events()

    (_, event), = wait_until(capped, poll=0.05, what="the grant ending at its cap although renewed")
    assert event.outcome == "capped"


def test_removing_a_granted_cache_ends_the_grant(pd: Pd) -> None:
    extra = pd.pc.allocate_cache(DESC)
    grant = pd.pc.create_grant([extra.cache_id], [0, 1], 30.0, label="gone", event_topics=[TOPIC, TOPIC + "/2"])
    pd.pc.deallocate_cache(extra)
    (_, event), = wait_until(pd.events, what="the grant's end posted")
    assert (event.label, event.outcome) == ("gone", "cache removed")
    assert [n.cluster_id for n in pd.pc.fetch_notifications(TOPIC + "/2")] == [pd.p.cluster_id]
    pd.refused_untouched(KvCacheNotExistError, "grant unknown, lapsed or released", grant, [0])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cache_ids": [], "blocks": [1]}, "1..64 caches"),
    ({"cache_ids": [-5], "blocks": [1]}, "does not exist"),
    ({"blocks": []}, "1..65536 blocks"),
    ({"blocks": [1, 1]}, "repeat a block"),
    ({"blocks": [8]}, "block 8 .* is out of range"),
    ({"blocks": [4], "units_per_block": 2}, r"block 4 \(of 2 blocks each\) is out of range"),
    ({"units_per_block": 65537}, "units_per_block must be in"),
    ({"lease": 0.05}, "lease_ms must be in"),
    ({"lease": 10.0, "max_hold": 5.0}, "max_hold_ms must be"),
    ({"label": "a\nb"}, "label holds a control"),
    ({"event_topics": ["x" * 129]}, "event topic must be"),
])
def test_bad_grants_are_refused(pd: Pd, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"cache_ids": [pd.src.cache_id], "blocks": [1], "lease": 1.0, **kwargs}
    with pytest.raises(ParamInvalidError if "exist" not in message else KvCacheNotExistError, match=message):
        pd.pc.create_grant(**args)  # type: ignore[arg-type]


def test_a_grant_needs_a_ready_link_to_the_daemon_that_made_it(pd: Pd) -> None:
    grant = pd.grant([1])
    with pytest.raises((LinkFailedError, Exception), match="not linked"):
        pd.pc.renew_grant(grant, cluster_id=pd.d.cluster_id)  # p never linked to d
    pd.pc.release_grant(grant)
    pd.events()


def test_a_pull_by_a_grant_near_its_cap_ends_before_the_grant_or_is_refused_untouched(pd: Pd) -> None:
    """Issue 30, finding 1: near its cap a grant cannot outlive a long pull (the engine reuses the blocks at the cap):
    the pull's deadline is cut to the grant's end, so it never reads past it; when the grant is about to end, the
    pull is refused before any byte moves."""
    grant = pd.grant([4], lease=3.0, max_hold=3.0)
    made = time.monotonic()
    before = snapshot(pd.dst)
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [0], timeout=10.0)  # shortened, still in time
    assert_bytes_equal(pd.dst.tensors, expected_pull(pd.src, before, [4], [0], range(2), range(2)))
    # The scenario, not a wait: the grant ages to less than the redeem's safety margin (0.5 s) before its cap.
    time.sleep(max(0.0, made + 2.7 - time.monotonic()))
    pd.refused_untouched(KvCacheNotExistError, "max hold is near|unknown, lapsed", grant, [1], timeout=10.0)
    assert [e.outcome for _, e in wait_until(pd.events, what="the grant's end at its cap")] == ["capped"]


def test_a_release_by_the_creator_keeps_the_blocks_while_a_redeemed_pull_may_read_them(pd: Pd) -> None:
    """Issue 30, finding 2: the creator's release ends the grant for new pulls at once, but its event (after which
    the engine reuses the blocks) waits for the redeemed pull's deadline and margin."""
    grant = pd.grant([6])
    pd.dc.pull_granted_kv_blocks(pd.p.cluster_id, grant, pd.dst, [1], timeout=3.0)
    pd.pc.release_grant(grant)
    assert pd.events() == [], "the blocks were freed while the pull may still have been reading them"
    pd.refused_untouched(KvCacheNotExistError, "grant unknown, lapsed or released", grant, [2])
    assert [e.outcome for _, e in wait_until(pd.events, what="the release's event")] == ["released"]


def test_grants_together_cover_at_most_max_granted_blocks(tmp_path: Path) -> None:
    """Issue 30, finding 8: the blocks of all grants are bounded daemon-wide (an operator's setting)."""
    with LocalDaemon(tmp_path, 65, extra_args=["--max-granted-blocks", "10"]) as p, p.client() as c:
        cache = c.allocate_cache(DESC)
        first = c.create_grant([cache.cache_id], list(range(8)), 30.0)
        with pytest.raises(OutOfMemoryError, match="max_granted_blocks=10"):
            c.create_grant([cache.cache_id], [0, 1, 2], 30.0)
        c.release_grant(first)
        c.create_grant([cache.cache_id], [0, 1, 2], 30.0)
