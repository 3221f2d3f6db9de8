"""Links peers made to us: the responder's half of the handshake, and the check of every later peer call.

Nothing here trusts a caller before it proved the deployment token (or, with mutual TLS, before TLS did): pending
handshakes are few, small and short-lived; links are made only by an Authenticate whose proof checks; links that go
unheard expire; both tables are bounded.

Who may hold how many links. A token holder can claim any cluster id and epoch, so neither proves who a caller is
(a certificate that names cluster ids does: a claim of another id is refused, see `authenticate`); what it cannot
choose freely is the network it connects from. Shares are therefore counted by source network (`InboundShares`: a
/24 of IPv4, a /64 of IPv6, where one party's hosts or pods usually sit), not by exact address, which a party with a
subnet or a few pods has many of. Links are bounded in total (`--max-links`), per claimed cluster id
(`--peer-links-per-cluster`) and per source network (`--peer-links-per-network`), and a full pool makes room in this
order: a silent link (unheard for 5 s while real peers heartbeat every second: a dead or restarted peer's) goes
first; then, if the newcomer's network holds fewer links of the pool than the network holding the most, at least two
fewer, that network's quietest link gives way ("fair share"); then
- a full cluster id or network never refuses: the newcomer displaces the least recently active link of that pool,
  one of its own network's where there is one. Nothing tells a peer from an impostor that claims its id from the same
  network (or, without certificates naming ids, from enough networks), so the impostor can make the peer's link churn
  (the peer links again), never keep it out;
- a full table refuses the newcomer (LLM_OUT_OF_MEMORY): its network holds as many as any. One network alone cannot
  fill it while `--peer-links-per-network` is below `--max-links`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
import urllib.parse
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from google.protobuf.message import Message

from kvbroker.v1 import peer_pb2
from kvbrokerd.errors import LlmStatus, fail, param_invalid
from kvbrokerd.links import linkauth

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
"""Peer protocol history: 1 — Handshake hands out the link secret, calls carry it; 2 — challenge-response handshake
(Handshake + Authenticate) bound to both cluster ids and nonces, link secrets derived on both sides and never sent,
calls carry a LinkProof, segment names instead of paths, Notify; 3 — answers that matter carry a MAC (Authenticate,
GetCacheInfo, the grant calls), grants (RedeemGrant, RenewGrant, ReleaseGrant)."""
MAX_EPOCH_BYTES = 64
MAX_PENDING = 4096
PENDING_TTL_S = 10.0
SILENT_AFTER_S = 5.0
"""A link unheard this long is not live (its peer heartbeats every second): it may make room for a new one."""
DEFAULT_LINK_TTL_S = 120.0


@dataclass(frozen=True, slots=True)
class InboundShares:
    """What one party may hold of the inbound links (daemon settings; see the module docstring)."""

    per_cluster: int = 64
    """Links claiming one cluster id: a peer needs one per restart in flight; more is someone claiming its id."""
    per_network: int = 256
    """Links from one source network: a network runs a few daemons per host."""
    ipv4_prefix: int = 24
    ipv6_prefix: int = 64
    """The networks shares are counted by: one party's hosts or pods share such a prefix; another party's rarely."""

    def network_of(self, host: str) -> str:
        """The network of `host` (an address as `source_host` gives it); a host that is not an address is its own."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host
        prefix = self.ipv4_prefix if ip.version == 4 else self.ipv6_prefix
        return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(eq=False, slots=True)
class InboundLink:
    remote_cluster_id: int
    remote_epoch: str
    created: float
    secret: bytes
    last_heard: float
    source: str = ""
    """The host the link was made from (`source_host` of the caller's address); "" where unknown."""
    network: str = ""
    """The network of `source` that the shares count by (`InboundShares.network_of`)."""
    replay: linkauth.ReplayWindow = field(default_factory=linkauth.ReplayWindow)


@dataclass(frozen=True, slots=True)
class _Pending:
    req: peer_pb2.HandshakeRequest
    responder_nonce: bytes
    expires: float


def source_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.1:5432`, `ipv6:[::1]:5432`, `ipv6:%5B::1%5D:5432`), normalized
    so that one host reads one way (an IPv4-mapped IPv6 address as IPv4); the port is not part of it: a caller opens
    as many connections as it likes."""
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return scheme or "unknown"
    host = rest.rpartition(":")[0].strip("[]") or rest
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def check_hello(req: peer_pb2.HandshakeRequest) -> None:
    if req.protocol_version != PROTOCOL_VERSION:
        fail(LlmStatus.LLM_LINK_FAILED, f"peer protocol {req.protocol_version} is not supported (we speak "
             f"{PROTOCOL_VERSION}); run the same kvbroker release on both sides")
    if len(req.instance_epoch.encode()) > MAX_EPOCH_BYTES:
        param_invalid(f"instance_epoch is longer than {MAX_EPOCH_BYTES} bytes")
    if len(req.caller_nonce) != linkauth.NONCE_BYTES:
        param_invalid(f"caller_nonce must be {linkauth.NONCE_BYTES} bytes")


class InboundTable:
    def __init__(self, cluster_id: int, key: bytes, *, max_links: int, link_ttl_s: float = DEFAULT_LINK_TTL_S,
                 shares: InboundShares = InboundShares()) -> None:
        self.cluster_id = cluster_id
        self._key = key
        self.max_links = max_links
        self.shares = shares
        self.link_ttl_s = link_ttl_s
        self.links: dict[bytes, InboundLink] = {}
        """By link id. Read by data-plane threads (dict lookups are atomic); changed on the event loop."""
        self.reclaimed: Counter[str] = Counter()
        """Links dropped by this table, by reason (`expired`, `silent`, `fair_share`, `displaced`), for the
        metrics."""
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()

    # -- the handshake -----------------------------------------------------------------------------------------
    def hello(self, req: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        """Step 1. Answers every well-formed hello the same way, whoever asks and whatever cluster it expects: the
        responder proof binds our real cluster id, so a caller expecting another learns only that the proof fails."""
        check_hello(req)
        self.expire()
        now = time.monotonic()
        while self._pending and (len(self._pending) >= MAX_PENDING or next(iter(self._pending.values())).expires < now):
            self._pending.popitem(last=False)
        challenge_id, nonce = linkauth.new_challenge_id(), linkauth.new_nonce()
        self._pending[challenge_id] = _Pending(req, nonce, now + PENDING_TTL_S)
        bound = self._binding(req, nonce, self.cluster_id)
        return peer_pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, challenge_id=challenge_id,
                                          responder_nonce=nonce,
                                          responder_proof=linkauth.handshake_proof(self._key, b"responder", bound))

    def authenticate(self, req: peer_pb2.AuthenticateRequest, source: str = "",
                     certified: frozenset[int] | None = None) -> InboundLink:
        """Step 2: makes the link if the caller proved the token. Every refusal of the proof reads the same. `source`:
        the host the call came from (`source_host`), which the shares count by; `certified`: the cluster ids the
        caller's certificate names (`tls.certified_cluster_ids`), None where it names none: a claim of another id is
        refused."""
        pending = self._pending.pop(bytes(req.challenge_id), None)
        bound = b"" if pending is None else self._binding(pending.req, pending.responder_nonce, self.cluster_id)
        expected = linkauth.handshake_proof(self._key, b"caller", bound)
        ok = hmac.compare_digest(expected, bytes(req.caller_proof))
        if pending is None or not ok or pending.expires < time.monotonic():
            fail(LlmStatus.LLM_LINK_FAILED, "peer authentication failed")
        hello = pending.req
        if hello.expected_cluster_id != self.cluster_id or hello.cluster_id == self.cluster_id:
            fail(LlmStatus.LLM_LINK_FAILED, "peer authentication failed")  # a valid proof cannot bind these
        if certified is not None and hello.cluster_id not in certified:
            log.warning("a peer from %s claimed cluster %d, but its certificate names %s; refused", source or "?",
                        hello.cluster_id, _listed(certified))
            fail(LlmStatus.LLM_LINK_FAILED, f"this peer's certificate names cluster {_listed(certified)}, not "
                 f"{hello.cluster_id}")
        network = self.shares.network_of(source)
        self._make_room(hello.cluster_id, network)
        now = time.monotonic()
        secret = linkauth.derive_link_secret(self._key, bound)
        link = InboundLink(hello.cluster_id, hello.instance_epoch, time.time(), secret, now, source, network)
        self.links[linkauth.link_id(secret)] = link
        return link

    def _binding(self, req: peer_pb2.HandshakeRequest, responder_nonce: bytes, responder_id: int) -> bytes:
        return linkauth.binding(req.cluster_id, responder_id, req.instance_epoch, bytes(req.caller_nonce),
                                responder_nonce, PROTOCOL_VERSION)

    def _make_room(self, cluster_id: int, network: str) -> None:
        """Room for one more link of `cluster_id` from `network`, or LLM_OUT_OF_MEMORY (see the module docstring)."""
        self.expire()
        mine = self._pool(lambda link: link.network == network)
        if len(mine) >= self.shares.per_network and not self._drop_silent(mine):
            # A restarted peer's link gives way first: it is the one the newcomer replaces.
            self._displace([item for item in mine if item[1].remote_cluster_id == cluster_id] or mine)
        same = self._pool(lambda link: link.remote_cluster_id == cluster_id)
        if len(same) >= self.shares.per_cluster and not self._drop_silent(same) and \
                not self._drop_fair_share(same, network):
            self._displace([item for item in same if item[1].network == network] or same)
        everyone = list(self.links.items())
        if len(everyone) >= self.max_links and not self._drop_silent(everyone) and \
                not self._drop_fair_share(everyone, network):
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"inbound link limit reached ({self.max_links}), and "
                 f"{network or 'this network'} already holds as many as any network")

    def _pool(self, belongs: Callable[[InboundLink], bool]) -> list[tuple[bytes, InboundLink]]:
        return [(lid, link) for lid, link in self.links.items() if belongs(link)]

    def _displace(self, pool: list[tuple[bytes, InboundLink]]) -> None:
        """Drops the least recently active link of `pool` (all live) for a newcomer."""
        lid, _ = min(pool, key=lambda item: item[1].last_heard)
        self._reclaim(lid, "displaced")

    def _drop_silent(self, pool: Iterable[tuple[bytes, InboundLink]]) -> bool:
        """Drops the quietest link of `pool` if it has been silent for SILENT_AFTER_S."""
        quietest = min(pool, key=lambda item: item[1].last_heard, default=None)
        if quietest is None or quietest[1].last_heard >= time.monotonic() - SILENT_AFTER_S:
            return False
        self._reclaim(quietest[0], "silent")
        return True

    def _drop_fair_share(self, pool: list[tuple[bytes, InboundLink]], network: str) -> bool:
        """Drops the quietest link of the network holding the most of `pool`, if that is at least two more than
        `network` holds (so the two never trade one slot back and forth)."""
        counts = Counter(link.network for _, link in pool)
        hog, most = max(counts.items(), key=lambda item: item[1])
        if hog == network or most < counts.get(network, 0) + 2:
            return False
        lid, _ = min(((lid, link) for lid, link in pool if link.network == hog), key=lambda item: item[1].last_heard)
        self._reclaim(lid, "fair_share")
        return True

    def _reclaim(self, lid: bytes, reason: str) -> None:
        link = self.links.pop(lid)
        self.reclaimed[reason] += 1
        # A live link displaced is worth a warning: either the shares are too small for this fleet, or someone
        # claims a peer's id (or crowds its network) and the peer's link churns.
        log.log(logging.WARNING if reason == "displaced" else logging.INFO,
                "inbound link of cluster %d from %s dropped (%s) to make room", link.remote_cluster_id,
                link.source or "?", reason)

    def expire(self) -> None:
        """Drops links whose peer has been silent for the link TTL (a live peer heartbeats every second)."""
        cutoff = time.monotonic() - self.link_ttl_s
        for lid in [lid for lid, link in self.links.items() if link.last_heard < cutoff]:
            link = self.links.pop(lid)
            self.reclaimed["expired"] += 1
            log.info("inbound link of cluster %d expired (silent for %.0f s)", link.remote_cluster_id, self.link_ttl_s)

    # -- later calls -------------------------------------------------------------------------------------------
    def authorize(self, method: str, request: Message, proof: peer_pb2.LinkProof) -> InboundLink:
        """Checks a call's LinkProof: a known link, a fresh sequence number and a MAC over the whole request."""
        link = self.links.get(bytes(proof.link_id))
        if link is not None and link.last_heard < time.monotonic() - self.link_ttl_s:
            self.expire()
            link = None
        if link is not None:
            body = _without_proof(request)
            mac = linkauth.call_mac(link.secret, method, bytes(proof.link_id), proof.seq, body)
            if hmac.compare_digest(mac, bytes(proof.mac)) and link.replay.accept(proof.seq):
                link.last_heard = time.monotonic()
                return link
        fail(LlmStatus.LLM_NOT_YET_LINK, "unknown link or bad proof: link first")

    def drop(self, link: InboundLink) -> None:
        for lid, known in list(self.links.items()):
            if known is link:
                del self.links[lid]

    def secret_for(self, lid: bytes) -> bytes | None:
        """For the data plane's challenge (any thread)."""
        link = self.links.get(bytes(lid))
        return None if link is None else link.secret

    def clear(self) -> None:
        self.links.clear()
        self._pending.clear()


def _listed(cluster_ids: frozenset[int]) -> str:
    return ", ".join(map(str, sorted(cluster_ids))) or "(none valid)"


def _without_proof(request: Message) -> bytes:
    copy = type(request)()
    copy.CopyFrom(request)
    copy.ClearField("proof")
    return copy.SerializeToString(deterministic=True)


def _without_mac(answer: Message) -> bytes:
    copy = type(answer)()
    copy.CopyFrom(answer)
    copy.ClearField("mac")
    return copy.SerializeToString(deterministic=True)


def seal(answer: Message, method: str, secret: bytes, lid: bytes, seq: int) -> Message:
    """Fills `answer.mac` (the responder's side of `answer_ok`)."""
    answer.ClearField("mac")
    answer.mac = linkauth.answer_mac(secret, method, lid, seq,  # type: ignore[attr-defined]
                                     answer.SerializeToString(deterministic=True))
    return answer


def answer_ok(answer: Message, method: str, secret: bytes, lid: bytes, seq: int) -> bool:
    mac = linkauth.answer_mac(secret, method, lid, seq, _without_mac(answer))
    return hmac.compare_digest(mac, bytes(answer.mac))  # type: ignore[attr-defined]


def sign(request: Message, method: str, secret: bytes, lid: bytes, seq: int) -> None:
    """Fills `request.proof` (the caller's side of `InboundTable.authorize`)."""
    request.ClearField("proof")
    mac = linkauth.call_mac(secret, method, lid, seq, request.SerializeToString(deterministic=True))
    request.proof.CopyFrom(peer_pb2.LinkProof(link_id=lid, seq=seq, mac=mac))  # type: ignore[attr-defined]
