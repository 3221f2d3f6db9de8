"""The connector's series on vLLM's own `/metrics` (vLLM's `build_prom_metrics` hook, as NixlConnector's `vllm:nixl_*`).

vLLM builds this once in its front-end process, with its metric classes and its per-engine labels (`model_name`,
`engine`), and calls `observe` with each interval's connector stats (`stats.py`'s dict, summed over the workers and
the scheduler side of one engine). Series (Prometheus adds `_total` to counters and `_bucket`/`_sum`/`_count` to
histograms):

    vllm:kvbroker_pull_seconds           histogram: time of each pull that landed (decode side)
    vllm:kvbroker_pull_bytes             histogram: bytes of each pull that landed
    vllm:kvbroker_pulls                  counter: pulls tried, landed or not
    vllm:kvbroker_pull_failures{reason}  counter: pulls tried that failed (hold_expired, unreachable, timeout, ...)
    vllm:kvbroker_recomputes{reason}     counter: requests whose KV was computed here instead of pulled, failed pulls
                                         and refusals (layout, untrusted, bad_params, ...) alike
    vllm:kvbroker_expired_holds{outcome} counter: prefill side, holds that ended without a release
                                         (lapsed, capped, no_event, ...)

Every reason and outcome of `stats.RECOMPUTE_REASONS` / `stats.HOLD_OUTCOMES` is created at zero, so that a rate
over it exists before the first failure and the label values stay that bounded set.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvbroker.integrations.vllm.stats import HOLD_OUTCOMES, RECOMPUTE_REASONS

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES_BUCKETS = tuple(float(2 ** n) for n in range(12, 36, 2))  # 4 KiB .. 32 GiB, x4 apart


class KvBrokerPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        histogram, counter = metric_types[Histogram], metric_types[Counter]
        engines = per_engine_labelvalues.items()
        seconds = histogram(name="vllm:kvbroker_pull_seconds", documentation="Time of each kvbroker KV pull that "
                            "landed (decode side)", buckets=_SECONDS_BUCKETS, labelnames=labelnames)
        nbytes = histogram(name="vllm:kvbroker_pull_bytes", documentation="Bytes of each kvbroker KV pull that landed",
                           buckets=_BYTES_BUCKETS, labelnames=labelnames)
        pulls = counter(name="vllm:kvbroker_pulls", documentation="kvbroker KV pulls tried (landed or not)",
                        labelnames=labelnames)
        failures = counter(name="vllm:kvbroker_pull_failures", documentation="kvbroker KV pulls that failed, by "
                           "reason", labelnames=[*labelnames, "reason"])
        recomputes = counter(name="vllm:kvbroker_recomputes", documentation="Requests whose KV was computed locally "
                             "instead of pulled through kvbroker, by reason", labelnames=[*labelnames, "reason"])
        expired = counter(name="vllm:kvbroker_expired_holds", documentation="Prefill requests whose held KV blocks "
                          "were freed without a decode node's release, by how the hold ended",
                          labelnames=[*labelnames, "outcome"])
        self._seconds = {i: seconds.labels(*values) for i, values in engines}
        self._bytes = {i: nbytes.labels(*values) for i, values in engines}
        self._pulls = {i: pulls.labels(*values) for i, values in engines}
        self._counts = {
            key: {i: {label: metric.labels(*values, label) for label in labels} for i, values in engines}
            for key, metric, labels in (("failures", failures, RECOMPUTE_REASONS),
                                        ("recomputes", recomputes, RECOMPUTE_REASONS),
                                        ("expired_holds", expired, HOLD_OUTCOMES))}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for s in data.get("transfer_s", ()):
            self._seconds[engine_idx].observe(s)
        for n in data.get("transfer_bytes", ()):
            self._bytes[engine_idx].observe(n)
        if data.get("num_pulls"):
            self._pulls[engine_idx].inc(data["num_pulls"])
        for key, by_label in self._counts.items():
            children = by_label[engine_idx]
            for label, n in (data.get(key) or {}).items():
                # The stats come from this connector's own processes; a label it does not know still stays bounded.
                children.get(label, children["other"]).inc(n)
