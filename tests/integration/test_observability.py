"""Metrics and logs match the work done: scraped counters equal the bytes moved, every transfer log line carries
its transfer id, op, peer and backend, and a pull of many blocks writes no per-block line at INFO."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbroker import CacheDesc, CacheIndex, LlmError
from kvbroker._local import LocalDaemon
from tests.conftest import cluster_of
from tests.helpers import wait_until


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


def test_metrics_count_the_work_done(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=["--metrics-listen", "127.0.0.1:0"]) as dst, \
            src.client() as s, dst.client() as d:
        address = d.get_cluster_info().metrics_address
        assert address.startswith("127.0.0.1:")
        desc = CacheDesc(num_tensors=4, shape=(32, 1024))
        a, b = s.allocate_cache(desc), d.allocate_cache(desc)
        assert d.link_clusters([cluster_of(src)])[0].ok
        moved = sum(d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, list(range(n)), list(range(n))).bytes_moved
                    for n in (1, 5, 32))
        with pytest.raises(LlmError):
            d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [99])
        m = scrape(address)
        assert value(m, "kvbroker_transfer_bytes_total", op="pull_blocks", outcome="DONE", backend="tcp",
                     peer="1") == moved
        assert value(m, "kvbroker_transfers_total", op="pull_blocks", outcome="DONE") == 3
        assert value(m, "kvbroker_transfers_total", op="pull_blocks", outcome="LLM_PARAM_INVALID") == 1
        assert value(m, "kvbroker_transfer_seconds_count", op="pull_blocks", stage="wire") == 4
        assert value(m, "kvbroker_links", state="READY") == 1
        assert value(m, "kvbroker_caches") == 1
        assert value(m, "kvbroker_registered_bytes") == desc.tensor_nbytes * 4
        assert value(m, "kvbroker_transfers_in_flight") == 0
        assert value(m, "kvbroker_sessions") == 1


def test_json_logs_carry_the_transfer_context(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=["--log-format", "json"]) as dst, \
            src.client() as s, dst.client() as d:
        desc = CacheDesc(num_tensors=2, shape=(4096, 16))
        a, b = s.allocate_cache(desc), d.allocate_cache(desc)
        assert d.link_clusters([cluster_of(src)])[0].ok
        blocks = list(range(0, 4096, 2))
        result = d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, blocks, blocks)
        s.deallocate_cache(a)
        with pytest.raises(LlmError) as gone:
            d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [0])
    lines = [json.loads(line) for line in dst.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines, "no JSON log lines"
    assert all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
    failed = [line for line in lines if line.get("transfer") == gone.value.details["transfer_id"]]
    assert failed and all(line["op"] == "pull_blocks" and line["peer"] == "1" for line in failed)
    # A 2,048-block pull writes at most a handful of lines, none per block.
    assert len([line for line in lines if line.get("transfer") == result.transfer_id]) <= 2


def _peers(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    """The `peer` label values of the transfer series."""
    return {v for (n, ls), _ in metrics.items() if n.startswith("kvbroker_transfer") for k, v in ls if k == "peer"}


def test_transfer_series_carry_peer_and_backend_and_go_with_the_peers_link(tmp_path: Path) -> None:
    """Issue 20 item 3: every transfer series (bytes, counts, the latency histogram) is labelled by peer and backend;
    a cluster never linked gets no series of its own; a peer's series go when its link is reclaimed (dead peer);
    holds that end are counted by outcome."""
    with LocalDaemon(tmp_path, 2, backends=("tcp",),
                     extra_args=["--broken-link-ttl", "1", "--metrics-listen", "127.0.0.1:0"]) as dst, \
            dst.client() as d:
        address = d.get_cluster_info().metrics_address
        src = LocalDaemon(tmp_path, 1, backends=("tcp",)).start()
        try:
            with src.client() as s:
                desc = CacheDesc(num_tensors=2, shape=(4, 256))
                a, b = s.allocate_cache(desc), d.allocate_cache(desc)
                assert d.link_clusters([cluster_of(src)])[0].ok
                moved = d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0, 1], [2, 3]).bytes_moved
                with pytest.raises(LlmError):
                    d.pull_kv_blocks(CacheIndex(77, 1), b, [0], [0])  # a cluster never linked
                grant = d.create_grant([b.cache_id], [0], 30.0)
                d.release_grant(grant)
                m = scrape(address)
        finally:
            src.stop()
        for stage in ("queue", "wire", "total"):
            assert value(m, "kvbroker_transfer_seconds_count", op="pull_blocks", backend="tcp", peer="1",
                         stage=stage) == 1
        assert value(m, "kvbroker_transfer_bytes_total", op="pull_blocks", backend="tcp", peer="1",
                     outcome="DONE") == moved
        assert value(m, "kvbroker_transfers_total", peer="other", outcome="LLM_NOT_YET_LINK") == 1
        assert _peers(m) == {"1", "other"}  # no series of cluster 77
        assert value(m, "kvbroker_grants_ended_total", outcome="released") == 1
        # The peer died: once its link is reclaimed, its series are gone (a fleet's churn leaves no series behind).
        wait_until(lambda: d.list_links() == [], timeout=20, what="the dead peer's link reclaimed")
        m = scrape(address)
        assert value(m, "kvbroker_links_reclaimed_total", side="outbound", reason="broken") == 1
        assert _peers(m) == {"other"}
