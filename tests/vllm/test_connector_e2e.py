"""End to end: a real vLLM prefill engine and decode engine exchange KV through two kvbrokerd daemons.

Every generation is compared with a single engine's (the baseline): the decode engine must give exactly the tokens
the baseline gives, over shm and over tcp, for prompts that fill their last block partly or exactly; when its KV is
corrupted it must not (so it really used the pulled KV); and when the transfer fails (unreachable peer, stalled or
stopped daemon, incompatible layouts, abort) it must still give the baseline's tokens by recomputing.

Runs in its own venv (tests/vllm/run.sh); the main suite skips it when vLLM is not installed.
"""

from __future__ import annotations

import os
import re
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
from kvbroker.shm import Cache
from tests.helpers import wait_until
from tests.vllm.engines import Engine, EngineSpec
from tests.vllm.tiny_model import BLOCK_SIZE, NUM_LAYERS, PAGE_BYTES, VOCAB_SIZE, build

pytestmark = pytest.mark.timeout(900)

DECODE_TOKENS = 12
# A partial single block, exactly two blocks, two blocks and a bit, several blocks with a partial last one.
LENGTHS = (17, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 5, 6 * BLOCK_SIZE + 9)
RELEASE_TIMEOUT_S = 10.0  # the tests that expect a notification wait at most 5 s, so a timeout cannot pass for one
PULL_TIMEOUT_S = 4.0
LEASE_TTL_S = 6.0  # the engine renews every third of it; a 2 s lease lapsed on a loaded 2-core machine
# The decode engine's KV cache holds 28 blocks: room for every test's requests, yet three 250-token requests that grow
# by 40 tokens each must preempt one another.
DECODE_KV_BLOCKS = 28


class Prompts:
    """Fresh random prompts for each use, so that no engine serves one from its prefix cache."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng(7)
        self._n = 0

    def make(self, lengths: tuple[int, ...] = LENGTHS) -> dict[str, list[int]]:
        out = {}
        for length in lengths:
            self._n += 1
            out[f"r{self._n}-len{length}"] = [int(t) for t in self._rng.integers(1, VOCAB_SIZE, size=length)]
        return out


class PD:
    """A prefill engine, a decode engine, their daemons, and the shared baseline engine."""

    def __init__(self, backend: str, p_daemon: LocalDaemon, d_daemon: LocalDaemon, prefill: Engine, decode: Engine,
                 baseline: Engine, prompts: Prompts) -> None:
        self.backend = backend
        self.p_daemon, self.d_daemon = p_daemon, d_daemon
        self.prefill, self.decode, self.baseline = prefill, decode, baseline
        self.prompts = prompts
        self.last_decode_params: dict[str, dict[str, Any] | None] = {}

    def expected(self, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        out = self.baseline.call("generate", [(k, v, DECODE_TOKENS, None) for k, v in prompts.items()])
        return {k: v["tokens"] for k, v in out.items()}

    def run_prefill(self, prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
        out = self.prefill.call("generate", [(k, v, 1, {"do_remote_decode": True}) for k, v in prompts.items()])
        params = {k: v["kv_transfer_params"] for k, v in out.items()}
        assert all(p and p["do_remote_prefill"] for p in params.values()), params
        return params

    def run_decode(self, prompts: dict[str, list[int]], params: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
        out = self.decode.call("generate", [(k, v, DECODE_TOKENS, params[k]) for k, v in prompts.items()])
        self.last_decode_params = {k: v["kv_transfer_params"] for k, v in out.items()}
        return {k: v["tokens"] for k, v in out.items()}

    def prefill_cache(self) -> Cache:
        """The prefill engine's KV cache, mapped from its daemon's shared memory (test-only access)."""
        cache_id = self.prefill.call("connector")["cache_id"]
        with self.p_daemon.client() as c:
            record = next(r for r in c.list_caches() if r.cache_id == cache_id)
        return Cache.map(record)

    def wait_released(self, timeout_s: float = 5.0) -> None:
        """Steps the prefill engine until it holds no finished request's blocks."""
        def released() -> bool:
            if not self.prefill.call("num_requests"):
                return True
            self.prefill.call("step_for", 0.2)
            return False

        wait_until(released, timeout=timeout_s, poll=0, what="the prefill engine holding no finished request's blocks")

    def settled_free_blocks(self) -> int:
        """Free blocks of the prefill engine once earlier tests' holds are gone (some end only at the timeout)."""
        self.wait_released(timeout_s=RELEASE_TIMEOUT_S + 5.0)
        return int(self.prefill.call("free_blocks"))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="session")
def model(workdir: Path) -> str:
    return str(build(workdir / "tiny-llama"))


@pytest.fixture(scope="session")
def prompts() -> Prompts:
    return Prompts()


@pytest.fixture(scope="session")
def baseline(model: str, workdir: Path) -> Iterator[Engine]:
    engine = Engine("baseline", EngineSpec(model, log_path=str(workdir / "baseline.log"))).start()
    try:
        yield engine.wait_ready()
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["shm", "tcp"])
def pd(request: pytest.FixtureRequest, model: str, workdir: Path, baseline: Engine, prompts: Prompts
       ) -> Iterator[PD]:
    backend = request.param
    first = 10 if backend == "shm" else 20
    root = workdir / backend
    p_daemon = LocalDaemon(root, first, backends=(backend,)).start()
    d_daemon = LocalDaemon(root, first + 1, backends=(backend,)).start()
    instances = []
    for daemon in (p_daemon, d_daemon):
        with daemon.client() as c:
            instances.append(c.get_cluster_info().instance_epoch)
    prefill = Engine(f"prefill-{backend}", EngineSpec(
        model, p_daemon.target, {"kvbroker_hold_lease_s": RELEASE_TIMEOUT_S},
        log_path=str(root / "prefill.log"))).start()
    decode = Engine(f"decode-{backend}", EngineSpec(
        model, d_daemon.target, {"kvbroker_pull_timeout_s": PULL_TIMEOUT_S, "kvbroker_lease_ttl_s": LEASE_TTL_S,
                                 "kvbroker_prefill_daemons": f"{p_daemon.cluster_id}={p_daemon.peer_address}"},
        kv_cache_bytes=DECODE_KV_BLOCKS * NUM_LAYERS * PAGE_BYTES, log_path=str(root / "decode.log"))).start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield PD(backend, p_daemon, d_daemon, prefill, decode, baseline, prompts)
    finally:
        for engine in (prefill, decode):
            engine.close()
        for daemon in (p_daemon, d_daemon):
            daemon.signal(signal.SIGCONT)
            assert daemon.stop() == 0, daemon.log_tail()
        # Segments are named after their daemon's instance: none of these daemons' may outlive them.
        leaked = [p.name for p in Path("/dev/shm").iterdir() if any(i in p.name for i in instances)]
        assert all(instances) and not leaked, leaked


def test_decode_gives_the_single_engine_tokens(pd: PD) -> None:
    prompts = pd.prompts.make()
    expected = pd.expected(prompts)
    params = pd.run_prefill(prompts)
    for key, prompt in prompts.items():
        assert params[key]["remote_block_ids"] and len(params[key]["remote_block_ids"]) == -(-len(prompt) // BLOCK_SIZE)
    assert pd.run_decode(prompts, params) == expected
    page_bytes = pd.decode.call("connector")["page_bytes"]
    for key in prompts:  # per-request transfer metrics come back in the decode output
        report = pd.last_decode_params[key]
        assert report is not None and report["kvbroker_backend"] == pd.backend, report
        assert report["kvbroker_transfer_bytes"] == len(params[key]["remote_block_ids"]) * page_bytes * NUM_LAYERS
        assert report["kvbroker_transfer_ms"] > 0
    log = Path(pd.decode.spec.log_path).read_text()
    assert log.count(f"over {pd.backend} (") >= len(prompts), "the pulls did not run over the daemons' backend"
    assert log.count("kvbroker connector: linked to cluster") == 1, "the decode node linked more than once"


def test_corrupted_prefill_kv_changes_the_tokens(pd: PD) -> None:
    """Negative control: the decode engine's tokens come from the pulled KV, not from a local recomputation."""
    prompts = pd.prompts.make((3 * BLOCK_SIZE + 7,))
    expected = pd.expected(prompts)
    params = pd.run_prefill(prompts)
    cache = pd.prefill_cache()
    try:
        num_blocks = pd.prefill.call("connector")["num_blocks"]
        pages = [layer.reshape(num_blocks, -1) for layer in cache.tensors]  # the daemon addresses finer units
        noise = np.random.default_rng(0).standard_normal(pages[0][0].shape).astype(cache.tensors[0].dtype)
        for p in params.values():
            for layer in pages:
                for block in p["remote_block_ids"]:
                    layer[block] = noise * 4
    finally:
        cache.close()
    got = pd.run_decode(prompts, params)
    assert got != expected


def test_prefill_keeps_blocks_until_decode_releases_them(pd: PD) -> None:
    free_before = pd.settled_free_blocks()
    prompts = pd.prompts.make((5 * BLOCK_SIZE + 1,))
    params = pd.run_prefill(prompts)
    held = -(-(5 * BLOCK_SIZE + 1) // BLOCK_SIZE)
    pd.prefill.call("step_for", 1.0)
    assert pd.prefill.call("free_blocks") == free_before - held, "blocks were freed before the decode node read them"
    assert pd.run_decode(prompts, params) == pd.expected(prompts)
    pd.wait_released()
    assert pd.prefill.call("free_blocks") == free_before


def test_prefill_frees_blocks_no_decode_node_asks_for_after_the_timeout(pd: PD) -> None:
    free_before = pd.settled_free_blocks()
    pd.run_prefill(pd.prompts.make((BLOCK_SIZE + 3,)))
    assert pd.prefill.call("free_blocks") < free_before
    pd.prefill.call("step_for", RELEASE_TIMEOUT_S - 3.0)
    assert pd.prefill.call("free_blocks") < free_before
    pd.wait_released(timeout_s=10.0)
    assert pd.prefill.call("free_blocks") == free_before
    assert "its grant ended (lapsed)" in Path(pd.prefill.spec.log_path).read_text()


def test_preempted_decode_requests_recompute_to_the_same_tokens(pd: PD) -> None:
    prompts = pd.prompts.make((250, 251, 252))  # 8 blocks each to start with, 10 once 40 tokens are added
    expected = {k: v["tokens"] for k, v in pd.baseline.call(
        "generate", [(k, v, 40, None) for k, v in prompts.items()]).items()}
    params = pd.run_prefill(prompts)
    before = pd.decode.call("preemptions")
    out = pd.decode.call("generate", [(k, v, 40, params[k]) for k, v in prompts.items()])
    assert pd.decode.call("preemptions") > before, "no request was preempted: the test proves nothing"
    assert {k: v["tokens"] for k, v in out.items()} == expected


def test_decode_keeps_serving_while_a_pull_is_stalled(pd: PD) -> None:
    remote, local = pd.prompts.make((4 * BLOCK_SIZE + 2,)), pd.prompts.make((40,))
    expected = pd.expected({**remote, **local})
    params = pd.run_prefill(remote)
    (key,) = remote
    pd.d_daemon.signal(signal.SIGSTOP)  # the pull cannot make progress until SIGCONT
    try:
        pd.decode.call("submit", [(key, remote[key], DECODE_TOKENS, params[key])])
        (lkey,) = local
        got_local = pd.decode.call("generate", [(lkey, local[lkey], DECODE_TOKENS, None)])
        assert got_local[lkey]["tokens"] == expected[lkey]
        assert not pd.decode.call("finished", key)
    finally:
        pd.d_daemon.signal(signal.SIGCONT)
    assert pd.decode.call("run", [key], 60.0)[key]["tokens"] == expected[key]


def test_unreachable_prefill_daemon_means_recompute_not_wrong_tokens(pd: PD) -> None:
    prompts = pd.prompts.make((2 * BLOCK_SIZE + 11,))
    params = pd.run_prefill(prompts)
    bogus = {k: {**p, "kvbroker_cluster_id": 999} for k, p in params.items()}  # not a trusted prefill daemon
    assert pd.run_decode(prompts, bogus) == pd.expected(prompts)


def test_pull_with_a_forged_grant_is_refused(pd: PD) -> None:
    prompts = pd.prompts.make((BLOCK_SIZE + 9,))
    params = pd.run_prefill(prompts)
    forged = {k: {**p, "kvbroker_grant": p["kvbroker_grant"][:33] + "0" * 64} for k, p in params.items()}
    assert pd.run_decode(prompts, forged) == pd.expected(prompts)
    assert "grant unknown, lapsed or released" in Path(pd.decode.spec.log_path).read_text()


def test_incompatible_layout_is_refused_and_recomputed(pd: PD) -> None:
    pd.settled_free_blocks()
    prompts = pd.prompts.make((3 * BLOCK_SIZE,))
    params = pd.run_prefill(prompts)
    tampered = {k: {**p, "kvbroker_layout_tag": p["kvbroker_layout_tag"].replace("dtype=float32", "dtype=bfloat16")}
                for k, p in params.items()}
    assert pd.run_decode(prompts, tampered) == pd.expected(prompts)
    assert "dtype: local float32 vs remote bfloat16" in Path(pd.decode.spec.log_path).read_text()
    pd.wait_released()  # refused, yet the prefill node is told to free its blocks (long before its timeout)


def test_abort_during_a_pull_frees_both_sides(pd: PD) -> None:
    pd.settled_free_blocks()
    d_free = pd.decode.call("free_blocks")
    prompts = pd.prompts.make((3 * BLOCK_SIZE + 1,))
    params = pd.run_prefill(prompts)
    (key,) = prompts
    pd.d_daemon.signal(signal.SIGSTOP)
    try:
        pd.decode.call("submit", [(key, prompts[key], DECODE_TOKENS, params[key])])
        pd.decode.call("step_for", 0.5)
        pd.decode.call("abort", [key])
        pd.decode.call("step_for", 0.3)
    finally:
        pd.d_daemon.signal(signal.SIGCONT)
    def freed() -> bool:
        if pd.decode.call("free_blocks") >= d_free:
            return True
        pd.decode.call("step_for", 0.2)
        return False

    wait_until(freed, timeout=15, poll=0, what="the decode engine freeing the aborted request's blocks")
    pd.wait_released()


def test_stopped_prefill_daemon_times_out_and_recomputes_then_pulls_resume(pd: PD) -> None:
    prompts = pd.prompts.make((2 * BLOCK_SIZE + 3,))
    expected = pd.expected(prompts)
    params = pd.run_prefill(prompts)
    pd.p_daemon.signal(signal.SIGSTOP)
    try:
        got = pd.run_decode(prompts, params)
    finally:
        pd.p_daemon.signal(signal.SIGCONT)
    assert got == expected
    # Once the prefill node's daemon answers again, its KV is pulled again (the link recovered or was made anew).
    def pulled_again() -> bool:
        prompts = pd.prompts.make((BLOCK_SIZE + 1,))
        assert pd.run_decode(prompts, pd.run_prefill(prompts)) == pd.expected(prompts)
        (report,) = pd.last_decode_params.values()
        return report is not None and "kvbroker_transfer_ms" in report

    wait_until(pulled_again, timeout=30, poll=1.0, what="pulls resumed after the prefill daemon came back")


def test_decode_renews_the_grant_of_a_request_that_waits_longer_than_its_lease(pd: PD, model: str) -> None:
    """A prefill engine whose grants lapse 2 s after the last renewal: the decode engine holds a request for longer
    than that before it schedules it (its grant renewed meanwhile) and still pulls its KV; a request no decode engine
    holds (the control) lapses meanwhile, which shows that the wait really outlasted the lease."""
    if pd.backend != "shm":
        pytest.skip("grant renewals do not depend on the data backend: once is enough")
    root = Path(pd.prefill.spec.log_path).parent
    prefill = Engine(f"prefill-short-lease-{pd.backend}", EngineSpec(
        model, pd.p_daemon.target, {"kvbroker_hold_lease_s": 2.0}, log_path=str(root / "prefill-short.log"))).start()
    try:
        prefill.wait_ready()
        prompts = pd.prompts.make((2 * BLOCK_SIZE + 5, BLOCK_SIZE + 2))
        expected = pd.expected(prompts)
        out = prefill.call("generate", [(k, v, 1, {"do_remote_decode": True}) for k, v in prompts.items()])
        kept, control = prompts
        params = out[kept]["kv_transfer_params"]
        pd.decode.call("submit", [(kept, prompts[kept], DECODE_TOKENS, params)])  # arrives; is not scheduled yet

        def control_lapsed() -> bool:
            if prefill.call("num_requests") == 1:  # only the kept request's blocks are still held
                return True
            prefill.call("step_for", 0.2)
            return False

        wait_until(control_lapsed, timeout=30, poll=0, what="the control request's grant lapsing")
        # vLLM adds a suffix of its own to request ids.
        assert re.search(rf"request {control}\S*: its grant ended \(lapsed\)", Path(prefill.spec.log_path).read_text())
        got = pd.decode.call("run", [kept], 60.0)[kept]
        assert got["tokens"] == expected[kept]
        report = got["kv_transfer_params"]
        assert report is not None and report["kvbroker_transfer_ms"] > 0, report  # pulled, not recomputed
        assert report["kvbroker_transfer_bytes"] == len(params["remote_block_ids"]) * PAGE_BYTES * NUM_LAYERS

        def kept_released() -> bool:
            if not prefill.call("num_requests"):
                return True
            prefill.call("step_for", 0.2)
            return False

        wait_until(kept_released, timeout=15, poll=0, what="the kept request's grant released after its pull")
        assert not re.search(rf"request {kept}\S*: its grant ended", Path(prefill.spec.log_path).read_text())
    finally:
        prefill.close()


def test_engines_give_their_kv_memory_back_on_exit_and_on_death(pd: PD) -> None:
    """Runs last in the module: closes the prefill engine and SIGKILLs the decode engine."""
    with pd.p_daemon.client() as p, pd.d_daemon.client() as d:
        # Each engine's KV cache and its token view (the same memory in 16-token blocks, for block-size remaps).
        assert len(p.list_caches()) == 2 and len(d.list_caches()) == 2
        pd.prefill.close()
        assert p.list_caches() == []
        pd.decode.kill()
        wait_until(lambda: not d.list_caches(), timeout=LEASE_TTL_S + 10, poll=0.2,
                   what="the dead engine's KV memory freed")
