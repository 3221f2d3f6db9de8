"""Transfer ids name one transfer in logs, metrics and error details for the daemon's whole life."""

from __future__ import annotations

import itertools

import pytest

from kvbrokerd.transfers import tracking as transfers


def _new_id() -> str:
    return transfers.Tracked(None, "pull_blocks", "1", transfers.Deadline(1.0)).id


def test_transfer_ids_never_repeat_past_the_first_16m(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "_ID_COUNTER", itertools.count(1))
    first = _new_id()
    assert len(first) == 12
    monkeypatch.setattr(transfers, "_ID_COUNTER", itertools.count((1 << 24) + 1))  # 16M transfers later
    assert _new_id() != first
