"""P/D in vLLM's CPU default dtype (bfloat16): with bfloat16 and blocks of a multiple of 32 tokens, vLLM picks its
AMX attention kernel on CPUs that have AMX, and a decode engine whose first model step is a decode over pulled KV
(what P/D always does) died of SIGILL there (issue 31). The pulled KV must also be, byte for byte, what the decode
engine writes itself for the same prompt: in bfloat16 the tokens of the tiny random model cannot settle that (its
logits are nearly flat and the decode path rounds differently), bytes can.

Runs in its own venv (tests/vllm/run.sh); skips where the CPU has no AMX (the crash needs it) only for the AMX check.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from kvbroker._local import LocalDaemon
from tests.vllm.engines import Engine, EngineSpec
from tests.vllm.tiny_model import BLOCK_SIZE, NUM_LAYERS, PAGE_BYTES, VOCAB_SIZE, build

pytestmark = pytest.mark.timeout(900)


def _cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_tile" in flags and "amx_bf16" in flags


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    root = tmp_path_factory.mktemp("bf16")
    model = str(build(root / "tiny-llama"))
    p_daemon = LocalDaemon(root, 41, backends=("shm",)).start()
    d_daemon = LocalDaemon(root, 42, backends=("shm",)).start()
    prefill = Engine("prefill-bf16", EngineSpec(model, p_daemon.target, dtype="auto",
                                                log_path=str(root / "prefill.log"))).start()
    decode = Engine("decode-bf16", EngineSpec(
        model, d_daemon.target, {"kvbroker_prefill_daemons": f"{p_daemon.cluster_id}={p_daemon.peer_address}"},
        dtype="auto", kv_cache_bytes=28 * NUM_LAYERS * PAGE_BYTES, log_path=str(root / "decode.log"))).start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        for engine in (prefill, decode):
            engine.close()
        for daemon in (p_daemon, d_daemon):
            daemon.signal(signal.SIGCONT)
            assert daemon.stop() == 0, daemon.log_tail()


def test_the_first_request_of_a_bfloat16_decode_engine_is_a_pd_request_and_it_lives(
        engines: tuple[Engine, Engine]) -> None:
    if not _cpu_has_amx():
        pytest.skip("this CPU has no AMX: vLLM runs its vec kernel in bfloat16 here")
    prefill, decode = engines
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(1, VOCAB_SIZE, size=2 * BLOCK_SIZE + 5)]
    out = prefill.call("generate", [("first", prompt, 1, {"do_remote_decode": True})])
    params = out["first"]["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    got = decode.call("generate", [("first", prompt, 6, params)])
    assert len(got["first"]["tokens"]) == 6
    report = got["first"]["kv_transfer_params"]
    assert report is not None and report.get("kvbroker_tokens_pulled"), report
