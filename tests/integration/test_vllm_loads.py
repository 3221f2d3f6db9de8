"""The vLLM connector's decode hot path against real daemons: the loads one scheduler step starts go to the daemon
as one message of the worker's pull session, and each request keeps its own outcome."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")

from kvbroker import Grant
from kvbroker._local import LocalDaemon
from tests.helpers import wait_until
from tests.integration.test_vllm_tenancy import TOKENS, FakeRequest, Fleet


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with LocalDaemon(tmp_path, 1) as p, LocalDaemon(tmp_path, 2) as d:
        fleet = Fleet(p, d)
        try:
            yield fleet
        finally:
            fleet.close()


def test_one_step_of_several_requests_is_one_message_and_a_bad_one_fails_alone(fleet: Fleet) -> None:
    """Five requests and one with a forged grant, scheduled in one step: one message on the session; the five land
    (each block holds its prefill block's bytes), the forged one's blocks are reported for recomputation alone."""
    params = {f"r{i}": fleet.finish_prefill(f"r{i}", [2 * i, 2 * i + 1]) for i in range(5)}
    grant = Grant.from_token(params["r4"]["kvbroker_grant"])
    forged = fleet.finish_prefill("victim", [12, 13])
    params["forged"] = {**forged, "kvbroker_grant": Grant(grant.grant_id, bytes(32)).token()}
    local: dict[str, list[int]] = {}
    for n, (name, p) in enumerate(params.items()):
        req = FakeRequest(f"d-{name}", TOKENS, dict(p))
        fleet.decode.on_new_request(req)
        count, _ = fleet.decode.num_new_matched_tokens(req, 0)
        local[name] = [2 * n, 2 * n + 1]
        fleet.decode.after_alloc(req, local[name], local[name], count)
    plan = fleet.decode.take_plan()
    assert len(plan.pulls) == 6
    sent = fleet.worker.loads.messages_sent
    fleet.worker.start(plan.pulls, plan.holds)
    ended: set[str] = set()

    def all_ended() -> bool:
        ended.update(fleet.worker.finished()[1])
        return len(ended) == 6

    wait_until(all_ended, timeout=30, poll=0.02, what="every pull of the step")
    assert fleet.worker.loads.messages_sent == sent + 1
    assert fleet.worker.take_load_errors() == set(local["forged"])
    for i in range(5):
        assert [fleet.origin(b) for b in local[f"r{i}"]] == [100.0 + 2 * i, 100.0 + 2 * i + 1]
    assert [fleet.origin(b) for b in local["forged"]] == [0.0, 0.0]
