"""A small fleet under churn (bench/fleet.py): two prefill nodes and one decode node, each a network
namespace with its own kvbrokerd (tcp backend), a steady stream of pulls, and one prefill node SIGKILLed and
replaced by a new pod (new cluster id, new namespace, new address) mid-stream.

The run is shared by the tests below (one run, ~30 s). Its numbers are meaningless here; the tests assert on what
the fleet must guarantee: every pull accounted for, none past its deadline, nothing leaked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make network namespaces (one per node)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's `ip` and `tc`"
    name = f"kvflprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_WHY = _why_no_namespaces()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"fleet test: {_WHY}")

PREFILL_NODES = 2
FLEET = ["--nodes", "3", "--decode", "1", "--duration", "22", "--warmup", "4", "--churn-every", "6", "--kills", "1",
         "--kill-roles", "prefill", "--restart-mode", "new", "--down-time", "1", "--settle", "8",
         "--concurrency", "3", "--cache-blocks", "128", "--blocks", "8", "--block-bytes", "4K",
         "--max-links", str(PREFILL_NODES)]
"""One kill: a prefill node replaced by a new pod. The decode daemon may hold as many links as there are prefill
nodes (--max-links 2), so a dead link that stays in its table refuses the new pod's link."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fleet") / "fleet.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), *FLEET, "--save", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    report["stderr"] = run.stderr
    return report


def test_the_fleet_ran_its_churn_and_cleaned_up(fleet: dict[str, Any]) -> None:
    [event] = fleet["churn"]
    assert event["role"] == "prefill" and event["new_identity"]
    assert event["new_cluster"] != event["old_cluster"] and event["new_address"] != event["old_address"]
    assert fleet["pulls"]["ok"] > 0
    assert fleet["namespaces_left"] == []
    assert fleet["daemon_exit_codes"] == [0, 0, 0]


def test_every_pull_lands_or_reports_what_did_not(fleet: dict[str, Any]) -> None:
    """Verified bytes for every landed pull; for a failed one, every block its report leaves out holds the source's
    bytes, and one without a report (a refusal) wrote nothing."""
    assert fleet["checks"]["accounted"], fleet["violations"]
    pulls = fleet["pulls"]
    assert sum(pulls["by_outcome_status"].values()) == pulls["total"]


def test_no_pull_waits_past_its_deadline(fleet: dict[str, Any]) -> None:
    assert fleet["checks"]["deadlines"], fleet["violations"]


def test_no_segment_or_fd_leaks(fleet: dict[str, Any]) -> None:
    """The killed daemon's segments are removed by its successor on the host; nothing is left after SIGTERM; the
    daemons that were never killed hold as many fds at the end as after warm-up (+ a small slack)."""
    assert fleet["orphaned_segments"] == []
    assert fleet["fds"]["surviving_daemons"], "no surviving daemon was sampled"
    assert fleet["checks"]["fds"], fleet["fds"]


def test_links_stay_bounded_under_churn(fleet: dict[str, Any]) -> None:
    """The bound the fleet must meet: after the churn settles, the decode daemon holds no more links than there are
    live prefill nodes, and the new pod's link was never refused for room while a dead link held a slot: a full
    table gives up the dead pod's BROKEN link (without that, the dead link stays and refuses every link to the new
    pod). In the seconds before heartbeats find the killed pod its link is still live, and a full table of live
    links does refuse (that refusal says so)."""
    links = fleet["links"]
    assert all("every link is live" in why for why in links["refused_for_room"]), links
    assert all(n <= links["bound_per_decode"] for n in links["final_per_decode"].values()), links
