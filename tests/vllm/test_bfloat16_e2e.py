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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_CPU_AMX
from tests.vllm.engines import Engine, EngineSpec
from tests.vllm.kvbytes import prompt_kv
from tests.vllm.tiny_model import BLOCK_SIZE, NUM_LAYERS, PAGE_BYTES, VOCAB_SIZE, build

pytestmark = pytest.mark.timeout(900)


def _cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_tile" in flags and "amx_bf16" in flags


@dataclass
class Engines:
    prefill: Engine
    prefill64: Engine
    """Blocks of 64 tokens: the decode engine (blocks of 32) remaps them token by token."""
    decode: Engine
    decode_daemon: LocalDaemon


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    root = tmp_path_factory.mktemp("bf16")
    model = str(build(root / "tiny-llama"))
    daemons = [LocalDaemon(root, 41 + i, backends=("shm",)).start() for i in range(3)]
    p_daemon, p64_daemon, d_daemon = daemons
    units: dict[str, object] = {}  # default settings: the block-size remap settles on both engines' token views
    prefill = Engine("prefill-bf16", EngineSpec(model, p_daemon.target, units, dtype="auto",
                                                log_path=str(root / "prefill.log"))).start()
    prefill64 = Engine("prefill64-bf16", EngineSpec(model, p64_daemon.target, units, dtype="auto", block_size=64,
                                                    log_path=str(root / "prefill64.log"))).start()
    trusted = ",".join(f"{d.cluster_id}={d.peer_address}" for d in (p_daemon, p64_daemon))
    decode = Engine("decode-bf16", EngineSpec(
        model, d_daemon.target, {**units, "kvbroker_prefill_daemons": trusted}, dtype="auto", prefix_caching=False,
        kv_cache_bytes=28 * NUM_LAYERS * PAGE_BYTES, log_path=str(root / "decode.log"))).start()
    try:
        for engine in (prefill, prefill64, decode):
            engine.wait_ready()
        yield Engines(prefill, prefill64, decode, d_daemon)
    finally:
        for engine in (prefill, prefill64, decode):
            engine.close()
        for daemon in daemons:
            daemon.signal(signal.SIGCONT)
            assert daemon.stop() == 0, daemon.log_tail()


def test_the_first_request_of_a_bfloat16_decode_engine_is_a_pd_request_and_it_lives(engines: Engines) -> None:
    if not _cpu_has_amx():
        pytest.skip("this CPU has no AMX: vLLM runs its vec kernel in bfloat16 here")
    prefill, decode = engines.prefill, engines.decode
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(1, VOCAB_SIZE, size=2 * BLOCK_SIZE + 5)]
    out = prefill.call("generate", [("first", prompt, 1, {"do_remote_decode": True})])
    params = out["first"]["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    got = decode.call("generate", [("first", prompt, 6, params)])
    assert len(got["first"]["tokens"]) == 6
    report = got["first"]["kv_transfer_params"]
    assert report is not None and report.get("kvbroker_tokens_pulled"), report


def test_kv_remapped_from_blocks_of_64_is_byte_for_byte_what_the_decode_engine_writes_itself(
        engines: Engines) -> None:
    """Prefill blocks of 64 tokens, decode blocks of 32, bfloat16 (the "amx" layout where the CPU has AMX, "vec"
    elsewhere: the tag names it): the KV the decode engine pulled for a prompt equals, byte for byte, the KV it
    writes itself when it computes the same prompt (a plain request), token by token where its layout puts them."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, VOCAB_SIZE, size=2 * 64 + 37)]
    params = engines.prefill64.call("generate", [("remap", prompt, 1, {"do_remote_decode": True})])[
        "remap"]["kv_transfer_params"]
    expected_memory = MEMORY_CPU_AMX if _cpu_has_amx() else MEMORY_CPU
    assert f"memory={expected_memory} " in params["kvbroker_layout_tag"], params
    assert "block=64 " in params["kvbroker_layout_tag"], params
    report = engines.decode.call("generate", [("remap", prompt, 2, params)])["remap"]["kv_transfer_params"]
    assert report is not None and (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (
        len(prompt), 0), report
    pulled = prompt_kv(engines.decode, engines.decode_daemon, "remap", len(prompt))
    engines.decode.call("generate", [("local", prompt, 1, None)])
    computed = prompt_kv(engines.decode, engines.decode_daemon, "local", len(prompt))
    assert len(pulled) == NUM_LAYERS and all(pulled)
    for layer, (got, want) in enumerate(zip(pulled, computed, strict=True)):
        assert got == want, f"layer {layer}: the pulled KV differs from the decode engine's own"
