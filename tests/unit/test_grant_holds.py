"""The promise of a grant's blocks, as the grant table keeps it (issue 30, findings 1, 2 and 8): no end of a grant
frees blocks that a peer link holds for a pull, and grants are stored compactly under a daemon-wide budget."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.registry.grants import Grant, GrantTable


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(time, "monotonic", c)  # the table reads time.monotonic()
    return c


def _table() -> tuple[GrantTable, list[tuple[bytes, str]]]:
    ended: list[tuple[bytes, str]] = []
    return GrantTable(lambda g, outcome: ended.append((g.grant_id, outcome))), ended


def _grant(table: GrantTable, lease_ms: int = 30_000, max_hold_ms: int = 0, blocks: int = 4) -> tuple[Grant, bytes]:
    return table.create([1], list(range(blocks)), lease_ms, max_hold_ms, "req", ["t"], lambda _: 1 << 20)


DECODE, OTHER = object(), object()


def test_a_local_release_keeps_the_blocks_of_a_redeemed_pull_until_its_hold_ends(clock: _Clock) -> None:
    table, ended = _table()
    grant, secret = _grant(table)
    table.redeem(grant.grant_id, secret, 7_000, by=DECODE)  # the pull's deadline (5 s) plus the margin
    table.release(grant.grant_id, secret)
    with pytest.raises(LlmError, match="released"):  # no new use
        table.get(grant.grant_id, secret)
    clock.now += 6.9
    table.sweep()
    assert ended == [], "the blocks were freed under a pull that may still read them"
    clock.now += 0.2
    table.sweep()
    assert ended == [(grant.grant_id, "released")]


def test_a_release_through_the_pulling_link_keeps_the_blocks_for_as_long_as_it_says_its_pulls_read(
        clock: _Clock) -> None:
    table, ended = _table()
    grant, secret = _grant(table)
    table.redeem(grant.grant_id, secret, 7_000, by=DECODE)
    table.release(grant.grant_id, secret, by=DECODE, hold_s=3.0)  # the connector's abort path, a pull in flight
    clock.now += 2.9
    table.sweep()
    assert ended == []
    clock.now += 0.2
    table.sweep()
    assert ended == [(grant.grant_id, "released")]


def test_a_release_through_a_link_whose_pulls_are_over_frees_at_once_unless_another_link_holds(
        clock: _Clock) -> None:
    table, ended = _table()
    grant, secret = _grant(table)
    table.redeem(grant.grant_id, secret, 7_000, by=DECODE)
    table.release(grant.grant_id, secret, by=DECODE, hold_s=0.0)
    assert ended == [(grant.grant_id, "released")]
    other, secret2 = _grant(table)
    table.redeem(other.grant_id, secret2, 7_000, by=DECODE)
    table.redeem(other.grant_id, secret2, 4_000, by=OTHER)
    table.release(other.grant_id, secret2, by=DECODE)
    clock.now += 3.9
    table.sweep()
    assert ended[1:] == []
    clock.now += 0.2
    table.sweep()
    assert ended[1:] == [(other.grant_id, "released")]


def test_a_lapse_never_comes_before_a_redeemed_hold_and_the_answer_says_when_the_cap_comes(clock: _Clock) -> None:
    table, ended = _table()
    grant, secret = _grant(table, lease_ms=1_000, max_hold_ms=3_000)
    held = table.redeem(grant.grant_id, secret, 2_000, by=DECODE)
    assert held.expires_in_ms() == 2_000  # the lease (1 s) extended to the hold
    clock.now += 1.9
    table.sweep()
    assert ended == []
    capped = table.redeem(grant.grant_id, secret, 7_000, by=DECODE)  # past the cap: the answer says the cap
    assert capped.expires_in_ms() == 1_100  # the puller refuses it (its deadline is later)


def test_grants_are_compact_and_bounded_by_a_daemon_wide_budget(clock: _Clock) -> None:
    table, _ = _table()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        made = [_grant(table, blocks=65_536) for _ in range(8)]
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 8 * 600 * 1024, f"{grown / 8 / 1024:.0f} KiB a grant of 65,536 blocks"  # was ~4.5 MiB
    table.max_blocks = table.covered_blocks + 1000
    with pytest.raises(LlmError, match="max_granted_blocks") as err:
        _grant(table, blocks=1001)
    assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY
    grant, secret = made[0]
    table.release(grant.grant_id, secret)
    _grant(table, blocks=1001)  # a release gives its blocks back to the budget
