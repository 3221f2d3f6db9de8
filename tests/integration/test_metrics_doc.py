"""docs/vllm.md's list of a sidecar's series is what a real daemon's `/metrics` exposes: every series by name, both
ways, and every label value the doc lists exists at zero from the start (before any link, grant or transfer). The
engine's series: tests/vllm/test_prom_metrics.py."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from kvbroker._local import LocalDaemon
from tests.metrics_doc import differences, documented_series, exposed_series


def test_the_docs_list_is_what_a_fresh_daemons_metrics_exposes(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, extra_args=["--metrics-listen", "127.0.0.1:0"]) as daemon, \
            daemon.client() as client:
        address = client.get_cluster_info().metrics_address
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            page = resp.read().decode()
    documented = documented_series("kvbroker_")
    assert documented["kvbroker_grants_ended_total"].values["outcome"] == {"released", "lapsed", "capped",
                                                                            "cache_removed"}
    assert differences(documented, exposed_series(page, "kvbroker_")) == []


def test_the_comparison_sees_a_missing_value_and_an_undocumented_series() -> None:
    doc = "### Metrics\n`kvbroker_grants_ended_total{outcome=released|lapsed}` and `kvbroker_caches`.\n## next\n"
    page = ("# HELP kvbroker_grants_ended_total x\n# TYPE kvbroker_grants_ended_total counter\n"
            'kvbroker_grants_ended_total{outcome="released"} 0.0\nkvbroker_grants_ended_total{outcome="other"} 0.0\n'
            "# HELP kvbroker_sessions x\n# TYPE kvbroker_sessions gauge\nkvbroker_sessions 0.0\n")
    assert differences(documented_series("kvbroker_", doc), exposed_series(page, "kvbroker_")) == [
        "kvbroker_caches: documented, not exposed",
        "kvbroker_sessions: exposed, not documented",
        "kvbroker_grants_ended_total{outcome}: ['lapsed'] documented, not exposed (at zero)",
        "kvbroker_grants_ended_total{outcome}: ['other'] exposed, not documented",
    ]
