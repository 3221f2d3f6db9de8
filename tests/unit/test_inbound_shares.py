"""Inbound link shares by source network (issue 30, finding 5), on the responder's table alone: a full cluster id or
network displaces its least recently active link and never refuses; a full table refuses only a network that holds as
many as any; a certificate's cluster ids bound what its holder may claim. The daemons' side: test_link_reclaim.py."""

from __future__ import annotations

import time

import pytest

from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.links import linkauth
from kvbrokerd.links.inbound import PROTOCOL_VERSION, InboundLink, InboundShares, InboundTable
from kvbrokerd.tls import certified_cluster_ids
from tests.peerkit import hello

US = 100
KEY = linkauth.token_key(b"a-token-of-the-whole-deployment")


def _link(table: InboundTable, cluster_id: int, source: str, certified: frozenset[int] | None = None) -> InboundLink:
    """Both handshake steps, as a token holder from `source`."""
    from kvbroker.v1 import peer_pb2

    req = hello(cluster_id, US)
    challenge = table.hello(req)
    bound = linkauth.binding(cluster_id, US, req.instance_epoch, req.caller_nonce, challenge.responder_nonce,
                             PROTOCOL_VERSION)
    proof = linkauth.handshake_proof(KEY, b"caller", bound)
    return table.authenticate(peer_pb2.AuthenticateRequest(challenge_id=challenge.challenge_id, caller_proof=proof),
                              source, certified)


def _alive(table: InboundTable, links: list[InboundLink]) -> list[bool]:
    return [any(known is link for known in table.links.values()) for link in links]


def test_networks_are_slash_24_and_slash_64_by_default_and_settable() -> None:
    shares = InboundShares()
    assert shares.network_of("10.1.2.3") == shares.network_of("10.1.2.200") == "10.1.2.0/24"
    assert shares.network_of("10.1.3.3") != shares.network_of("10.1.2.3")
    assert shares.network_of("fd00:1:2:3::9") == shares.network_of("fd00:1:2:3:ffff::1") == "fd00:1:2:3::/64"
    assert InboundShares(ipv4_prefix=32).network_of("10.1.2.3") == "10.1.2.3/32"


@pytest.mark.parametrize("sources", [["127.0.0.1"] * 4, [f"127.0.0.{i}" for i in range(2, 6)]])
def test_impostors_on_the_peers_network_make_its_link_churn_never_keep_it_out(sources: list[str]) -> None:
    table = InboundTable(US, KEY, max_links=64, shares=InboundShares(per_cluster=4))
    impostors = [_link(table, 7, source) for source in sources]
    real = _link(table, 7, "127.0.0.1")  # was refused: "cluster 7 already holds 4 live links"
    assert sum(_alive(table, impostors)) == 3 and table.reclaimed["displaced"] == 1
    assert _alive(table, [real]) == [True]


def test_impostors_from_another_network_give_way_and_never_displace_the_peer() -> None:
    table = InboundTable(US, KEY, max_links=64, shares=InboundShares(per_cluster=4))
    impostors = [_link(table, 7, "10.9.9.9") for _ in range(4)]
    real = _link(table, 7, "10.1.1.1")
    assert sum(_alive(table, impostors)) == 3 and table.reclaimed["fair_share"] == 1
    for _ in range(5):  # more impostors displace their own network's links
        impostors.append(_link(table, 7, "10.9.9.8"))
        real.last_heard = time.monotonic() - 3  # the quietest of all, yet never theirs to take
    assert _alive(table, [real]) == [True]


def test_a_full_network_displaces_its_own_quietest_link() -> None:
    table = InboundTable(US, KEY, max_links=64, shares=InboundShares(per_network=3))
    old = [_link(table, 10 + i, "10.0.0.1") for i in range(3)]
    old[1].last_heard -= 2
    _link(table, 20, "10.0.0.2")  # the same /24
    assert _alive(table, old) == [True, False, True]
    restarted = _link(table, 10, "10.0.0.3")  # a peer linking again replaces its own older link first
    assert _alive(table, old) == [False, False, True] and _alive(table, [restarted]) == [True]
    assert table.reclaimed["displaced"] == 2


def test_a_full_table_refuses_a_network_holding_as_many_as_any() -> None:
    table = InboundTable(US, KEY, max_links=4, shares=InboundShares(per_network=3))
    for i in range(2):
        _link(table, 10 + i, "10.0.0.1")
        _link(table, 20 + i, "10.0.1.1")
    with pytest.raises(LlmError) as info:
        _link(table, 30, "10.0.0.1")
    assert info.value.status == LlmStatus.LLM_OUT_OF_MEMORY and "inbound link limit" in info.value.message
    _link(table, 40, "10.0.2.1")  # a network holding none: the largest gives way


def test_a_certificate_naming_cluster_ids_claims_only_those() -> None:
    table = InboundTable(US, KEY, max_links=8)
    with pytest.raises(LlmError) as info:
        _link(table, 7, "10.0.0.1", certified=frozenset({5, 6}))
    assert info.value.status == LlmStatus.LLM_LINK_FAILED and "names cluster 5, 6, not 7" in info.value.message
    _link(table, 6, "10.0.0.1", certified=frozenset({5, 6}))
    _link(table, 7, "10.0.0.1", certified=None)  # a certificate naming none (or a token) claims any id


def test_the_cluster_ids_a_certificate_names() -> None:
    uri = b"kvbroker://cluster/"
    assert certified_cluster_ids({}) is None
    assert certified_cluster_ids({"peer_uri": [b"spiffe://x/y"], "peer_dns": [b"localhost"]}) is None
    assert certified_cluster_ids({"peer_uri": [uri + b"7", uri + b"18446744073709551615"]}) == frozenset({7, 2**64 - 1})
    # A malformed name still names: its holder can claim nothing, rather than anything.
    assert certified_cluster_ids({"peer_uri": [uri + b"-1", uri + b"x", uri + b"18446744073709551616"]}) == frozenset()
