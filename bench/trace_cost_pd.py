"""The cost of the P/D proxy's and the vLLM connector's spans (docs/tracing.md): off, on with nothing sampled, on with
every request sampled; the daemon's is bench/trace_cost.py.

1. The proxy (`python -m kvbroker.integrations.vllm_proxy`, a process of its own) in front of a fake prefill and a
   fake decode server (aiohttp, answering as vLLM's OpenAI server does, in a helper process beside an OTLP/gRPC sink
   that counts what it is sent): one client on one keep-alive connection sends `--requests` non-streamed completions,
   then as many streamed ones (16 chunks and `[DONE]`). Modes, alternating round by round (each one first in turn):
   **off** (no OTEL_* settings, no flag), **before** (`--before TREE`: the proxy of another source tree, e.g. the
   commit before tracing), **on-0%** (`--otlp-traces-endpoint` to the sink, `OTEL_TRACES_SAMPLER=traceidratio` at 0:
   tracing on, no request sampled: non-recording spans, nothing exported), **on-100%** (the same,
   `OTEL_TRACES_SAMPLER=always_on`: three spans a request, exported). Per mode: the client's latency p50/p99 and the
   proxy's CPU a request (every thread's, from /proc/<pid>/task/*/schedstat, the exporter's included; and the busiest
   thread's alone, the event loop's: the requests' own work), medians over rounds, and their ratios to off.
2. The connector's scheduler side (`SchedulerSide`, in this process, driven as vLLM drives it and as
   tests/unit/test_trace_spans.py does): a decode request that pulls (arrival, matched tokens, allocation, the step's
   plan, the workers' transfer, the pull's end, the next step's output, finished: wait_in_queue and pull spans) and
   a prefill request that grants (finished, its grant, the hold's end: grant and hold spans), the daemon replaced by
   a stub that returns a grant at once (so only the hooks are timed). Spans off (`spans` None: what every request
   pays) against on (a provider of its own exporting over OTLP/gRPC to the sink, flushed inside the timed block),
   the requests' trace (the proxy's leg) unsampled or sampled; microseconds a request of wall time, of this thread's
   CPU and of the process's (the exporter's thread too).

    git archive c7018f4 | (mkdir -p /tmp/kvb-c7018f4 && tar -x -C /tmp/kvb-c7018f4)    # the proxy before its spans
    .venv/bin/python bench/trace_cost_pd.py --before /tmp/kvb-c7018f4 --rounds 5

Needs `kvbroker[proxy,trace]`. Prints the tables and a JSON line."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TREE = Path(__file__).resolve().parent.parent

PROMPT = "The quick brown fox jumps over the lazy dog. " * 40
ANSWER_TOKENS = 16
KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p",
             "remote_request_id": "p-req", "remote_block_ids": [list(range(16))], "remote_host": "127.0.0.1",
             "remote_port": 7101, "remote_num_tokens": 500, "tp_size": 1, "kvbroker_grant": "x" * 64}


# -- the fakes: a prefill and a decode server, and an OTLP sink (a process of their own) -------------------------------
def serve_fakes() -> None:
    """Prints {"prefill": URL, "decode": URL, "otlp": HOST:PORT} and serves until stdin closes; GET /spans on
    either server: the spans the sink received."""
    import grpc
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    sys.path.insert(0, str(TREE / "bench"))
    from trace_cost import Sink

    sink = Sink()
    grpc_server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, grpc_server)  # type: ignore[no-untyped-call]
    otlp_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "cmpl-p", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": " x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 500, "completion_tokens": 1, "total_tokens": 501},
                                  "kv_transfer_params": KV_PARAMS})

    async def decode(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            choice = {"index": 0, "text": " y" * ANSWER_TOKENS, "finish_reason": "length"}
            return web.json_response({"id": "cmpl-d", "object": "text_completion", "model": "tiny", "choices": [choice],
                                      "usage": {"prompt_tokens": 500, "completion_tokens": ANSWER_TOKENS,
                                                "total_tokens": 500 + ANSWER_TOKENS}})
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await answer.prepare(request)
        for i in range(ANSWER_TOKENS):
            chunk = {"id": "cmpl-d", "object": "text_completion", "model": "tiny",
                     "choices": [{"index": 0, "text": " y", "finish_reason": None if i + 1 < ANSWER_TOKENS else
                                  "length"}]}
            await answer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await answer.write(b"data: [DONE]\n\n")
        await answer.write_eof()
        return answer

    async def spans(request: web.Request) -> web.Response:
        return web.json_response({"spans": sink.spans})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def main() -> None:
        urls = {}
        for role, handler in (("prefill", prefill), ("decode", decode)):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            app.router.add_get("/spans", spans)
            app.router.add_get("/health", health)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls[role] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        print(json.dumps({**urls, "otlp": f"127.0.0.1:{otlp_port}"}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes it

    asyncio.run(main())
    grpc_server.stop(0)


@contextlib.contextmanager
def fakes() -> Iterator[dict[str, str]]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-fakes"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)


def spans_received(url: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/spans")
    n: int = json.loads(conn.getresponse().read())["spans"]
    conn.close()
    return n


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time of each thread of `pid` so far, in ns (bench/floor.py's measure, thread by thread)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # the thread ended meanwhile
            times[task.name] = int((task / "schedstat").read_text().split()[0])
    return times


def settled(url: str, expected: int, within: float = 15.0) -> int:
    """The spans the sink received, once they are `expected` (or `within` seconds passed: then fewer, said)."""
    deadline = time.monotonic() + within
    while (n := spans_received(url)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return n


# -- 1. the proxy -----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(conn: http.client.HTTPConnection, stream: bool) -> float:
    """One completion through the proxy, read to its end: seconds."""
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "stream": stream}).encode()
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    took = time.perf_counter() - started
    if response.status != 200 or (stream and not raw.endswith(b"data: [DONE]\n\n")):
        raise RuntimeError(f"the proxy answered {response.status}: {raw[:300]!r}")
    return took


WARM_UPS = 100
SPANS_A_REQUEST = 3
"""The proxy's: pd.request, pd.prefill, pd.decode."""
SPANS_A_PAIR = 4
"""The connector's, a decode request's and a prefill request's: wait_in_queue, pull; grant, hold."""


def run_proxy(env: dict[str, str], extra: list[str], urls: dict[str, str], requests: int) -> dict[str, Any]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvbroker.integrations.vllm_proxy", "--prefill", urls["prefill"],
                             "--decode", urls["decode"], "--port", str(port), "--health-interval", "0", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                post(conn, False)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the proxy did not start") from None
                time.sleep(0.1)
        for i in range(WARM_UPS):  # warm-up: both kinds, the upstream connections made
            post(conn, i % 2 == 1)
        out: dict[str, Any] = {}
        for kind, stream in (("json", False), ("stream", True)):
            before = thread_cpu_ns(proc.pid)
            times = [post(conn, stream) for _ in range(requests)]
            spent = [ns - before.get(tid, 0) for tid, ns in thread_cpu_ns(proc.pid).items()]
            cpu, loop = sum(spent), max(spent)
            times.sort()
            out[kind] = {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6,
                         "cpu_us": cpu / requests / 1e3, "loop_cpu_us": loop / requests / 1e3}
        conn.close()
        out["requests"] = 1 + WARM_UPS + 2 * requests
        return out
    finally:
        proc.terminate()
        proc.wait(30)


# -- 2. the connector's scheduler side ---------------------------------------------------------------------------------
@dataclass
class Request:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any]
    num_computed_tokens: int = 0


class _StubClient:
    """The daemon's CreateGrant, answered at once (a real one is a gRPC call of ~0.6 ms: BENCHMARKS.md, grants)."""

    def __init__(self, grant: Any) -> None:
        self.grant = grant

    def create_grant(self, *args: Any, **kwargs: Any) -> Any:
        return self.grant

    def close(self) -> None:
        pass


def connector_sides() -> tuple[Any, Any, str]:
    """A decode side, a prefill side (its daemon a stub) and their layout tag; no spans."""
    from kvbroker.integrations.vllm.config import ConnectorConfig
    from kvbroker.integrations.vllm.layout import KvLayout
    from kvbroker.integrations.vllm.params import WorkerEndpoint
    from kvbroker.integrations.vllm.scheduler import SchedulerSide
    from kvbroker.types import Grant

    tag = KvLayout(3, 100, 32, 1, 64, "float32", 16384, "m1", 1).tag()
    grant = Grant(bytes(range(16)), bytes(range(32)))
    decode = SchedulerSide(ConnectorConfig(target="unix:///nonexistent.sock", prefill_daemons="1=127.0.0.1:1"),
                           "engine-d", 32)
    decode.set_endpoints({0: WorkerEndpoint(0, 2, "127.0.0.1:2", 9, tag)})
    prefill = SchedulerSide(ConnectorConfig(target="unix:///nonexistent.sock", hold_lease_s=60), "engine-p", 32,
                            client=_StubClient(grant))  # type: ignore[arg-type]
    prefill.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", 5, tag)})
    for side in (decode, prefill):
        side.grants._stop = True  # no renewal thread: nothing to renew against, and no thread in the measure
    return decode, prefill, tag


@dataclass
class ConnectorMode:
    decode: Any
    prefill: Any
    tag: str
    provider: Any = None
    """Where the spans go (flushed at the end of each timed block); None: spans off."""
    sampled: bool = True
    """The requests' trace (the proxy's leg) is sampled: their spans are recorded and exported."""


def drive(mode: ConnectorMode, n: int) -> dict[str, float]:
    """`n` decode requests that pull and `n` prefill requests that grant, each through its scheduler hooks;
    microseconds a request (a pair): wall, this thread's CPU, the process's CPU (the span exporter's thread too)."""
    from kvbroker.integrations.vllm.params import WorkerEndpoint, prefill_output_params
    from kvbroker.integrations.vllm.stats import RequestTransfer
    from kvbroker.types import Grant

    grant = Grant(bytes(range(16)), bytes(range(32)))
    decode, prefill = mode.decode, mode.prefill
    remote = prefill_output_params({0: WorkerEndpoint(0, 1, "127.0.0.1:1", 5, mode.tag)}, "engine-p", "p-req",
                                   [list(range(16))], 500, grant)
    flags = "01" if mode.sampled else "00"
    leg = {"kvbroker_traceparent": f"00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-{flags}"}
    blocks = list(range(50, 66))
    transfer = RequestTransfer(0.01, 16 * 32 * 16384, "shm", 500)
    wall = 0.0
    thread0, process0 = time.thread_time(), time.process_time()
    for i in range(n):
        d = Request(f"d-{i}", 500, {**remote, **leg})
        p = Request(f"p-{i}", 500, {"do_remote_decode": True, **leg}, num_computed_tokens=500)
        started = time.perf_counter()
        decode.on_new_request(d)
        decode.num_new_matched_tokens(d, 0)
        decode.after_alloc(d, blocks, blocks, 500)
        decode.take_plan()
        decode.on_transfers({d.request_id: transfer})
        decode.on_pulls_ended({d.request_id})
        decode.on_step_output()
        d.num_computed_tokens = 501
        decode.request_finished(d, blocks, finished_normally=True)
        prefill.on_new_request(p)
        prefill.request_finished(p, blocks, finished_normally=True)
        prefill.take_plan()
        if prefill.spans is not None:  # as the connector does on the engine's finished_sending
            prefill.spans.holds_ended({p.request_id})
        wall += time.perf_counter() - started
        decode.grants._releases.clear()  # (no thread sends them; both modes alike)
    if mode.provider is not None:
        mode.provider.force_flush()  # the export of this block's spans counts in its CPU
    return {"wall_us": wall / n * 1e6, "thread_cpu_us": (time.thread_time() - thread0) / n * 1e6,
            "process_cpu_us": (time.process_time() - process0) / n * 1e6}


def connector_modes(endpoint: str) -> tuple[dict[str, ConnectorMode], Any]:
    """Spans off; on, the requests' traces unsampled (the proxy sampled them out: the spans follow its decision);
    on, every one sampled."""
    from kvbroker.integrations import otel
    from kvbroker.integrations.vllm.spans import RequestSpans

    provider = otel.own_provider("trace-cost-pd", endpoint, sampler_ratio=1.0)
    modes = {"off": ConnectorMode(*connector_sides())}
    for name, sampled in (("on-unsampled", False), ("on-100%", True)):
        mode = modes[name] = ConnectorMode(*connector_sides(), provider, sampled)
        mode.decode.spans = RequestSpans(provider.get_tracer("kvbroker.vllm"), "engine-d", "tiny")
        mode.prefill.spans = RequestSpans(provider.get_tracer("kvbroker.vllm"), "engine-p", "tiny")
    return modes, provider


# -- the run ----------------------------------------------------------------------------------------------------------
def rotations(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each mode first in turn: no order bias
            yield r, name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, help="a source tree (client/) whose proxy is measured as 'before'")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=1000, help="proxy requests per kind (json, stream) and mode")
    p.add_argument("--connector-requests", type=int, default=3000, help="connector request pairs per mode and round")
    p.add_argument("--skip", default="", help="'proxy' or 'connector'")
    p.add_argument("--proxy-modes", default="off,before,on-0%,on-100%",
                   help="the proxy's modes (off is always measured; before needs --before)")
    p.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_fakes:
        serve_fakes()
        return
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVBROKER_", "OTEL_"))}
    loads: list[float] = []
    report: dict[str, Any] = {"rounds": args.rounds}
    with fakes() as urls:
        if args.skip != "proxy":
            modes: dict[str, tuple[dict[str, str], list[str]]] = {"off": ({**base, "PYTHONPATH": str(TREE / "client")},
                                                                          [])}
            if args.before is not None:
                modes["before"] = ({**base, "PYTHONPATH": str(args.before.resolve() / "client")}, [])
            traced = ["--otlp-traces-endpoint", urls["otlp"]]
            modes["on-0%"] = ({**base, "PYTHONPATH": str(TREE / "client"), "OTEL_TRACES_SAMPLER": "traceidratio",
                               "OTEL_TRACES_SAMPLER_ARG": "0"}, traced)
            modes["on-100%"] = ({**base, "PYTHONPATH": str(TREE / "client"), "OTEL_TRACES_SAMPLER": "always_on"},
                                traced)
            wanted = {"off", *args.proxy_modes.split(",")}
            modes = {m: how for m, how in modes.items() if m in wanted}
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for r, mode in rotations(list(modes), args.rounds):
                loads.append(os.getloadavg()[0])
                runs[mode].append(run_proxy(*modes[mode], urls, args.requests))
                print(f"proxy round {r + 1}: {mode} {runs[mode][-1]}", file=sys.stderr, flush=True)
            sent = sum(run["requests"] for run in runs.get("on-100%", []))
            report["proxy_spans"] = settled(urls["prefill"], SPANS_A_REQUEST * sent)
            report["proxy_spans_expected"] = SPANS_A_REQUEST * sent
            proxy = {f"{kind} {what}": {m: statistics.median(run[kind][what] for run in runs[m]) for m in modes}
                     for kind in ("json", "stream") for what in ("p50_us", "p99_us", "cpu_us", "loop_cpu_us")}
            report["proxy"] = proxy
            print_table(f"the proxy: {args.requests} requests a kind and mode a round, medians over {args.rounds} "
                        f"rounds; spans received with tracing on: {report['proxy_spans']} of "
                        f"{report['proxy_spans_expected']}", proxy, list(modes))
        if args.skip != "connector":
            sides, provider = connector_modes(urls["otlp"])
            before_spans = spans_received(urls["prefill"])
            cruns: dict[str, list[dict[str, float]]] = {m: [] for m in sides}
            for mode in sides:  # warm-up (imports, first spans)
                drive(sides[mode], WARM_UPS)
            for r, mode in rotations(list(sides), args.rounds):
                loads.append(os.getloadavg()[0])
                cruns[mode].append(drive(sides[mode], args.connector_requests))
                print(f"connector round {r + 1}: {mode} {cruns[mode][-1]}", file=sys.stderr, flush=True)
            provider.shutdown()
            connector = {what: {m: statistics.median(run[what] for run in cruns[m]) for m in sides}
                         for what in ("wall_us", "thread_cpu_us", "process_cpu_us")}
            report["connector"] = connector
            # (the unsampled mode's requests export nothing)
            report["connector_spans_expected"] = SPANS_A_PAIR * (WARM_UPS + args.rounds * args.connector_requests)
            report["connector_spans"] = settled(urls["prefill"], before_spans + report["connector_spans_expected"]
                                                ) - before_spans
            print_table(f"the connector: a decode request that pulls + a prefill request that grants, us a pair, "
                        f"{args.connector_requests} pairs a mode a round, medians over {args.rounds} rounds; spans "
                        f"received: {report['connector_spans']} of {report['connector_spans_expected']}", connector,
                        list(sides))
    report["load"] = [min(loads), max(loads)] if loads else []
    print(f"load average (1 min) {min(loads):.1f}-{max(loads):.1f}" if loads else "")
    print(json.dumps(report))


def print_table(title: str, table: dict[str, dict[str, float]], modes: list[str]) -> None:
    print(title)
    others = [m for m in modes if m != "off"]
    print(f"{'':<18s}" + "".join(f"{m:>13s}" for m in modes) + "".join(f"{m + '/off':>18s}" for m in others))
    for name, row in table.items():
        print(f"{name:<18s}" + "".join(f"{row[m]:>13.1f}" for m in modes)
              + "".join(f"{row[m] / row['off']:>18.3f}" for m in others))


if __name__ == "__main__":
    main()
