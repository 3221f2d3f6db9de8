"""The connector's Prometheus series (`prom.py`) against a real prometheus_client registry, as vLLM's front end builds
and feeds them: vLLM's metric classes, its (model_name, engine) labels, and the stats dict the connector's workers and
scheduler side send (`stats.py`). No engine is started.

Runs in the vLLM venv (tests/vllm/run.sh); the main suite skips it when vLLM is not installed.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # type: ignore[import-not-found,unused-ignore]  # noqa: F401  (CI: missing vLLM fails, never skips)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbroker.integrations.vllm.stats import HOLD_OUTCOMES, RECOMPUTE_REASONS, TransferLog, merge
from tests.metrics_doc import differences, documented_series, exposed_series


def _metrics(registry: CollectorRegistry) -> Any:
    from kvbroker.integrations.vllm import KvBrokerConnector

    # vLLM passes its metric classes (they register in its global registry); these register in the test's own.
    class OurCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "registry": registry})

    class OurHistogram(Histogram):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "registry": registry})

    class OurGauge(Gauge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "registry": registry})

    types = {Gauge: OurGauge, Counter: OurCounter, Histogram: OurHistogram}
    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    config = SimpleNamespace(kv_transfer_config=None)
    return KvBrokerConnector.build_prom_metrics(config, types, ["model_name", "engine"], labels)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "tiny", **labels})
    assert value is not None, (name, labels)
    return value


def test_the_connector_stats_become_vllm_kvbroker_series_per_engine() -> None:
    registry = CollectorRegistry()
    prom = _metrics(registry)
    # Every reason exists at zero before anything happened (a rate over it is defined from the start).
    for reason in RECOMPUTE_REASONS:
        assert _value(registry, "vllm:kvbroker_recomputes_total", engine="0", reason=reason) == 0
        assert _value(registry, "vllm:kvbroker_pull_failures_total", engine="1", reason=reason) == 0
    for outcome in HOLD_OUTCOMES:
        assert _value(registry, "vllm:kvbroker_expired_holds_total", engine="0", outcome=outcome) == 0

    worker, scheduler, prefill = TransferLog(), TransferLog(), TransferLog()
    worker.record("a", 1 << 20, 0.004, "shm")
    worker.record_outcome(ok=True)
    worker.record_recompute("hold_expired", pull_failed=True)
    worker.record_outcome(ok=False)
    scheduler.record_recompute("layout")
    scheduler.record_recompute("no such reason")  # folded, never a new label value
    prefill.record_expired_hold("lapsed")
    one, two, three = worker.take(), scheduler.take(), prefill.take()
    assert one is not None and two is not None and three is not None
    prom.observe(merge(one, two), engine_idx=1)
    prom.observe(three, engine_idx=0)

    assert _value(registry, "vllm:kvbroker_pulls_total", engine="1") == 2
    assert _value(registry, "vllm:kvbroker_pull_seconds_count", engine="1") == 1
    assert _value(registry, "vllm:kvbroker_pull_seconds_bucket", engine="1", le="0.005") == 1
    assert _value(registry, "vllm:kvbroker_pull_bytes_sum", engine="1") == 1 << 20
    assert _value(registry, "vllm:kvbroker_pull_failures_total", engine="1", reason="hold_expired") == 1
    assert _value(registry, "vllm:kvbroker_recomputes_total", engine="1", reason="hold_expired") == 1
    assert _value(registry, "vllm:kvbroker_recomputes_total", engine="1", reason="layout") == 1
    assert _value(registry, "vllm:kvbroker_recomputes_total", engine="1", reason="other") == 1
    assert _value(registry, "vllm:kvbroker_pull_failures_total", engine="1", reason="layout") == 0  # never tried
    assert _value(registry, "vllm:kvbroker_expired_holds_total", engine="0", outcome="lapsed") == 1
    assert _value(registry, "vllm:kvbroker_pulls_total", engine="0") == 0  # engine 0 pulled nothing
    # Label sets: vLLM's two plus at most one bounded label of ours.
    for family in registry.collect():
        if family.name.startswith("vllm:kvbroker"):
            for sample in family.samples:
                assert set(sample.labels) - {"model_name", "engine", "le"} <= {"reason", "outcome"}, sample


def test_a_stats_interval_with_only_recomputes_or_expired_holds_is_still_reported() -> None:
    from kvbroker.integrations.vllm import KvBrokerConnector

    log = TransferLog()
    log.record_expired_hold("capped")
    data = log.take()
    assert data is not None  # no pull at all, still reported (the prefill side never pulls)
    stats = KvBrokerConnector.build_kv_connector_stats(data)
    assert not stats.is_empty()
    assert stats.reduce()["expired_holds_capped"] == 1


def test_the_docs_list_is_what_vllms_metrics_exposes() -> None:
    """Issue 31 item 6: docs/vllm.md's list of the connector's series on vLLM's `/metrics` is the list, names and
    label values (every reason and outcome documented exists at zero; none exists undocumented). The same page of a
    real server: tests/vllm/test_openai_proxy_e2e.py."""
    registry = CollectorRegistry()
    _metrics(registry)
    documented = documented_series("vllm:kvbroker_")
    assert documented["vllm:kvbroker_expired_holds_total"].values["outcome"] == set(HOLD_OUTCOMES)
    assert documented["vllm:kvbroker_recomputes_total"].values["reason"] == set(RECOMPUTE_REASONS)
    page = generate_latest(registry).decode()
    assert differences(documented, exposed_series(page, "vllm:kvbroker_")) == []
