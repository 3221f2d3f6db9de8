"""The decode side's memory of renewed grants (links/grantcache.py): bounded, per secret, never past its lease, never
revived by an answer that a release overtook; and the renewal answer's new fields keep older peers' MAC checks."""

from __future__ import annotations

import time

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.grants import renewal_lease
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.v1 import peer_pb2, types_pb2
from kvbrokerd.links.grantcache import SAFETY_S, GrantCache
from kvbrokerd.links.inbound import answer_ok, seal

GID, SECRET = b"g" * 16, b"s" * 32


def _remembered(cache: GrantCache, gid: bytes = GID, secret: bytes = SECRET, lease_s: float = 30.0) -> None:
    ticket = cache.asking(gid)
    cache.remember(ticket, gid, secret, (7,), (1, 2), 1, time.monotonic(), int(lease_s * 1000))


def test_a_remembered_grant_serves_only_its_secret_and_pulls_that_end_within_its_lease() -> None:
    cache = GrantCache()
    _remembered(cache)
    known = cache.lookup(GID, SECRET, 10.0)
    assert known is not None and (known.cache_ids, list(known.blocks)) == ((7,), [1, 2])
    assert cache.lookup(GID, b"x" * 32, 10.0) is None
    assert cache.lookup(GID, SECRET, 30.0 - SAFETY_S) is None  # would outlive what the peer stated
    cache.forget(GID, b"x" * 32)  # a stranger's failed call: the holder's answer stays
    assert cache.lookup(GID, SECRET, 1.0) is not None
    cache.forget(GID, SECRET)
    assert cache.lookup(GID, SECRET, 1.0) is None


def test_an_answer_overtaken_by_a_release_is_not_remembered() -> None:
    cache = GrantCache()
    ticket = cache.asking(GID)
    cache.forget(GID, SECRET)  # released while the renewal was on its way back
    cache.remember(ticket, GID, SECRET, (7,), (1,), 1, time.monotonic(), 30_000)
    assert cache.lookup(GID, SECRET, 1.0) is None


def test_a_short_or_empty_answer_is_not_remembered_and_the_cache_is_bounded() -> None:
    cache = GrantCache(max_entries=3)
    _remembered(cache, lease_s=SAFETY_S / 2)
    assert len(cache) == 0
    ticket = cache.asking(GID)
    cache.remember(ticket, GID, SECRET, (), (), 0, time.monotonic(), 30_000)  # an older peer's answer
    assert len(cache) == 0
    for i in range(5):
        _remembered(cache, gid=bytes([i]) * 16)
    assert len(cache) == 3
    assert cache.lookup(bytes([0]) * 16, SECRET, 1.0) is None  # the least recently used went first
    assert cache.lookup(bytes([4]) * 16, SECRET, 1.0) is not None
    cache.max_blocks = 5  # blocks are bounded too: 2 each here
    _remembered(cache, gid=b"x" * 16)
    assert len(cache) == 2 and cache.lookup(bytes([3]) * 16, SECRET, 1.0) is None
    ticket = cache.asking(b"y" * 16)
    cache.remember(ticket, b"y" * 16, SECRET, (7,), range(6), 1, time.monotonic(), 30_000)  # larger than the bound
    assert len(cache) == 2 and cache.lookup(b"y" * 16, SECRET, 1.0) is None


def _old_renew_answer_class() -> type:
    """PeerRenewGrantResponse as a peer of the previous release knows it (expires_in_ms and mac only)."""
    pool = descriptor_pool.DescriptorPool()
    for module in (types_pb2, peer_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        if module is peer_pb2:
            msg = next(m for m in proto.message_type if m.name == "PeerRenewGrantResponse")
            keep = [f for f in msg.field if f.number <= 2]
            del msg.field[:]
            msg.field.extend(keep)
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("kvbroker.v1.PeerRenewGrantResponse"))


def test_the_renewal_answers_new_fields_keep_an_older_callers_mac_check() -> None:
    secret, lid = b"k" * 32, b"l" * 16
    new = peer_pb2.PeerRenewGrantResponse(expires_in_ms=5000, cache_ids=[3, 4], blocks=[9], units_per_block=2,
                                          instance_epoch="e")
    seal(new, "RenewGrant", secret, lid, 7)
    old = _old_renew_answer_class()()
    old.ParseFromString(new.SerializeToString())
    assert old.expires_in_ms == 5000
    assert answer_ok(old, "RenewGrant", secret, lid, 7)  # the unknown fields are kept, and covered by the MAC
    # And an older peer's answer reads here as one with nothing to remember.
    legacy = _old_renew_answer_class()(expires_in_ms=5000)
    seal(legacy, "RenewGrant", secret, lid, 8)
    parsed = peer_pb2.PeerRenewGrantResponse.FromString(legacy.SerializeToString())
    assert answer_ok(parsed, "RenewGrant", secret, lid, 8) and not parsed.cache_ids


def test_the_decode_schedulers_renewals_ask_for_a_lease_that_outlasts_a_pull() -> None:
    """1.5 x (pull deadline + 3 s): two thirds of it (what is left at worst before the next renewal) outlast a pull's
    deadline plus the decode daemon's margins (2 s hold, 0.5 s safety)."""
    side = SchedulerSide(ConnectorConfig(pull_timeout_s=10.0), "engine-d", 32)
    assert side.grants.lease_s == renewal_lease(10.0) == 19.5
    assert renewal_lease(10.0) * 2 / 3 - SAFETY_S > 10.0 + 2.0
