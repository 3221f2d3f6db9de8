"""The benchmark harness runs end to end (its numbers are meaningless at this size; this only guards that it
works and that its JSON is complete). Timing lives in BENCHMARKS.md, never in assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_runs_and_reports_every_item() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kvbench.py"), "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    for subject in ("memcpy-1t", "socket-1c", "kvbroker-shm", "kvbroker-tcp"):
        assert all(v > 0 for v in report["throughput"][subject].values()), subject
    assert report["latency"]["kvbroker-shm-pull"]["samples"] > 0
    assert report["latency"]["kvbroker-shm-session"]["samples"] > 0
    assert set(report["concurrency"]) == {f"kvbroker-{b}{way}" for b in ("shm", "tcp")
                                          for way in ("", "-session", "-batch")}
    for subject, series in report["concurrency"].items():
        assert all(v > 0 for v in series.values()), subject
        assert ("1" in series) != subject.endswith("-batch"), subject  # a batch of one pull is no batch
    assert not report["errors"]
    for backend in ("shm", "tcp"):  # the per-operation floor
        floor = report["details"]["floor"][backend]
        assert set(floor) == {"ops", "ping", "pull", "session", "refused"}, floor
        assert all(floor[kind]["wall_us"] > 0 and floor[kind]["puller_cpu_us"] > 0
                   for kind in ("ping", "pull", "session", "refused")), floor
    blocks = report["scale"]["blocks"]
    for backend in ("shm", "tcp"):
        for pattern in ("contiguous", "scattered"):
            points = blocks["backends"][backend][pattern]
            assert sorted(int(n) for n in points) == [1, 10, 100, 1000, 10000, 100000], (backend, pattern)
            for n, pt in points.items():
                assert pt["blocks"] == int(n) and pt["pull_ms"] > 0 and pt["refused_ms"] > 0
                # Two tensors: a contiguous pull is one run per tensor, a scattered one (almost) one run per block.
                assert pt["runs"] == 2 if pattern == "contiguous" else pt["runs"] > int(n), (backend, pattern, n)
    peers = report["scale"]["peers"]["backends"]
    assert set(peers) == {"shm", "tcp"}
    for data in peers.values():
        assert sorted(int(k) for k in data["levels"]) == [1, 2, 4]
        assert all(pt["gbps"] > 0 for pt in data["levels"].values())
        assert len(data["link_ms"]) == 4


def test_scale_options_are_checked() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kvbench.py"), "--only", "scale-peers",
                          "--scale-peers", "1,65"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--scale-peers between 1 and 64" in out.stderr


def test_grant_pull_bench_runs_and_counts_the_redeems_it_skips() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "grant_pull.py"), "--pulls", "3", "--blocks", "4",
                          "--block-kib", "4", "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert [r["backend"] for r in report] == ["shm", "tcp"]
    for r in report:
        assert [r[way]["redeems"] for way in ("plain", "grant", "renewed")] == [0, 3, 0], r
        assert all(r[way]["p50_ms"] > 0 for way in ("plain", "grant", "renewed"))


def test_walk_bench_follows_one_request_from_the_servicer_to_the_data_plane() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "walk.py"), "--forms", "plain-shm,session-shm",
                          "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert list(report) == ["plain-shm", "session-shm"]
    for form, r in report.items():
        assert {"kvbrokerd/service/local.py", "kvbrokerd/transfers/manager.py",
                "kvbrokerd/backends/shm/backend.py"} <= set(r["visits"]), (form, r["visits"])
        assert not any("_pb2" in f for f in r["visits"]), r["visits"]
        assert r["stays"] == sum(r["visits"].values()) and r["returns"] == r["stays"] - r["files"]


def test_trace_cost_pd_bench_measures_each_mode_and_every_span_reaches_its_sink() -> None:
    """The proxy (off, a 'before' tree: this one, on at 0% and at 100%) and the connector's hooks (off, on with
    unsampled and sampled requests): every span sampled is exported to the bench's OTLP sink (3 a proxied request,
    4 a decode + prefill pair), and none that is not."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_cost_pd.py"), "--before", str(ROOT),
                          "--rounds", "1", "--requests", "3", "--connector-requests", "5"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert set(report["proxy"]) == {f"{kind} {what}" for kind in ("json", "stream")
                                    for what in ("p50_us", "p99_us", "cpu_us", "loop_cpu_us")}
    for row in report["proxy"].values():
        assert set(row) == {"off", "before", "on-0%", "on-100%"} and all(v > 0 for v in row.values()), row
    assert report["proxy_spans"] == report["proxy_spans_expected"] == 3 * (1 + 100 + 2 * 3)
    assert set(report["connector"]) == {"wall_us", "thread_cpu_us", "process_cpu_us"}
    for row in report["connector"].values():
        assert set(row) == {"off", "on-unsampled", "on-100%"} and all(v > 0 for v in row.values()), row
    assert report["connector_spans"] == report["connector_spans_expected"] == 4 * (100 + 5)
