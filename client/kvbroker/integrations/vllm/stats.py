"""Per-transfer numbers the connector reports through vLLM's KV connector stats: pulls, failures, bytes and transfer
time per request, requests recomputed by reason, prefill engines' KV refused by the layout field that could not be
mapped (`refused_<field>`), and holds that expired. vLLM logs them with its periodic metrics line
and, through the connector's Prometheus hook (`prom.py`), exports them on its `/metrics`.

The numbers travel as one plain dict (`empty()`), serialised from the workers and the scheduler side to vLLM's
front end: lists of observations and {reason: count} maps, summed by `merge`."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kvbroker.status import LlmStatus


@dataclass(frozen=True, slots=True)
class RequestTransfer:
    """One request's pull as the decode engine's response reports it (`kv_transfer_params`)."""

    seconds: float
    nbytes: int
    backend: str
    tokens: int = 0
    """Prompt tokens whose KV landed (0: the pull failed and they are recomputed)."""

    def params(self) -> dict[str, Any]:
        if not self.tokens:
            return {}
        return {"kvbroker_transfer_ms": round(self.seconds * 1e3, 3), "kvbroker_transfer_bytes": self.nbytes,
                "kvbroker_backend": self.backend}

    def combine(self, other: RequestTransfer) -> RequestTransfer:
        """Two TP ranks' pulls of one request: they ran side by side; a token landed only if it did on every rank."""
        return RequestTransfer(max(self.seconds, other.seconds), self.nbytes + other.nbytes,
                               self.backend or other.backend, min(self.tokens, other.tokens))


class TransferLog:
    """Thread-safe accumulator of one worker's pulls since the last `take()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()
        self._requests: dict[str, RequestTransfer] = {}

    def record(self, request_id: str, nbytes: int, seconds: float, backend: str, tokens: int = 1) -> None:
        with self._lock:
            self._data["transfer_bytes"].append(int(nbytes))
            self._data["transfer_s"].append(float(seconds))
            self._requests[request_id] = RequestTransfer(seconds, int(nbytes), backend, int(tokens))

    def record_failed(self, request_id: str) -> None:
        with self._lock:
            self._requests[request_id] = RequestTransfer(0.0, 0, "", 0)

    def take_requests(self) -> dict[str, RequestTransfer]:
        with self._lock:
            out, self._requests = self._requests, {}
        return out

    def record_outcome(self, ok: bool) -> None:
        with self._lock:
            self._data["num_pulls"] += 1
            if not ok:
                self._data["num_failed"] += 1

    def record_recompute(self, reason: str, *, pull_failed: bool = False) -> None:
        """A request's KV (some or all of its blocks) is computed here instead of pulled, for `reason` (one of
        RECOMPUTE_REASONS); `pull_failed`: a pull was tried and failed (also counted as a failure by reason)."""
        reason = reason if reason in RECOMPUTE_REASONS else "other"
        with self._lock:
            _bump(self._data["recomputes"], reason)
            if pull_failed:
                _bump(self._data["failures"], reason)

    def record_refused(self, field: str) -> None:
        """A prefill engine's KV refused because of this layout field (one of REFUSED_FIELDS)."""
        with self._lock:
            _bump(self._data["refused"], field if field in REFUSED_FIELDS else "other")

    def record_expired_hold(self, outcome: str) -> None:
        """A prefill request's hold ended before a decode node released it (`lapsed`, `capped`, ...)."""
        outcome = outcome if outcome in HOLD_OUTCOMES else "other"
        with self._lock:
            _bump(self._data["expired_holds"], outcome)

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            if is_empty(self._data):
                return None
            data, self._data = self._data, empty()
        return data


RECOMPUTE_REASONS = ("hold_expired", "unreachable", "timeout", "refused_by_daemon", "layout", "untrusted",
                     "block_mismatch", "bad_params", "not_ready", "error", "other")
"""Why a request's KV was computed locally: its hold had ended (grant lapsed, released or unknown), the prefill daemon
could not be reached (link failed, not linked), the pull passed its deadline, the daemons refused it otherwise, the
engines' KV layouts or TP sizes differ, the prefill daemon is not trusted, the blocks did not line up, the request's
kv_transfer_params were malformed, this engine's workers had not reported their caches yet, a bug. Bounded: each is a
Prometheus label value."""
HOLD_OUTCOMES = ("lapsed", "capped", "cache_removed", "no_event", "daemon_restarted", "other")
"""How a hold ended without a release: its lease lapsed (no renewal), its cap passed, its cache went away; or the
engine let it go itself: no event came by the grant's cap plus a margin, or its daemon restarted (and the grant with
it)."""
REFUSED_FIELDS = ("version", "model", "dtype", "memory", "phys", "head", "layers", "total_kv_heads", "units", "tp",
                  "block", "kv_heads", "page", "cluster", "engine", "other")
"""The fields a refusal names (layout.MUST_MATCH and MAPPED, the prefill cluster, this engine): bounded labels."""
_COUNTS = ("recomputes", "failures", "expired_holds", "refused")
_REASON_OF_STATUS = {LlmStatus.LLM_KV_CACHE_NOT_EXIST: "hold_expired", LlmStatus.LLM_LINK_FAILED: "unreachable",
                     LlmStatus.LLM_NOT_YET_LINK: "unreachable", LlmStatus.LLM_TIMEOUT: "timeout"}


def reason_of(status: LlmStatus) -> str:
    """The recompute reason of a pull that failed with `status` (a grant the prefill daemon no longer knows reads
    LLM_KV_CACHE_NOT_EXIST: lapsed, capped or released)."""
    return _REASON_OF_STATUS.get(status, "refused_by_daemon")


def _bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def empty() -> dict[str, Any]:
    return {"num_pulls": 0, "num_failed": 0, "transfer_bytes": [], "transfer_s": [], "recomputes": {},
            "failures": {}, "expired_holds": {}, "refused": {}}


def is_empty(data: dict[str, Any]) -> bool:
    return not data.get("num_pulls") and not any(data.get(key) for key in _COUNTS)


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    zero = empty()
    out = {key: a.get(key, zero[key]) + b.get(key, zero[key])
           for key in ("num_pulls", "num_failed", "transfer_bytes", "transfer_s")}
    for key in _COUNTS:
        counts = dict(a.get(key) or {})
        for reason, n in (b.get(key) or {}).items():
            _bump(counts, reason, n)
        out[key] = counts
    return out


def summarize(data: dict[str, Any]) -> dict[str, int | float]:
    times = sorted(data["transfer_s"])
    total_bytes = sum(data["transfer_bytes"])
    out: dict[str, int | float] = {"num_pulls": data["num_pulls"], "num_failed": data["num_failed"],
                                   "bytes_MB": round(total_bytes / 1e6, 3)}
    if times:
        out["avg_transfer_ms"] = round(sum(times) / len(times) * 1e3, 3)
        out["p90_transfer_ms"] = round(times[min(len(times) - 1, int(0.9 * len(times)))] * 1e3, 3)
        out["throughput_GBps"] = round(total_bytes / max(sum(times), 1e-9) / 1e9, 3)
    if data.get("refused"):
        out["num_refused"] = sum(data["refused"].values())
    for key in _COUNTS:  # e.g. recomputes_hold_expired=2 in vLLM's log line
        for reason, n in sorted((data.get(key) or {}).items()):
            out[f"{key}_{reason}"] = n
    return out
