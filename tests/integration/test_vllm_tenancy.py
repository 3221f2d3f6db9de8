"""The vLLM connector against real daemons, driven as an attacker drives it: through the `kv_transfer_params` of a
request, which come from the HTTP client. A request can pull only the blocks its own grant covers (never another
request's, whatever cache or block ids it names), cannot end another request's hold, and never makes the decode node
dial an address: prefill daemons come from `kvbroker_prefill_daemons` alone, and a healthy link to one is never torn
down or re-dialled because a request named another address for it."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The connector's worker side and the buffer vLLM would allocate are torch tensors.
pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

import torch

from kvbroker import Client, Grant, KvCacheNotExistError
from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.grants import PeerLinks
from kvbroker.integrations.vllm.layout import KvLayout
from kvbroker.integrations.vllm.params import WorkerEndpoint, parse_release, release_topic
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.integrations.vllm.worker import WorkerSide
from kvbroker.shm import Cache
from kvbroker.types import LinkState
from tests.helpers import wait_until

BS = 32
LAYOUT = KvLayout(num_layers=2, num_blocks=16, block_size=BS, num_kv_heads=1, head_size=64, dtype="float32",
                  page_bytes=BS * 128 * 4, model_id="m", tp_size=1)
TOKENS = 2 * BS  # two blocks per request
VICTIM_BLOCKS, ATTACKER_BLOCKS = [1, 2], [4, 5]


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0


class Fleet:
    """A prefill daemon with one engine's cache (the scheduler side that grants finished requests) and a decode
    daemon with one engine (scheduler and worker sides, the prefill daemon trusted)."""

    def __init__(self, p: LocalDaemon, d: LocalDaemon) -> None:
        self.p, self.d = p, d
        self.pc: Client = p.client()
        self.src: Cache = self.pc.allocate_cache(LAYOUT.desc())
        for layer in self.src.tensors:
            for block in range(LAYOUT.num_blocks):
                layer[block] = 100.0 + block  # each block tells where it came from
        self.prefill = SchedulerSide(ConnectorConfig(target=p.target, hold_lease_s=60), "engine-p", BS)
        self.prefill.set_endpoints({0: WorkerEndpoint(0, p.cluster_id, p.peer_address, self.src.cache_id,
                                                      LAYOUT.tag())})
        config = ConnectorConfig(target=d.target, link_timeout_s=3, pull_timeout_s=5,
                                 prefill_daemons=f"{p.cluster_id}={p.peer_address}")
        self.worker = WorkerSide(config, "engine-d", 0, LAYOUT)
        with self.worker.allocation_context():
            buffer = torch.zeros(LAYOUT.buffer_bytes, dtype=torch.int8)
        per_layer = LAYOUT.num_blocks * LAYOUT.page_bytes
        shape = (LAYOUT.num_blocks, LAYOUT.num_kv_heads, LAYOUT.block_size, 2 * LAYOUT.head_size)
        self.layers = [buffer[i * per_layer:(i + 1) * per_layer].view(torch.float32).view(shape)
                       for i in range(LAYOUT.num_layers)]
        self.worker.register({f"layer{i}": t for i, t in enumerate(self.layers)})
        self.decode = SchedulerSide(config, "engine-d", BS)
        assert self.worker.endpoint is not None
        self.decode.set_endpoints({0: self.worker.endpoint})
        self._next_local = 0

    def finish_prefill(self, request_id: str, blocks: list[int]) -> dict[str, Any]:
        req = FakeRequest(request_id, TOKENS, {"do_remote_decode": True}, num_computed_tokens=TOKENS)
        delay, params = self.prefill.request_finished(req, blocks, finished_normally=True)
        assert delay and params is not None
        self.prefill.take_plan()
        return params

    def run_decode(self, request_id: str, params: dict[str, Any]) -> tuple[list[int], set[int]]:
        """Schedules a decode request as vLLM would; returns its local blocks and those that did not land."""
        local = [self._next_local, self._next_local + 1]
        self._next_local += 2
        req = FakeRequest(request_id, TOKENS, dict(params))
        self.decode.on_new_request(req)
        count, _ = self.decode.num_new_matched_tokens(req, 0)
        self.decode.after_alloc(req, local, local, count)
        plan = self.decode.take_plan()
        if not plan.pulls:
            return local, set(local)  # nothing to pull: vLLM computes the blocks
        self.worker.start(plan.pulls, plan.holds)
        wait_until(lambda: request_id in self.worker.finished()[1], timeout=30, poll=0.02,
                   what=f"the pull of {request_id}")
        self.decode.on_pulls_ended({request_id})
        return local, self.worker.take_load_errors()

    def origin(self, local_block: int) -> float:
        """Which prefill block a local block holds (100 + its id), 0 if none."""
        return float(self.layers[0][local_block].flatten()[0])

    def ended(self) -> dict[str, str]:
        """Holds the prefill daemon ended so far: request id -> outcome (from the engine's own grant topic)."""
        out = {}
        for note in self.pc.fetch_notifications(release_topic("engine-p", 0)):
            request_id, outcome = parse_release(note.payload)
            out[request_id] = outcome
        return out

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()
        self.worker.shutdown()
        self.pc.deallocate_cache(self.src)
        self.pc.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with LocalDaemon(tmp_path, 1) as p, LocalDaemon(tmp_path, 2) as d:
        fleet = Fleet(p, d)
        try:
            yield fleet
        finally:
            fleet.close()


def test_params_naming_another_requests_blocks_pull_only_the_requests_own(fleet: Fleet) -> None:
    victim = fleet.finish_prefill("victim", VICTIM_BLOCKS)
    attacker = fleet.finish_prefill("attacker", ATTACKER_BLOCKS)
    # Everything the old protocol addressed by, pointed at the victim's blocks.
    forged = {**attacker, "remote_block_ids": VICTIM_BLOCKS, "kvbroker_cache_ids": [fleet.src.cache_id],
              "remote_request_id": "victim", "kvbroker_hold_expires_unix": 0}
    local, failed = fleet.run_decode("d-attacker", forged)
    # The block ids only choose blocks inside the attacker's own grant: the victim's are refused, nothing lands.
    assert failed == set(local) and [fleet.origin(b) for b in local] == [0.0, 0.0]
    # The attacker's own hold ends (its pull released it); the victim's is still held, for the victim.
    wait_until(lambda: "attacker" in fleet.ended(), what="the attacker's grant released")
    local, failed = fleet.run_decode("d-victim", victim)
    assert failed == set() and [fleet.origin(b) for b in local] == [100.0 + b for b in VICTIM_BLOCKS]


def test_a_forged_or_ended_grant_pulls_nothing_and_ends_no_hold(fleet: Fleet) -> None:
    victim = fleet.finish_prefill("victim", VICTIM_BLOCKS)
    grant = Grant.from_token(victim["kvbroker_grant"])
    wrong_secret = {**victim, "kvbroker_grant": Grant(grant.grant_id, bytes(32)).token()}
    local, failed = fleet.run_decode("d-forged", wrong_secret)
    assert failed == set(local) and [fleet.origin(b) for b in local] == [0.0, 0.0]
    assert "victim" not in fleet.ended()
    assert fleet.pc.renew_grant(grant) > 0  # the victim's hold is untouched
    # The victim pulls (its pull releases the grant); replaying its params afterwards reads nothing.
    local, failed = fleet.run_decode("d-victim", victim)
    assert failed == set() and [fleet.origin(b) for b in local] == [100.0 + b for b in VICTIM_BLOCKS]
    wait_until(lambda: "victim" in fleet.ended(), what="the victim's grant released")
    local, failed = fleet.run_decode("d-replay", victim)
    assert failed == set(local) and [fleet.origin(b) for b in local] == [0.0, 0.0]
    # Counted for vLLM's /metrics: the forged and the replayed pull failed, their hold unknown to the prefill daemon.
    counted = fleet.worker.transfers.take()
    assert counted is not None and counted["failures"] == counted["recomputes"] == {"hold_expired": 2}
    with pytest.raises(KvCacheNotExistError):
        fleet.pc.renew_grant(grant)


class Listeners:
    """A unix socket and a tcp port that accept connections and never answer: whatever dials them is seen."""

    def __init__(self, tmp_path: Path) -> None:
        self.unix_path = str(tmp_path / "evil.sock")
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(self.unix_path)
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp_address = f"127.0.0.1:{self.tcp.getsockname()[1]}"
        for s in (self.unix, self.tcp):
            s.listen(16)

    def dialled(self) -> bool:
        readable, _, _ = select.select([self.unix, self.tcp], [], [], 0.2)
        return bool(readable)

    def close(self) -> None:
        self.unix.close()
        self.tcp.close()


def test_addresses_in_a_request_are_never_dialled(fleet: Fleet, tmp_path: Path) -> None:
    evil = Listeners(tmp_path)
    try:
        for n, address in enumerate((f"unix://{evil.unix_path}", evil.tcp_address, f"unix:{evil.unix_path}")):
            params = fleet.finish_prefill(f"untrusted-{n}", ATTACKER_BLOCKS)
            host, _, port = evil.tcp_address.rpartition(":")
            forged = {**params, "kvbroker_cluster_id": 999, "kvbroker_peer_address": address, "remote_host": host,
                      "remote_port": int(port)}
            local, failed = fleet.run_decode(f"d-untrusted-{n}", forged)
            assert failed == set(local)  # computed locally
        assert not evil.dialled()
        with fleet.d.client() as c:
            assert c.list_links() == []
    finally:
        evil.close()


def test_another_address_for_the_trusted_prefill_daemon_neither_dials_nor_drops_its_link(fleet: Fleet,
                                                                                        tmp_path: Path) -> None:
    params = fleet.finish_prefill("first", VICTIM_BLOCKS)
    assert fleet.run_decode("d-first", params)[1] == set()  # the link is up and healthy
    with fleet.d.client() as c:
        (before,) = c.list_links()
    evil = Listeners(tmp_path)
    try:
        for n, address in enumerate((evil.tcp_address, f"unix://{evil.unix_path}")):
            own = fleet.finish_prefill(f"moved-{n}", ATTACKER_BLOCKS)
            forged = {**own, "kvbroker_peer_address": address, "remote_host": "127.0.0.1",
                      "remote_port": int(evil.tcp_address.rpartition(":")[2])}
            local, failed = fleet.run_decode(f"d-moved-{n}", forged)
            # Pulled from the configured prefill daemon, over the link that was there.
            assert failed == set() and [fleet.origin(b) for b in local] == [100.0 + b for b in ATTACKER_BLOCKS]
            # And another request's pull right after it is not stalled behind a relink.
            other = fleet.finish_prefill(f"other-{n}", VICTIM_BLOCKS)
            assert fleet.run_decode(f"d-other-{n}", other)[1] == set()
        assert not evil.dialled()
        with fleet.d.client() as c:
            (after,) = c.list_links()
        assert (after.remote_address, after.state, after.remote_epoch) == (
            before.remote_address, LinkState.READY, before.remote_epoch)
        assert after.remote_address == fleet.p.peer_address
    finally:
        evil.close()


def test_clients_of_one_engine_linking_at_once_all_get_the_link(fleet: Fleet) -> None:
    """The scheduler's grant renewals and each worker's pulls link on first use, each with its own client: whichever
    comes second finds the link being made (LLM_PROCESSING_LINK) and waits for it instead of failing its pull."""
    trusted = {fleet.p.cluster_id: fleet.p.peer_address}
    clients = [fleet.d.client() for _ in range(4)]
    barrier = threading.Barrier(len(clients))
    errors: list[BaseException] = []

    def link(client: Client) -> None:
        barrier.wait()
        try:
            PeerLinks(client, trusted, timeout_s=5).ensure(fleet.p.cluster_id)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=link, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in clients:
        c.close()
    assert not errors, errors
    with fleet.d.client() as c:
        (link_info,) = c.list_links()
    assert link_info.state == LinkState.READY
