"""Links peers made to us: the responder's half of the handshake, and the check of every later peer call.

Nothing here trusts a caller before it proved the deployment token (or, with mutual TLS, before TLS did): pending
handshakes are few, small and short-lived; links are made only by an Authenticate whose proof checks; a new link never
replaces a live one (a restarted peer's old links expire by silence, never because a caller that holds the token
claims a new epoch: only silence proves a link dead); links that go unheard expire; both tables are bounded.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
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
MAX_LINKS_PER_CLUSTER = 64
SILENT_AFTER_S = 5.0
"""A link unheard this long is not live (its peer heartbeats every second): it may make room for a new one."""
DEFAULT_LINK_TTL_S = 120.0


@dataclass(eq=False, slots=True)
class InboundLink:
    remote_cluster_id: int
    remote_epoch: str
    created: float
    secret: bytes
    last_heard: float
    replay: linkauth.ReplayWindow = field(default_factory=linkauth.ReplayWindow)


@dataclass(frozen=True, slots=True)
class _Pending:
    req: peer_pb2.HandshakeRequest
    responder_nonce: bytes
    expires: float


def check_hello(req: peer_pb2.HandshakeRequest) -> None:
    if req.protocol_version != PROTOCOL_VERSION:
        fail(LlmStatus.LLM_LINK_FAILED, f"peer protocol {req.protocol_version} is not supported (we speak "
             f"{PROTOCOL_VERSION}); run the same kvbroker release on both sides")
    if len(req.instance_epoch.encode()) > MAX_EPOCH_BYTES:
        param_invalid(f"instance_epoch is longer than {MAX_EPOCH_BYTES} bytes")
    if len(req.caller_nonce) != linkauth.NONCE_BYTES:
        param_invalid(f"caller_nonce must be {linkauth.NONCE_BYTES} bytes")


class InboundTable:
    def __init__(self, cluster_id: int, key: bytes, *, max_links: int, link_ttl_s: float = DEFAULT_LINK_TTL_S
                 ) -> None:
        self.cluster_id = cluster_id
        self._key = key
        self.max_links = max_links
        self.link_ttl_s = link_ttl_s
        self.links: dict[bytes, InboundLink] = {}
        """By link id. Read by data-plane threads (dict lookups are atomic); changed on the event loop."""
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

    def authenticate(self, req: peer_pb2.AuthenticateRequest) -> InboundLink:
        """Step 2: makes the link if the caller proved the token. Every refusal reads the same."""
        pending = self._pending.pop(bytes(req.challenge_id), None)
        bound = b"" if pending is None else self._binding(pending.req, pending.responder_nonce, self.cluster_id)
        expected = linkauth.handshake_proof(self._key, b"caller", bound)
        ok = hmac.compare_digest(expected, bytes(req.caller_proof))
        if pending is None or not ok or pending.expires < time.monotonic():
            fail(LlmStatus.LLM_LINK_FAILED, "peer authentication failed")
        hello = pending.req
        if hello.expected_cluster_id != self.cluster_id or hello.cluster_id == self.cluster_id:
            fail(LlmStatus.LLM_LINK_FAILED, "peer authentication failed")  # a valid proof cannot bind these
        self._make_room(hello.cluster_id)
        now = time.monotonic()
        secret = linkauth.derive_link_secret(self._key, bound)
        link = InboundLink(hello.cluster_id, hello.instance_epoch, time.time(), secret, now)
        self.links[linkauth.link_id(secret)] = link
        return link

    def _binding(self, req: peer_pb2.HandshakeRequest, responder_nonce: bytes, responder_id: int) -> bytes:
        return linkauth.binding(req.cluster_id, responder_id, req.instance_epoch, bytes(req.caller_nonce),
                                responder_nonce, PROTOCOL_VERSION)

    def _make_room(self, cluster_id: int) -> None:
        """Never drops a live link: a token holder can claim any cluster id and epoch, so neither proves it is the
        peer that made the link. A restarted peer's old links fall silent and go (evicted here, or expired)."""
        self.expire()
        same = [(lid, link) for lid, link in self.links.items() if link.remote_cluster_id == cluster_id]
        if len(same) >= MAX_LINKS_PER_CLUSTER:
            lid, quietest = min(same, key=lambda item: item[1].last_heard)
            if quietest.last_heard >= time.monotonic() - SILENT_AFTER_S:
                fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cluster {cluster_id} already holds {MAX_LINKS_PER_CLUSTER} live "
                     "links to us; unlink some first")
            del self.links[lid]
        if len(self.links) >= self.max_links:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"inbound link limit reached ({self.max_links})")

    def expire(self) -> None:
        """Drops links whose peer has been silent for the link TTL (a live peer heartbeats every second)."""
        cutoff = time.monotonic() - self.link_ttl_s
        for lid in [lid for lid, link in self.links.items() if link.last_heard < cutoff]:
            link = self.links.pop(lid)
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
