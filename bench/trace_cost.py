"""The cost of tracing: kvbench's latency item (64 KiB pulls as calls and as session messages, refused pulls, a bare
ping; shm and tcp) with tracing off, with tracing on and every request sampled, and, where a tree of another
revision is given, that revision's code; the modes alternate round by round (each one first in turn), so that they
share the machine's load.

    git archive main | (mkdir -p /tmp/kvb-main && tar -x -C /tmp/kvb-main)
    cp server/kvbrokerd/*.so /tmp/kvb-main/server/kvbrokerd/      # the same native helpers (their C is unchanged)
    .venv/bin/python bench/trace_cost.py --baseline /tmp/kvb-main --rounds 4

Tracing on: both daemons get KVBROKER_OTLP_TRACES_ENDPOINT (an OTLP/gRPC sink in this process that counts what it
is sent) and OTEL_TRACES_SAMPLER=always_on. Prints each mode's p50 per item (the median over rounds) and its ratio
to the baseline (or to tracing off), and the spans the sink received."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

KVBENCH = Path(__file__).resolve().parent / "kvbench.py"
ITEMS = ("ping", "pull", "session", "refused")


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def run(env: dict[str, str], samples: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(KVBENCH), "--only", "latency", "--json",
                          "--latency-samples", str(samples)], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    latency: dict[str, Any] = json.loads(out.stdout)["latency"]
    return latency


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="a source tree (client/ and server/) of the revision to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=1000, help="pulls and pings per latency series")
    args = p.parse_args()
    sink = Sink()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVBROKER_", "OTEL_"))}
    modes: dict[str, dict[str, str]] = {}
    if args.baseline is not None:
        tree = args.baseline.resolve()
        modes["baseline"] = {**base, "PYTHONPATH": f"{tree / 'client'}{os.pathsep}{tree / 'server'}"}
    modes["off"] = dict(base)
    modes["on-100%"] = {**base, "KVBROKER_OTLP_TRACES_ENDPOINT": f"127.0.0.1:{port}",
                        "OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "kvbench"}
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    loads = []
    names = list(modes)
    for r in range(args.rounds):
        for mode in names[r % len(names):] + names[:r % len(names)]:  # each mode first in turn: no order bias
            env = modes[mode]
            loads.append(os.getloadavg()[0])
            results[mode].append(run(env, args.samples))
            print(f"round {r + 1}: {mode} done (spans so far {sink.spans})", file=sys.stderr, flush=True)
    server.stop(0)
    reference = "baseline" if "baseline" in modes else "off"
    table: dict[str, dict[str, float]] = {}
    for mode, runs in results.items():
        for backend in ("shm", "tcp"):
            for item in ITEMS:
                key = f"kvbroker-{backend}-{item}"
                table.setdefault(f"{backend} {item}", {})[mode] = statistics.median(run[key]["p50_us"] for run in runs)
    print(f"p50 in us, the median over {args.rounds} rounds; load average (1 min) {min(loads):.1f}-{max(loads):.1f}; "
          f"spans received with tracing on: {sink.spans}")
    head = f"{'':<14s}" + "".join(f"{m:>12s}" for m in modes) + "".join(f"{m + '/' + reference:>18s}"
                                                                      for m in modes if m != reference)
    print(head)
    for name, row in table.items():
        print(f"{name:<14s}" + "".join(f"{row[m]:>12.0f}" for m in modes)
              + "".join(f"{row[m] / row[reference]:>18.3f}" for m in modes if m != reference))
    print(json.dumps({"rounds": args.rounds, "load": [min(loads), max(loads)], "spans": sink.spans, "p50_us": table}))


if __name__ == "__main__":
    main()
