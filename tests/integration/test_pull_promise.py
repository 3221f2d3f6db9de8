"""The promise of a pull, raced: whatever ends a grant (a release by the prefill engine or through the decode
daemon, a lapse, its cap), however soon the prefill engine frees and reuses the blocks (the moment it reads the
grant's event, never before), however the pull ends (its deadline, the decode daemon frozen under it), a pull that
reports success holds exactly the bytes its source held under the grant, and a failed pull's report names every
destination block that may hold anything else (a refusal without a report wrote nothing).

A hypothesis state machine drives two real daemons per backend (shm, tcp) through those lifetimes in random order
and checks the invariant whenever a pull is joined, together with every claim made earlier (a block that landed, or
was left alone, must stay so: nothing lands after the answer). A new lifetime is one more rule. The race tests at the
end make the worst interleavings happen on purpose: the decode daemon frozen mid-copy while the grant ends and the
engine reuses the blocks.

Every block of every cache holds one 8-byte word repeated, which names whose bytes they are (the tenant and source
block): a torn block, a block from another tenant or from the wrong source block never passes for the right one."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvbroker import CacheDesc, CacheIndex, Client, Grant, LlmError, SessionPull, TransferResult
from kvbroker._local import LocalDaemon
from kvbroker._session import PullSession
from kvbroker.shm import Cache
from kvbroker.v1 import broker_pb2
from tests.conftest import cluster_of
from tests.helpers import comes_true, transfers_in_flight, wait_until

BLOCK_WORDS = 8192
"""8-byte words per block and tensor (64 KiB; two tensors: 128 KiB a block): a pull of tens of blocks takes
milliseconds, long enough for the rules to land in the middle of one."""
FIRST_CLUSTER = {"shm": 3100, "tcp": 3110}
TENANT_WORD = 0x5A << 56
"""Source bytes: TENANT_WORD | tenant << 24 | source block. Destination markers (what a block held before a pull)
carry MARKER_WORD instead, so they never pass for source bytes."""
MARKER_WORD = 0xA5 << 56


def desc(num_blocks: int) -> CacheDesc:
    return CacheDesc(num_tensors=2, shape=(num_blocks, BLOCK_WORDS * 4))  # float16: 4 per word


def source_word(tenant: int, block: int) -> int:
    return TENANT_WORD | tenant << 24 | block


def whose(word: int) -> str:
    if word >> 56 == TENANT_WORD >> 56:
        return f"tenant {(word >> 24) & 0xFFFFFFFF}'s block {word & 0xFFFFFF}"
    if word >> 56 == MARKER_WORD >> 56:
        return "the destination's own bytes"
    return f"torn or foreign bytes ({word:#x})"


class Words:
    """A cache's blocks, each one word repeated: written and checked whole, over every tensor."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.views = [t.reshape(t.shape[0], -1).view(np.uint64) for t in cache.tensors]

    def write(self, blocks: Sequence[int], words: Sequence[int]) -> None:
        idx, col = np.asarray(blocks, dtype=np.int64), np.asarray(words, dtype=np.uint64)[:, None]
        for view in self.views:
            view[idx] = col

    def wrong(self, blocks: Sequence[int], words: Sequence[int]) -> list[str]:
        """The blocks that do not hold exactly their word in every tensor, each said with what it holds instead."""
        if not blocks:
            return []
        idx, col = np.asarray(blocks, dtype=np.int64), np.asarray(words, dtype=np.uint64)[:, None]
        ok = np.ones(len(idx), dtype=bool)
        for view in self.views:
            ok &= (view[idx] == col).all(axis=1)
        return [f"{b}: {self.held(b)}, not {whose(w)}" for b, w, good in zip(blocks, words, ok, strict=True)
                if not good]

    def held(self, block: int) -> str:
        seen = dict.fromkeys(int(w) for view in self.views for w in np.unique(view[block]))
        return " + ".join(whose(w) for w in seen) if len(seen) <= 3 else f"{len(seen)} different words"

    def holds(self, block: int, word: int) -> bool:
        return all(bool((view[block] == word).all()) for view in self.views)


@dataclass
class Pair:
    """Two daemons of one backend, the decode daemon (`d`) linked to the prefill daemon (`p`), and a client of each;
    `stats` counts outcomes over the module (to show that the races happened)."""

    backend: str
    p: LocalDaemon
    d: LocalDaemon
    pc: Client
    dc: Client
    stats: Counter[str] = field(default_factory=Counter)

    def wait_quiet(self) -> None:
        """Returns once the decode daemon runs no transfer: a copy that outlives its answer (a deadline passed, a
        caller gone) keeps its place until it stops, so after this no late write can come to check the claims."""
        metrics_at = self.dc.get_cluster_info().metrics_address
        wait_until(lambda: transfers_in_flight(metrics_at) == 0, what="no transfer running in the decode daemon")

    def freeze(self) -> None:
        self.d.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.d.signal(signal.SIGCONT)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    backend: str = request.param
    root: Path = tmp_path_factory.mktemp(f"promise-{backend}")
    first = FIRST_CLUSTER[backend]
    with LocalDaemon(root, first, backends=[backend]) as p, LocalDaemon(
            root, first + 1, backends=[backend], extra_args=["--metrics-listen", "127.0.0.1:0"]) as d:
        pc, dc = p.client(), d.client()
        try:
            assert dc.link_clusters([cluster_of(p)])[0].ok
            assert [link.backend for link in dc.list_links()] == [backend]
            stats: Counter[str] = Counter()
            yield Pair(backend, p, d, pc, dc, stats)
        finally:
            d.signal(signal.SIGCONT)
            pc.close()
            dc.close()
            print(f"\npull outcomes on {backend}: {dict(stats)}")


@dataclass(eq=False)
class Granted:
    grant: Grant
    blocks: list[int]
    tenant: int
    ended: str = ""
    """The outcome its GrantEvent named, once the engine read it (and reused the blocks)."""


class Engine:
    """The prefill engine: owns the source cache. It fills blocks with a new tenant's bytes and grants them; it
    frees a grant's blocks, and at once reuses them (another tenant's bytes), the moment it reads the grant's event,
    and never touches a granted block before. Its pinned blocks are never granted nor reused (plain pulls read them)."""

    def __init__(self, pair: Pair, num_blocks: int, pinned: int) -> None:
        self.pair = pair
        self.cache = pair.pc.allocate_cache(desc(num_blocks))
        self.words = Words(self.cache)
        self.topic = f"promise/{uuid.uuid4().hex[:12]}"
        self._tenants = itertools.count(1)
        self.free = list(range(pinned, num_blocks))
        self.pinned = list(range(pinned))
        self.pinned_tenant = next(self._tenants)
        self.words.write(self.pinned, [source_word(self.pinned_tenant, b) for b in self.pinned])
        self.grants: dict[bytes, Granted] = {}

    def index(self) -> CacheIndex:
        return CacheIndex(self.pair.p.cluster_id, self.cache.cache_id)

    def grant(self, blocks: list[int], lease: float, max_hold: float = 0.0) -> Granted:
        assert set(blocks) <= set(self.free)
        tenant = next(self._tenants)
        self.words.write(blocks, [source_word(tenant, b) for b in blocks])
        self.free = [b for b in self.free if b not in set(blocks)]
        grant = self.pair.pc.create_grant([self.cache.cache_id], blocks, lease, max_hold=max_hold,
                                          label=f"tenant-{tenant}", event_topics=[self.topic])
        granted = Granted(grant, blocks, tenant)
        self.grants[grant.grant_id] = granted
        return granted

    def read_events(self, wait: float = 0.0) -> list[Granted]:
        """Frees (and reuses) the blocks of every grant whose event has come."""
        ended = []
        for note in self.pair.pc.fetch_notifications(self.topic, wait=wait):
            event = broker_pb2.GrantEvent()
            event.ParseFromString(note.payload)
            granted = self.grants[event.grant_id]
            assert not granted.ended, f"a second event for {event.label}: {event.outcome} after {granted.ended}"
            granted.ended = event.outcome
            reuser = next(self._tenants)
            self.words.write(granted.blocks, [source_word(reuser, b) for b in granted.blocks])
            self.free.extend(granted.blocks)
            ended.append(granted)
        return ended

    def wait_for_end(self, granted: Granted, wait: float) -> bool:
        """Reads events until `granted`'s has come or `wait` seconds have passed; whether it came."""
        deadline = time.monotonic() + wait

        def ended() -> bool:
            left = deadline - time.monotonic()
            if not granted.ended and left > 0:
                self.read_events(wait=min(left, 1.0))
            return bool(granted.ended)

        return comes_true(ended, within=wait, poll=0)  # (no pause between asks: the fetch's long poll is the wait)

    def close(self) -> None:
        for granted in self.grants.values():
            if not granted.ended:
                with contextlib.suppress(LlmError):
                    self.pair.pc.release_grant(granted.grant)
        wait_until(lambda: self.pair.pc.deallocate_cache(self.cache) is None, what="the source cache released",
                   tolerate=(LlmError,))
        self.pair.pc.fetch_notifications(self.topic, max_count=65536)  # leave nothing behind in the daemon


@dataclass(eq=False)
class Pull:
    what: str
    dst_blocks: list[int]
    expected: list[int]
    """The word each destination block must hold if it landed."""
    markers: list[int]
    """The word each destination block held before (what a refusal must leave)."""
    outcome: concurrent.futures.Future[TransferResult]
    timeout: float


class Decoder:
    """The decode side: a destination cache and the claims on it: the word every block that is not in use must
    hold (what landed, or what a refusal left), which later checks hold it to."""

    def __init__(self, pair: Pair, num_blocks: int) -> None:
        self.pair = pair
        self.cache = pair.dc.allocate_cache(desc(num_blocks))
        self.words = Words(self.cache)
        self.free = list(range(num_blocks))
        self.claims: dict[int, int] = {}
        self.untrusted: set[int] = set()
        """Blocks that a failed pull's answer said may still change (or that no answer described): never reused."""
        self._markers = itertools.count(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
        self._session: PullSession = pair.dc.open_pull_session()  # now: the daemon may be frozen later

    def take(self, n: int, rng: random.Random) -> list[int]:
        blocks = rng.sample(self.free, n)
        self.free = [b for b in self.free if b not in set(blocks)]
        marker = next(self._markers)
        words = [MARKER_WORD | marker << 24 | b for b in blocks]
        for b in blocks:
            self.claims.pop(b, None)
        self.words.write(blocks, words)
        return blocks

    def start(self, what: str, dst_blocks: list[int], expected: list[int], timeout: float, *,
              granted: Granted | None = None, src: CacheIndex | None = None, src_blocks: Sequence[int] = (),
              first_block: int = 0, in_session: bool = False) -> Pull:
        dc, cluster = self.pair.dc, self.pair.p.cluster_id
        markers = [int(self.words.views[0][b, 0]) for b in dst_blocks]
        outcome: concurrent.futures.Future[TransferResult]
        if in_session:
            index = CacheIndex(cluster, 0) if src is None else src
            grant = None if granted is None else granted.grant
            one = SessionPull(index, self.cache.cache_id, tuple(dst_blocks), tuple(src_blocks), grant=grant,
                              first_block=first_block, timeout=timeout)
            outcome = self._session.submit([one])[0]
        elif granted is not None:
            outcome = self._pool.submit(dc.pull_granted_kv_blocks, cluster, granted.grant, self.cache.cache_id,
                                        dst_blocks, first_block=first_block, src_blocks=src_blocks, timeout=timeout)
        else:
            assert src is not None
            outcome = self._pool.submit(dc.pull_kv_blocks, src, self.cache.cache_id, src_blocks, dst_blocks,
                                        timeout=timeout)
        return Pull(what, dst_blocks, expected, markers, outcome, timeout)

    def join(self, pull: Pull, waited_frozen: float = 0.0) -> None:
        """Waits for `pull` to end and checks the promise: a success holds the granted bytes in every block; a
        failure's report lists every block that does not; a refusal (no report) wrote nothing. Then every earlier
        claim must still hold."""
        stats = self.pair.stats
        try:
            pull.outcome.result(timeout=pull.timeout + waited_frozen + 30)
        except LlmError as err:
            report = err.details.get("transfer_report")
            failed = err.failed_dst_blocks
            if failed is not None:
                stray = set(failed) - set(pull.dst_blocks)
                assert not stray, f"{pull.what}: the report names blocks it never wrote: {sorted(stray)}"
                landed = [(b, w) for b, w in zip(pull.dst_blocks, pull.expected, strict=True) if b not in set(failed)]
                wrong = self.words.wrong([b for b, _ in landed], [w for _, w in landed])
                assert not wrong, (f"{pull.what} failed ({err}) and its report lists {len(failed)} blocks, but "
                                   f"{len(wrong)} blocks it says landed hold other bytes: {wrong[:4]}")
                self._settled(landed, untrusted=failed)
                stats[f"failed, {len(failed)} of {len(pull.dst_blocks)} listed" if 0 < len(failed) < len(
                    pull.dst_blocks) else "failed with a report"] += 1
            elif report is not None:  # the daemon did not describe the failure: no block can be trusted
                self._settled([], untrusted=pull.dst_blocks)
                stats["failed without the daemon's word"] += 1
            else:
                wrong = self.words.wrong(pull.dst_blocks, pull.markers)
                assert not wrong, (f"{pull.what} was refused ({err}) without a report, but {len(wrong)} blocks "
                                   f"changed: {wrong[:4]}")
                self._settled(list(zip(pull.dst_blocks, pull.markers, strict=True)), untrusted=[])
                stats[f"refused: {err.status.name}"] += 1
        else:
            wrong = self.words.wrong(pull.dst_blocks, pull.expected)
            assert not wrong, (f"{pull.what} reported success, but {len(wrong)} of its {len(pull.dst_blocks)} "
                               f"blocks hold other bytes than it was granted: {wrong[:4]}")
            self._settled(list(zip(pull.dst_blocks, pull.expected, strict=True)), untrusted=[])
            stats["succeeded"] += 1
        self.check_claims()

    def _settled(self, claims: list[tuple[int, int]], untrusted: Sequence[int]) -> None:
        for b, w in claims:
            self.claims[b] = w
            self.free.append(b)
        self.untrusted.update(untrusted)

    def check_claims(self) -> None:
        blocks = sorted(self.claims)
        wrong = self.words.wrong(blocks, [self.claims[b] for b in blocks])
        assert not wrong, f"{len(wrong)} blocks changed after their pull's answer: {wrong[:4]}"

    def close(self) -> None:
        self._session.close()
        self._pool.shutdown(wait=True)
        wait_until(lambda: self.pair.dc.deallocate_cache(self.cache) is None, what="the destination cache released",
                   tolerate=(LlmError,))


# -- the state machine ------------------------------------------------------------------------------------------
SRC_BLOCKS, PINNED, DST_BLOCKS = 224, 32, 384
MAX_PULLS = 4
LEASES = [(30.0, 0.0), (0.3, 0.0), (0.6, 0.6), (1.0, 1.5), (0.2, 0.4)]
"""(lease, max_hold) of a grant: long-lived, soon lapsing, soon capped."""
PULL_TIMEOUTS = [0.05, 0.3, 1.0, 2.5]
MID_COPY = ["nothing", "freeze", "release on prefill", "release through decode"]
FROZEN_MAX_S = 1.2
"""The decode daemon stays frozen at most about this long (3 missed heartbeats would break the link)."""


class PullPromise(RuleBasedStateMachine):
    pair: Pair

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(self.pair, SRC_BLOCKS, PINNED)
        self.decoder = Decoder(self.pair, DST_BLOCKS)
        self.made: list[Granted] = []
        self.pulls: list[Pull] = []
        self.pulled: dict[Pull, Granted] = {}
        self.frozen_at: float | None = None
        self.frozen_for = 0.0

    # -- the prefill engine
    # Preconditions read the model's own state only, never what time or the daemons did (free blocks come back as
    # events arrive): hypothesis replays a prefix of rules and must see the same rules enabled.
    @rule(n=st.integers(8, 64), lease=st.sampled_from(LEASES), seed=st.integers(0, 1 << 16))
    def create_grant(self, n: int, lease: tuple[float, float], seed: int) -> None:
        if len(self.engine.free) < n:
            return
        blocks = random.Random(seed).sample(self.engine.free, n)
        self.made.append(self.engine.grant(blocks, *lease))

    @rule(wait=st.sampled_from([0.0, 0.1]))
    def engine_reads_events(self, wait: float) -> None:
        self.engine.read_events(wait)

    def _target(self, pick: int, in_flight: bool) -> Granted:
        """A grant that a pull in flight reads (if `in_flight` and there is one), else any grant made so far."""
        pulled = [g for p, g in self.pulled.items() if p in self.pulls and in_flight] or self.made
        return pulled[pick % len(pulled)]

    @precondition(lambda self: self.made)
    @rule(pick=st.integers(0, 1 << 16), in_flight=st.booleans())
    def release_on_prefill(self, pick: int, in_flight: bool) -> None:
        with contextlib.suppress(LlmError):
            self.pair.pc.release_grant(self._target(pick, in_flight).grant)

    # -- the decode side
    @precondition(lambda self: self.made and self.frozen_at is None)
    @rule(pick=st.integers(0, 1 << 16), in_flight=st.booleans())
    def release_through_decode(self, pick: int, in_flight: bool) -> None:
        with contextlib.suppress(LlmError):
            self.pair.dc.release_grant(self._target(pick, in_flight).grant, cluster_id=self.pair.p.cluster_id)

    @precondition(lambda self: self.made and self.frozen_at is None)
    @rule(pick=st.integers(0, 1 << 16), in_flight=st.booleans(), lease=st.sampled_from([0.0, 0.3, 2.0]))
    def renew_through_decode(self, pick: int, in_flight: bool, lease: float) -> None:
        with contextlib.suppress(LlmError):
            self.pair.dc.renew_grant(self._target(pick, in_flight).grant, lease, cluster_id=self.pair.p.cluster_id)

    @precondition(lambda self: self.made and len(self.pulls) < MAX_PULLS)
    @rule(pick=st.integers(0, 1 << 16), span=st.sampled_from(["all", "tail", "some"]), session=st.booleans(),
          timeout=st.sampled_from(PULL_TIMEOUTS), mid_copy=st.sampled_from(MID_COPY))
    def pull_by_grant(self, pick: int, span: str, session: bool, timeout: float, mid_copy: str) -> None:
        """`mid_copy`: what happens as soon as the pull's first block has landed, so that it happens in the middle of
        the copy: the decode daemon frozen (the rules that follow run while it is), and then the grant released on
        the prefill side; or the grant released through the decode daemon. Either way the engine then reads its
        events (and reuses the blocks of every grant whose event came)."""
        rng = random.Random(pick)
        granted = self.made[pick % len(self.made)]
        first, src_blocks = 0, list(granted.blocks)
        if span == "tail":
            first = rng.randrange(len(granted.blocks))
            src_blocks = src_blocks[first:]
        elif span == "some":
            src_blocks = rng.sample(src_blocks, rng.randint(1, len(src_blocks)))
        if len(src_blocks) > len(self.decoder.free):
            return
        dst = self.decoder.take(len(src_blocks), rng)
        pull = self.decoder.start(
            f"a pull of grant tenant-{granted.tenant} ({span}, {'session' if session else 'unary'}, {timeout} s)",
            dst, [source_word(granted.tenant, b) for b in src_blocks], timeout, granted=granted,
            src_blocks=src_blocks if span == "some" else (), first_block=first, in_session=session)
        self.pulls.append(pull)
        self.pulled[pull] = granted
        if mid_copy == "nothing" or self.frozen_at is not None:  # a frozen daemon lands nothing
            return
        _first_block_landed(self.decoder, pull)
        if mid_copy == "release through decode":
            with contextlib.suppress(LlmError):
                self.pair.dc.release_grant(granted.grant, cluster_id=self.pair.p.cluster_id)
        else:
            if self.frozen_at is None:
                self.freeze_decode()
            if mid_copy == "release on prefill":
                with contextlib.suppress(LlmError):
                    self.pair.pc.release_grant(granted.grant)
        self.engine.read_events(wait=0.2)

    @precondition(lambda self: len(self.pulls) < MAX_PULLS)
    @rule(n=st.integers(1, PINNED), seed=st.integers(0, 1 << 16), session=st.booleans(),
          timeout=st.sampled_from(PULL_TIMEOUTS))
    def plain_pull(self, n: int, seed: int, session: bool, timeout: float) -> None:
        rng = random.Random(seed)
        if n > len(self.decoder.free):
            return
        src_blocks = rng.sample(self.engine.pinned, n)
        dst = self.decoder.take(n, rng)
        self.pulls.append(self.decoder.start(
            f"a plain pull ({'session' if session else 'unary'}, {timeout} s)", dst,
            [source_word(self.engine.pinned_tenant, b) for b in src_blocks], timeout, src=self.engine.index(),
            src_blocks=src_blocks, in_session=session))

    @precondition(lambda self: self.pulls and self.frozen_at is None)
    @rule(pick=st.integers(0, 1 << 16))
    def join_pull(self, pick: int) -> None:
        pull = self.pulls.pop(pick % len(self.pulls))
        self.pulled.pop(pull, None)
        self.decoder.join(pull, self.frozen_for)

    # -- time and stalls
    @rule(seconds=st.sampled_from([0.03, 0.2, 0.5]))
    def time_passes(self, seconds: float) -> None:
        """Leases lapse, caps pass, holds run out (a frozen daemon stays frozen at most FROZEN_MAX_S / 2 here)."""
        if self.frozen_at is not None:
            seconds = max(0.0, min(seconds, self.frozen_at + FROZEN_MAX_S / 2 - time.monotonic()))
        time.sleep(seconds)  # the scenario, not a wait: the rule is time passing

    @precondition(lambda self: self.frozen_at is None)
    @rule()
    def freeze_decode(self) -> None:
        self.pair.freeze()
        self.frozen_at = time.monotonic()

    @precondition(lambda self: self.frozen_at is not None)
    @rule()
    def thaw_decode(self) -> None:
        self._thaw()

    def _thaw(self) -> None:
        if self.frozen_at is not None:
            self.pair.thaw()
            self.frozen_for += time.monotonic() - self.frozen_at
            self.frozen_at = None

    def teardown(self) -> None:
        try:
            self._thaw()
            while self.pulls:
                self.decoder.join(self.pulls.pop(0), self.frozen_for)
            self.pair.wait_quiet()
            self.decoder.check_claims()
        finally:
            self._thaw()
            self.decoder.close()
            self.engine.close()


def test_every_pull_holds_its_granted_bytes_or_reports_every_block_that_does_not(pair: Pair) -> None:
    """Grants made, pulled (unary and in a session, whole, a tail, some blocks), renewed, released on either side,
    lapsed and capped, the decode daemon frozen and thawed, plain pulls beside them, the engine reusing blocks as
    soon as it may: every joined pull keeps the promise, and nothing it claimed changes later."""
    machine = type("PullPromiseOn" + pair.backend.capitalize(), (PullPromise,), {"pair": pair})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=12, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate]))  # no shrinking: each step costs real time
    assert pair.stats["succeeded"] > 0, pair.stats


# -- the races, made to happen --------------------------------------------------------------------------------------
RACE_BLOCKS = {"shm": 96, "tcp": 320}
"""Blocks of a race's pull: over tcp more than the two sockets' buffers hold (8 MiB each way), or the source daemon
has sent everything before the freeze."""
ROUNDS = 3


def _first_block_landed(decoder: Decoder, pull: Pull) -> None:
    """Returns as soon as the pull's first block holds its bytes (the copy is under way) or the pull has ended."""
    # Asked without a pause (a pause only yields to the thread that waits for the answer): the freeze should come
    # while the copy is under way.
    wait_until(lambda: decoder.words.holds(pull.dst_blocks[0], pull.expected[0]) or pull.outcome.done(), timeout=10,
               poll=0, what="the pull to land its first block or end")


def _pull_under_freeze(pair: Pair, end: str) -> None:
    """ROUNDS rounds: a grant, a pull of all of it; as soon as its first block has landed the decode daemon is frozen
    (mid-copy), the grant ends (`end`), the engine reads events for a while and reuses the blocks if its event came;
    then the daemon thaws and the pull's outcome must keep the promise."""
    n = RACE_BLOCKS[pair.backend]
    engine = Engine(pair, n * ROUNDS, 0)
    decoder = Decoder(pair, n * ROUNDS)
    try:
        for round_ in range(ROUNDS):
            rng = random.Random(round_)
            blocks = engine.free[:n]
            lease, max_hold = (0.8, 0.8) if end == "cap" else (30.0, 0.0)
            granted = engine.grant(blocks, lease, max_hold)
            dst = sorted(decoder.take(n, rng))
            timeout = 0.6 if end == "release past the deadline" else 2.5
            pull = decoder.start(f"a pull by grant ({end}, round {round_})", dst,
                                 [source_word(granted.tenant, b) for b in blocks], timeout, granted=granted,
                                 in_session=end == "release past the deadline")
            started = time.monotonic()
            _first_block_landed(decoder, pull)
            pair.freeze()
            frozen_at = time.monotonic()
            try:
                pair.stats["frozen mid-copy" if not pull.outcome.done() else "done before the freeze"] += 1
                if end == "cap":  # the scenario, not a wait: the grant reaches its cap while the pull is frozen
                    time.sleep(max(0.0, started + max_hold + 0.3 - time.monotonic()))
                else:
                    with contextlib.suppress(LlmError):
                        pair.pc.release_grant(granted.grant)
                # The event, if the daemon posts it now, and the reuse it allows; past the deadline: its hold too.
                engine.wait_for_end(granted, timeout + 3.0 if end == "release past the deadline" else 0.3)
            finally:
                pair.thaw()
            decoder.join(pull, time.monotonic() - frozen_at)
        pair.wait_quiet()
        decoder.check_claims()
    finally:
        pair.thaw()
        decoder.close()
        engine.close()


def test_a_grant_released_on_the_prefill_side_under_a_pull_keeps_its_bytes(pair: Pair) -> None:
    _pull_under_freeze(pair, "release")


def test_a_grant_capped_under_a_pull_keeps_its_bytes(pair: Pair) -> None:
    _pull_under_freeze(pair, "cap")


def test_bytes_of_a_grant_reused_while_the_pull_is_frozen_past_its_deadline_never_count(pair: Pair) -> None:
    _pull_under_freeze(pair, "release past the deadline")


def test_a_release_through_the_pulling_daemon_keeps_the_bytes_of_its_pull(pair: Pair) -> None:
    """The connector's abort path: the decode daemon releases the grant while its own pull of it runs; the engine
    reuses the blocks as soon as it reads the event."""
    n = RACE_BLOCKS[pair.backend]
    engine = Engine(pair, n * ROUNDS, 0)
    decoder = Decoder(pair, n * ROUNDS)
    try:
        for round_ in range(ROUNDS):
            blocks = engine.free[:n]
            granted = engine.grant(blocks, 30.0)
            dst = sorted(decoder.take(n, random.Random(round_)))
            pull = decoder.start(f"a pull by grant released through its daemon (round {round_})", dst,
                                 [source_word(granted.tenant, b) for b in blocks], 2.5, granted=granted)
            _first_block_landed(decoder, pull)
            with contextlib.suppress(LlmError):
                pair.dc.release_grant(granted.grant, cluster_id=pair.p.cluster_id)
            engine.wait_for_end(granted, 0.3)
            decoder.join(pull)
        pair.wait_quiet()
        decoder.check_claims()
    finally:
        decoder.close()
        engine.close()
