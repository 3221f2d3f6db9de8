"""Per-transfer numbers the connector reports through vLLM's KV connector stats (logged with vLLM's periodic
metrics line): pulls, failures, bytes and transfer time per request, and the prefill engines' KV refused as
incompatible (by the field that could not be mapped: `refused_<field>`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


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

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            if not self._data["num_pulls"]:
                return None
            data, self._data = self._data, empty()
        return data


def empty() -> dict[str, Any]:
    return {"num_pulls": 0, "num_failed": 0, "transfer_bytes": [], "transfer_s": [], "refused": {}}


def refusals(by_field: dict[str, int]) -> dict[str, Any]:
    return {**empty(), "refused": dict(by_field)}


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {key: a[key] + b[key] for key in ("num_pulls", "num_failed", "transfer_bytes", "transfer_s")}
    refused = dict(a.get("refused", {}))
    for name, n in b.get("refused", {}).items():
        refused[name] = refused.get(name, 0) + n
    return {**out, "refused": refused}


def summarize(data: dict[str, Any]) -> dict[str, int | float]:
    times = sorted(data["transfer_s"])
    total_bytes = sum(data["transfer_bytes"])
    out: dict[str, int | float] = {"num_pulls": data["num_pulls"], "num_failed": data["num_failed"],
                                   "bytes_MB": round(total_bytes / 1e6, 3)}
    refused = data.get("refused", {})
    if refused:
        out["num_refused"] = sum(refused.values())
        out.update({f"refused_{name}": n for name, n in sorted(refused.items())})
    if times:
        out["avg_transfer_ms"] = round(sum(times) / len(times) * 1e3, 3)
        out["p90_transfer_ms"] = round(times[min(len(times) - 1, int(0.9 * len(times)))] * 1e3, 3)
        out["throughput_GBps"] = round(total_bytes / max(sum(times), 1e-9) / 1e9, 3)
    return out
