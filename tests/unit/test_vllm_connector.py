"""The vLLM connector's vLLM-free parts (settings, request protocol, layout, scheduler decisions, worker
bookkeeping), checked without vLLM installed; the end-to-end test with a real vLLM is tests/vllm."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.grants import GrantKeeper
from kvbroker.integrations.vllm.layout import (
    KvLayout,
    UnsupportedLayoutError,
    explain_mismatch,
    layout_from_vllm,
    model_identity,
)
from kvbroker.integrations.vllm.params import (
    BadTransferParams,
    WorkerEndpoint,
    parse_release,
    parse_remote,
    prefill_output_params,
)
from kvbroker.integrations.vllm.scheduler import RELEASE_DELAY_S, SchedulerSide
from kvbroker.status import LlmStatus
from kvbroker.types import Grant
from kvbroker.v1 import broker_pb2
from tests.helpers import wait_until

BS = 32


def test_importing_kvbroker_or_the_integration_package_never_imports_vllm() -> None:
    code = ("import sys, kvbroker, kvbroker.integrations, kvbroker.integrations.vllm\n"
            "import kvbroker.integrations.vllm.config, kvbroker.integrations.vllm.params\n"
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- settings ----------------------------------------------------------------------------------------------------
def test_config_defaults_and_coercion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBROKER_TARGET", raising=False)
    assert ConnectorConfig.from_extra_config(None).target == "unix:///run/kvbroker/kvbroker.sock"
    cfg = ConnectorConfig.from_extra_config({"kvbroker_target": "unix:///x.sock", "kvbroker_pull_timeout_s": "2.5",
                                             "kvbroker_max_concurrent_pulls": 8, "kvbroker_log_transfers": "true",
                                             "other_connector_key": 1})
    assert (cfg.target, cfg.pull_timeout_s, cfg.max_concurrent_pulls, cfg.log_transfers) == (
        "unix:///x.sock", 2.5, 8, True)
    monkeypatch.setenv("KVBROKER_TARGET", "unix:///env.sock")
    assert ConnectorConfig.from_extra_config({}).target == "unix:///env.sock"


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvbroker_pull_timeout": 3}, "unknown key 'kvbroker_pull_timeout'"),
    ({"kvbroker_pull_timeout_s": 0}, "kvbroker_pull_timeout_s must be > 0"),
    ({"kvbroker_pull_timeout_s": "fast"}, "kvbroker_pull_timeout_s must be a float"),
    ({"kvbroker_max_concurrent_pulls": 1.5}, "kvbroker_max_concurrent_pulls must be a int"),
    ({"kvbroker_max_concurrent_pulls": 0}, r"kvbroker_max_concurrent_pulls must be in \[1, 256\]"),
    ({"kvbroker_log_transfers": "maybe"}, "kvbroker_log_transfers must be a bool"),
    ({"kvbroker_lease_ttl_s": 0.5}, "kvbroker_lease_ttl_s must be >= 1"),
    ({"kvbroker_idle_wait_s": 2}, r"kvbroker_idle_wait_s must be in \[0, 1\]"),
    ({"kvbroker_model_id": "llama 3"}, "kvbroker_model_id must be at most 64 printable characters"),
    ({"kvbroker_hold_lease_s": 0.01}, r"kvbroker_hold_lease_s must be in \[0.1, 3600\]"),
    ({"kvbroker_hold_lease_s": 60, "kvbroker_release_timeout_s": 30}, "at most kvbroker_release_timeout_s"),
])
def test_config_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra_config(extra)


# -- request protocol --------------------------------------------------------------------------------------------
TAG_A = KvLayout(3, 100, BS, 1, 64, "float32", 16384, "m1", 1).tag()
TAG_B = KvLayout(3, 100, BS, 1, 64, "bfloat16", 8192, "m1", 1).tag()
ENDPOINTS = {0: WorkerEndpoint(rank=0, cluster_id=7, peer_address="10.0.0.7:7100", cache_id=42, layout_tag=TAG_A),
             1: WorkerEndpoint(rank=1, cluster_id=7, peer_address="10.0.0.7:7100", cache_id=43, layout_tag=TAG_A)}


GRANT = Grant(bytes(range(16)), bytes(range(32)))


def test_prefill_params_round_trip_with_nixl_key_names() -> None:
    params = prefill_output_params(ENDPOINTS, "engine-p", "req-1", [[3, 4, 5]], 70, GRANT)
    for key in ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                "remote_request_id", "remote_host", "remote_port", "remote_num_tokens", "tp_size"):
        assert key in params
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("10.0.0.7", 7100, 2)
    remote = parse_remote(params)
    assert (remote.cluster_id, remote.grant, remote.tp_size, remote.request_id, remote.num_tokens) == (
        7, GRANT, 2, "req-1", 70)
    assert "kvbroker_peer_address" not in params and "kvbroker_cache_ids" not in params  # nothing to dial or name


@pytest.mark.parametrize(("change", "message"), [
    ({"kvbroker_protocol": None}, "protocol"),
    ({"kvbroker_cluster_id": None}, "malformed"),
    ({"kvbroker_cluster_id": True}, "malformed"),
    ({"remote_block_ids": [1, -2]}, "non-negative"),
    ({"remote_block_ids": [1] * 65537}, "at most 65536"),
    ({"kvbroker_grant": "ab.cd"}, "malformed"),
    ({"kvbroker_grant": 5}, "malformed"),
    ({"tp_size": 0}, "no prefill rank"),
    ({"remote_engine_id": "e" * 200}, "too long"),
    ({"kvbroker_layout_tag": "vllm-kv/7 " + "x=1 " * 5000}, "at most 16384"),  # before any hook parses it
])
def test_unusable_params_are_refused(change: dict[str, Any], message: str) -> None:
    params = {**prefill_output_params(ENDPOINTS, "engine-p", "req-1", [[3]], 10, GRANT), **change}
    with pytest.raises(BadTransferParams, match=message):
        parse_remote(params)
    del params["remote_request_id"]
    with pytest.raises(BadTransferParams):
        parse_remote(params)


def test_grant_events_parse() -> None:
    event = broker_pb2.GrantEvent(grant_id=GRANT.grant_id, label="req-9", outcome="released")
    assert parse_release(event.SerializeToString()) == ("req-9", "released")
    for junk in (b"[1]", b"", b"\xff\xff"):
        with pytest.raises(ValueError):
            parse_release(junk)


@pytest.mark.parametrize("spec", ["7=unix:///tmp/x.sock:1", "7=unix:abstract:1", "x=1.2.3.4:5", "7=host", "7=h:p",
                                  "7=[::1:5", "7=::1:5", "7 = a b:5"])
def test_trusted_prefill_daemons_are_host_port_only(spec: str) -> None:
    with pytest.raises(ValueError, match="kvbroker_prefill_daemons entry"):
        ConnectorConfig.from_extra_config({"kvbroker_prefill_daemons": spec})


def test_trusted_prefill_daemons_parse() -> None:
    cfg = ConnectorConfig.from_extra_config({"kvbroker_prefill_daemons": "7=10.0.0.7:7100, 8=[fd00::8]:7100,"})
    assert cfg.trusted_prefill() == {7: "10.0.0.7:7100", 8: "[fd00::8]:7100"}


# -- layout ------------------------------------------------------------------------------------------------------
def _kv_config(num_blocks: int = 100, page: int = 16384, layers: int = 3, layer_stride: int | None = None,
               block_stride: int | None = None, groups: int = 1) -> Any:
    spec = SimpleNamespace(block_size=BS, num_kv_heads=1, head_size=64, dtype="torch.float32", page_size_bytes=page)
    layer_stride = page * num_blocks if layer_stride is None else layer_stride
    tensor = SimpleNamespace(size=layer_stride * layers, layers=[f"l{i}" for i in range(layers)],
                             layer_stride=layer_stride, block_stride=page if block_stride is None else block_stride,
                             offset=0)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * groups,
                           kv_cache_tensors=[tensor], num_blocks=num_blocks,
                           num_blocks_of=lambda t: num_blocks)


def test_layer_outermost_buffer_is_one_cache_with_a_tensor_per_layer() -> None:
    layout = layout_from_vllm(_kv_config(), "m1", tp_size=1)
    desc = layout.desc()
    # Addressed in units of one head's K and V of one block (1 head per block here).
    assert (desc.num_tensors, desc.shape, desc.data_type.name) == (3, (100, 4096), "FLOAT32")
    fine = layout_from_vllm(_kv_config(), "m1", tp_size=1, token_units=True).desc()
    assert fine.shape == (100 * 256, 16) and "units=token16" in fine.layout_tag  # 16 elements: 16 tokens of K's dims
    assert desc.tensor_nbytes * desc.num_tensors == layout.buffer_bytes
    assert "model=m1" in layout.tag() and "layers=3" in layout.tag() and (
        "memory=cpu-vec:block.head.K[dim.token].V[token.dim]" in layout.tag())
    # The daemon checks only what gives a unit its meaning: TP, block size and heads per rank are the plan's.
    assert desc.layout_tag == layout.daemon_tag() and "model=m1" in desc.layout_tag
    assert "tp=" not in desc.layout_tag and "block=" not in desc.layout_tag


@pytest.mark.parametrize(("config", "message"), [
    (_kv_config(groups=2), "1 KV tensor placements for 2 cache groups"),
    (_kv_config(layer_stride=16384, block_stride=3 * 16384), "not layer-outermost"),
    (_kv_config(num_blocks=3, page=1000), "multiple of 4096"),
])
def test_layouts_not_served_without_a_copy_are_refused(config: Any, message: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=message):
        layout_from_vllm(config, "m1", tp_size=1)


def test_mismatch_names_the_fields() -> None:
    a = KvLayout(3, 100, 32, 1, 64, "float32", 16384, "m1", 1).tag()
    b = KvLayout(3, 500, 32, 2, 64, "bfloat16", 16384, "m1", 1).tag()
    assert explain_mismatch(a, a) == ""
    assert explain_mismatch(a, b) == ("dtype: local float32 vs remote bfloat16; kv_heads: local 1 vs remote 2; "
                                      "total_kv_heads: local 1 vs remote 2")


def test_model_identity_ignores_where_the_model_was_loaded_from() -> None:
    @dataclass
    class Cfg:
        hidden: int
        _name_or_path: str = ""

        def to_dict(self) -> dict[str, Any]:
            return {"hidden_size": self.hidden, "_name_or_path": self._name_or_path}

    assert model_identity(Cfg(64, "/a")) == model_identity(Cfg(64, "/b")) != model_identity(Cfg(128, "/a"))


# -- scheduler decisions -----------------------------------------------------------------------------------------
@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


NO_DAEMON = "unix:///nonexistent/kvbroker.sock"


def _decode_side(trusted: str = "1=127.0.0.1:1") -> SchedulerSide:
    side = SchedulerSide(ConnectorConfig(target=NO_DAEMON, prefill_daemons=trusted), "engine-d", BS)
    side.set_endpoints({0: WorkerEndpoint(0, 2, "127.0.0.1:2", 9, TAG_A)})
    side.grants._stop = True  # no thread: the test reads what it would renew and release
    return side


def _releases(side: SchedulerSide) -> list[str]:
    return [r.reason for r in side.grants._releases]


def _remote_params(blocks: list[int], num_tokens: int, tag: str = TAG_A) -> dict[str, Any]:
    endpoints = {0: WorkerEndpoint(0, 1, "127.0.0.1:1", 5, tag)}
    return prefill_output_params(endpoints, "engine-p", "p-req", [blocks], num_tokens, GRANT)


def test_prefill_side_grants_the_blocks_before_returning_params(tmp_path: Any) -> None:
    from kvbroker import CacheDesc
    from kvbroker._local import LocalDaemon

    with LocalDaemon(tmp_path, 1) as daemon, daemon.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(8, 4)))
        side = SchedulerSide(ConnectorConfig(target=daemon.target, hold_lease_s=60), "engine-p", BS)
        side.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", cache.cache_id, TAG_A)})
        req = FakeRequest("p-req", 70, {"do_remote_decode": True}, num_computed_tokens=70)
        delay, params = side.request_finished(req, [1, 2, 3, 4], finished_normally=True)
        assert delay and params is not None
        assert params["remote_block_ids"] == [1, 2, 3] and params["remote_num_tokens"] == 70
        assert list(side.take_plan().holds) == ["p-req"]
        grant = Grant.from_token(params["kvbroker_grant"])
        assert 50 < c.renew_grant(grant) <= 60  # the grant exists already: a renewal can never come before it
        aborted = FakeRequest("p-2", 70, {"do_remote_decode": True}, num_computed_tokens=10)
        assert side.request_finished(aborted, [7], finished_normally=False) == (False, None)
        assert not side.take_plan().holds
        # A daemon that refuses the grant means no hold (the decode node computes the KV), never a hold for nobody.
        too_far = FakeRequest("p-3", 700, {"do_remote_decode": True}, num_computed_tokens=700)
        assert side.request_finished(too_far, list(range(22)), finished_normally=True) == (False, None)
        assert not side.take_plan().holds
        c.release_grant(grant)
        assert [parse_release(n.payload) for n in c.fetch_notifications("kvbroker.vllm/engine-p/0/release")] == [
            ("p-req", "released")]
        side.shutdown()


def test_dynamo_nixl_protocol_params_work_unchanged(tmp_path: Any) -> None:
    """docs/deploy.md says Dynamo needs only `"KvBrokerConnector": NixlConnectorProtocol` in its connector table:
    that protocol's prefill params (NIXL's keys, the remote ones None) make the prefill engine compute and hold the
    blocks (granted by its daemon), and the prefill answer's params, passed on unchanged, make the decode engine pull
    them."""
    from kvbroker import CacheDesc
    from kvbroker._local import LocalDaemon

    dynamo_prefill = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
    with LocalDaemon(tmp_path, 1) as daemon, daemon.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(8, 4)))
        prefill = SchedulerSide(ConnectorConfig(target=daemon.target, release_timeout_s=60), "engine-p", BS)
        prefill.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", cache.cache_id, TAG_A)})
        req = FakeRequest("p-req", 64, dict(dynamo_prefill), num_computed_tokens=64)
        assert prefill.num_new_matched_tokens(req, 0) == (0, False)  # nothing to pull: it computes the prompt
        delay, params = prefill.request_finished(req, [1, 2], finished_normally=True)
        assert delay and params is not None and list(prefill.take_plan().holds) == ["p-req"]
        decode = _decode_side()
        dreq = FakeRequest("d-req", 64, params)
        assert decode.num_new_matched_tokens(dreq, 0) == (64, True)
        prefill.shutdown()


def test_decode_side_pulls_the_blocks_the_local_prefix_cache_lacks() -> None:
    side = _decode_side()
    req = FakeRequest("d-req", 100, _remote_params([10, 11, 12, 13], 100))
    side.on_new_request(req)
    assert list(side.grants._held) == ["d-req"]  # renewed from its arrival
    assert side.num_new_matched_tokens(req, 32) == (68, True)
    side.after_alloc(req, all_blocks=[50, 51, 52, 53], new_blocks=[51, 52, 53], num_external_tokens=68)
    (pull,) = side.take_plan().pulls
    assert (pull.local_blocks, pull.remote_blocks, pull.first_block) == ((51, 52, 53), (11, 12, 13), 1)
    assert pull.refused == ""
    assert (pull.start_token, pull.end_token) == (32, 100)
    assert list(side.grants._held) == ["d-req"]  # until the pull ended
    side.on_pulls_ended({"d-req"})
    assert not side.grants._held and _releases(side) == ["pulled"]
    assert req.kv_transfer_params is not None and not req.kv_transfer_params["do_remote_prefill"]
    assert side.num_new_matched_tokens(req, 0) == (0, False)  # one transfer per request


def test_a_pulled_requests_grant_is_released_once_the_step_computing_its_token_is_over() -> None:
    """The release (a call through both daemons) must not share the CPU with the step that computes the request's
    first token: it waits for that step's output, or RELEASE_DELAY_S on an engine that stops stepping."""
    side = _decode_side()
    req = FakeRequest("d-req", 64, _remote_params([10, 11], 64))
    side.on_new_request(req)
    assert side.num_new_matched_tokens(req, 0) == (64, True)
    side.after_alloc(req, all_blocks=[50, 51], new_blocks=[50, 51], num_external_tokens=64)
    side.take_plan()  # the step that starts the pull
    side.on_step_output()
    side.on_pulls_ended({"d-req"})  # at that (or a later) step's output
    assert not side.grants._held  # no more renewals
    (release,) = side.grants._releases
    assert release.reason == "pulled" and release.due >= time.monotonic() + RELEASE_DELAY_S / 2
    side.take_plan()  # the step that computes its token
    assert release.due > 0
    side.on_step_output()  # its output: the token step is over
    assert release.due == 0


class _FakeLinks:
    def __init__(self) -> None:
        self.released: list[bytes] = []
        self.timeout_s = 1.0
        self.client = SimpleNamespace(release_grant=lambda grant, **_: self.released.append(grant.grant_id))

    def ensure(self, cluster_id: int) -> None:
        return

    def forget(self, cluster_id: int) -> None:
        return


def test_grant_keeper_sends_a_delayed_release_when_hurried_when_due_or_when_stopped() -> None:
    links = _FakeLinks()
    keeper = GrantKeeper(links)  # type: ignore[arg-type]
    keeper.release("hurried", "pulled", 1, Grant(b"h", b"s"), delay=3600.0)
    keeper.release("due", "pulled", 1, Grant(b"d", b"s"), delay=0.05)
    keeper.release("stopped", "pulled", 1, Grant(b"x", b"s"), delay=3600.0)
    keeper.hurry({"hurried"})
    wait_until(lambda: set(links.released) == {b"h", b"d"}, what="the hurried and the due release")
    assert links.released.count(b"h") == 1 and [r.request_id for r in keeper._releases] == ["stopped"]
    keeper.stop()
    assert sorted(links.released) == [b"d", b"h", b"x"]


def test_decode_side_refuses_incompatible_kv_but_frees_the_prefill_blocks() -> None:
    side = _decode_side()
    req = FakeRequest("d-req", 40, _remote_params([3, 4], 40, tag=TAG_B))
    assert side.num_new_matched_tokens(req, 0) == (0, False)
    side.after_alloc(req, all_blocks=[8, 9], new_blocks=[8, 9], num_external_tokens=0)
    plan = side.take_plan()
    assert not plan.pulls and _releases(side) == ["incompatible"]
    # The output says so, with the field, and the refusal is counted by field and as a recompute.
    assert side.request_finished(req, [8, 9], finished_normally=True) == (False, {
        "kvbroker_prompt_tokens": 40, "kvbroker_tokens_pulled": 0, "kvbroker_tokens_cached": 0,
        "kvbroker_tokens_recomputed": 40, "kvbroker_refused": "dtype: local float32 vs remote bfloat16"})
    counted = side.stats.take()
    assert counted is not None and counted["recomputes"] == {"layout": 1}  # vLLM's connector stats, /metrics
    assert counted["refused"] == {"dtype": 1} and side.stats.take() is None


def test_decode_request_aborted_before_scheduling_frees_the_prefill_blocks() -> None:
    side = _decode_side()
    req = FakeRequest("d-req", 40, _remote_params([3, 4], 40))
    side.on_new_request(req)
    assert side.request_finished(req, [], finished_normally=False) == (False, None)
    assert not side.grants._held and _releases(side) == ["aborted"]


def test_decode_side_never_dials_nor_renews_with_an_untrusted_prefill_daemon() -> None:
    side = _decode_side(trusted="5=127.0.0.1:5")
    req = FakeRequest("d-req", 40, _remote_params([3, 4], 40))
    side.on_new_request(req)
    assert not side.grants._held
    assert side.num_new_matched_tokens(req, 0) == (0, False)
    side.after_alloc(req, all_blocks=[8, 9], new_blocks=[8, 9], num_external_tokens=0)
    assert not side.take_plan().pulls
    assert not side.grants._releases  # nothing is ever sent to a daemon this node does not trust
    counted = side.stats.take()
    assert counted is not None and counted["recomputes"] == {"untrusted": 1}


def test_decode_output_reports_its_pull_unless_the_request_finished_first() -> None:
    from kvbroker.integrations.vllm.stats import RequestTransfer

    side = _decode_side()
    reqs = [FakeRequest(f"d-{i}", 40, _remote_params([3, 4], 40)) for i in range(2)]
    for req in reqs:
        side.num_new_matched_tokens(req, 0)
        side.after_alloc(req, [8, 9], [8, 9], 40)
    assert side.request_finished(reqs[1], [], finished_normally=False) == (False, None)  # aborted mid-pull
    side.on_transfers({r.request_id: RequestTransfer(0.25, 4096, "tcp", 40) for r in reqs})
    side.on_transfers({reqs[0].request_id: RequestTransfer(0.125, 2048, "tcp", 40)})  # a TP rank a step later
    assert side.request_finished(reqs[0], [8, 9], finished_normally=True) == (False, {
        "kvbroker_transfer_ms": 250.0, "kvbroker_transfer_bytes": 6144, "kvbroker_backend": "tcp",
        "kvbroker_prompt_tokens": 40, "kvbroker_tokens_pulled": 40, "kvbroker_tokens_cached": 0,
        "kvbroker_tokens_recomputed": 0})
    assert not side._transfers


def test_ranks_of_one_engine_must_share_a_daemon() -> None:
    side = SchedulerSide(ConnectorConfig(), "engine-p", BS)
    with pytest.raises(ValueError, match="all ranks of an engine must share one daemon"):
        side.set_endpoints({0: WorkerEndpoint(0, 1, "10.0.0.1:7100", 5, "t"), 1: WorkerEndpoint(1, 2, "10.0.0.2:7100",
                                                                                               6, "t")})


def test_malformed_params_mean_local_compute() -> None:
    side = _decode_side()
    req = FakeRequest("d-req", 40, {"do_remote_prefill": True, "remote_block_ids": [1]})
    assert side.num_new_matched_tokens(req, 0) == (0, False)
    side.after_alloc(req, [1, 2], [1, 2], 0)
    plan = side.take_plan()
    assert not plan.pulls and not _releases(side)


# -- worker bookkeeping ------------------------------------------------------------------------------------------
LAYOUT = KvLayout(3, 100, BS, 1, 64, "float32", 16384, "m1", 1)


def _worker(**config: Any) -> Any:
    pytest.importorskip("torch", reason="the connector's worker side needs torch (vLLM's KV tensors)")
    from kvbroker.integrations.vllm.worker import WorkerSide

    # No daemon: the constructor does no I/O, and these paths do not reach one (notifications fail, and say so).
    return WorkerSide(ConnectorConfig(target=NO_DAEMON, **config), "engine", 0, LAYOUT)


def test_held_blocks_are_freed_when_their_grant_ends_and_not_before(caplog: pytest.LogCaptureFixture) -> None:
    worker = _worker()
    worker.note_release("early", "released")  # a grant's end may arrive before the hold itself
    worker.start([], {"held": 30.0, "lapsing": 30.0, "early": 30.0})
    assert worker.finished() == ({"early"}, set())
    assert worker.finished() == (set(), set())  # no timer: only the grant's end frees blocks
    worker.note_release("lapsing", "lapsed")
    assert worker.finished() == ({"lapsing"}, set())
    assert "its grant ended (lapsed)" in caplog.text
    worker.note_release("held", "released")
    assert worker.finished() == ({"held"}, set())
    counted = worker.transfers.take()  # vLLM's connector stats: vllm:kvbroker_expired_holds{outcome="lapsed"}
    assert counted is not None and counted["expired_holds"] == {"lapsed": 1}
    worker.shutdown()


def test_refused_pull_reports_every_block_with_the_request() -> None:
    from kvbroker.integrations.vllm.params import PullSpec

    worker = _worker(link_timeout_s=0.5)
    remote = parse_remote(_remote_params([1, 2], 40))
    worker.start([PullSpec("d-req", (7, 8), (1, 2), remote, refused="block counts do not line up")], {})
    done = wait_until(lambda: (got := worker.finished())[1] and got, what="the refused pull reported")
    assert done == (set(), {"d-req"})
    assert worker.take_load_errors() == {7, 8} and worker.take_load_errors() == set()
    counted = worker.transfers.take()
    assert counted is not None and (counted["recomputes"], counted["failures"]) == ({"block_mismatch": 1}, {})
    worker.shutdown()


def test_an_idle_step_waits_for_a_pull_in_flight_but_never_past_its_bound() -> None:
    from kvbroker.integrations.vllm.loads import LoadOutcome, PullItem
    from kvbroker.integrations.vllm.params import PullSpec

    worker = _worker(link_timeout_s=0.5)
    landed = threading.Event()

    def slow_loads(items: list[PullItem]) -> None:
        """The step's loads, ending only once `landed` is set (on a thread, as the pull session's do)."""
        def end() -> None:
            landed.wait(60)
            for item in items:
                worker._loaded(LoadOutcome(item.request_id, frozenset(), 0, 0.0, ""))

        if items:
            threading.Thread(target=end, daemon=True).start()

    class Step(threading.Condition):
        """The worker's "a pull ended" condition, noting each wait of a step (and ending the pull, once asked to,
        only when a step waits: then the pull ends during that step's wait, never before it)."""

        def __init__(self) -> None:
            super().__init__(worker._lock)
            self.waits: list[float | None] = []
            self.end_pull_in_wait = False

        def wait(self, timeout: float | None = None) -> bool:
            self.waits.append(timeout)
            if self.end_pull_in_wait:
                landed.set()
            return super().wait(timeout)

    worker._items = lambda spec: (worker.layout, [PullItem(spec.request_id, 1, Grant(bytes(16), bytes(32)), 0, 0,
                                                           spec.local_blocks)])
    worker.loads.submit = slow_loads
    worker._pull_ended = step = Step()
    # A step that waited out a bound it need not wait would still end (the bound is an hour): pytest-timeout would
    # catch it, not a clock here.
    assert worker.finished(3600.0) == (set(), set())  # nothing in flight: nothing to wait for
    assert step.waits == []
    remote = parse_remote(_remote_params([1, 2], 40))
    worker.start([PullSpec("d-req", (7, 8), (1, 2), remote)], {})
    assert worker.finished(0.05) == (set(), set())  # the pull outlasts the bound: the step goes on without it
    assert step.waits and not landed.is_set()  # (it did wait, up to its bound)
    step.end_pull_in_wait = True
    # Reported in the step during which it ended: woken by the pull's end, not by the (hour-long) bound.
    assert worker.finished(3600.0) == (set(), {"d-req"})
    assert worker.take_load_errors() == set()
    worker.shutdown()


def test_engine_start_fails_clearly_without_a_daemon() -> None:
    torch = pytest.importorskip("torch", reason="the connector's worker side needs torch (vLLM's KV tensors)")

    worker = _worker(pull_timeout_s=2)
    with pytest.raises(RuntimeError, match=r"through kvbrokerd at unix:///nonexistent/kvbroker.sock \(kvbroker_target\)"
                       ), worker.allocation_context():
        torch.zeros(LAYOUT.buffer_bytes, dtype=torch.int8)
    worker.shutdown()


def test_transfer_stats_sum_over_workers_and_intervals() -> None:
    from kvbroker.integrations.vllm.stats import TransferLog, merge, summarize

    log = TransferLog()
    assert log.take() is None
    log.record("a", 1_000_000, 0.010, "shm")
    log.record_outcome(ok=True)
    log.record_outcome(ok=False)
    first = log.take()
    assert first is not None and log.take() is None
    assert set(log.take_requests()) == {"a"} and log.take_requests() == {}
    other = {"num_pulls": 1, "num_failed": 0, "transfer_bytes": [3_000_000], "transfer_s": [0.030]}
    assert summarize(merge(first, other)) == {"num_pulls": 3, "num_failed": 1, "bytes_MB": 4.0, "avg_transfer_ms": 20.0,
                                              "p90_transfer_ms": 30.0, "throughput_GBps": 0.1}


# -- heterogeneous prefill/decode: the compatibility check and the plan ------------------------------------------
def _gqa(tp: int, block: int = BS, token_units: bool = False, heads: int = 2, **change: Any) -> KvLayout:
    per = max(1, heads // tp)
    fields: dict[str, Any] = {"num_layers": 3, "num_blocks": 100, "block_size": block, "num_kv_heads": per,
                              "head_size": 64, "dtype": "float32", "page_bytes": per * 2 * block * 64 * 4,
                              "model_id": "m1", "tp_size": tp, "total_kv_heads": heads, "token_units": token_units}
    return KvLayout(**{**fields, **change})


@pytest.mark.parametrize(("theirs", "field", "message"), [
    (_gqa(1, model_id="m2"), "model", "model: local m1 vs remote m2"),
    (_gqa(1, dtype="bfloat16", page_bytes=16384), "dtype", "dtype: local float32 vs remote bfloat16"),
    (_gqa(1, memory="cpu-amx:x"), "memory", "memory: local cpu-vec:block.head.K[dim.token].V[token.dim] vs remote "
                                            "cpu-amx:x"),
    (_gqa(1, head_size=128, page_bytes=65536), "head", "head: local 64 vs remote 128"),
    (_gqa(1, num_layers=4), "layers", "layers: local 3 vs remote 4"),
    (_gqa(3, heads=2), "tp", "tp: local 2 vs remote 3 (neither divides the other)"),
    (_gqa(1, block=48), "block", "block: local 32 vs remote 48 (neither divides the other)"),
    (_gqa(1, block=64), "block", "needs token units on both engines: local none, remote none"),
    (_gqa(1, token_units=True), "units", "units: local head vs remote token16"),
    (_gqa(5000, heads=2), "tp", "tp: remote 5000 is out of range"),
])
def test_what_cannot_be_mapped_is_refused_by_field(theirs: KvLayout, field: str, message: str) -> None:
    from kvbroker.integrations.vllm.remap import refusal

    got = refusal(_gqa(2), theirs.tag())
    assert got is not None and got.field == field and message in got.message, got
    assert refusal(_gqa(2), _gqa(1).tag()) is None and refusal(_gqa(2), _gqa(2).tag()) is None
    # 1 divides 3, but 3 ranks cannot hold 2 KV heads evenly: which rank holds which head is not vLLM's split
    uneven = refusal(_gqa(1), _gqa(3, heads=2).tag())
    assert uneven is not None and uneven.message == "tp: remote 3 does not split 2 KV heads evenly"


def test_the_memory_field_names_the_layout_of_the_engines_attention_isa() -> None:
    """vLLM's "amx" kernels lay a block out otherwise than "vec"/"vec16" (tests/vllm/test_cpu_layouts.py): two
    engines on those ISAs must not agree by accident (the same model, dtype and block size on a CPU with AMX and one
    without), and an ISA whose layout was not measured moves whole blocks between equal block sizes only."""
    from kvbroker.integrations.vllm.layout import MEMORY_CPU, MEMORY_CPU_AMX
    from kvbroker.integrations.vllm.remap import refusal

    tags = {isa: layout_from_vllm(_kv_config(), "m1", tp_size=1, cpu_isa=isa).tag() for isa in (
        "vec", "vec16", "amx", "neon")}
    assert f"memory={MEMORY_CPU} " in tags["vec"] and tags["vec16"] == tags["vec"]
    assert f"memory={MEMORY_CPU_AMX} " in tags["amx"] and "memory=cpu-neon:unmeasured " in tags["neon"]
    amx = refusal(layout_from_vllm(_kv_config(), "m1", tp_size=1, cpu_isa="vec"), tags["amx"])
    assert amx is not None and amx.field == "memory" and amx.message == f"memory: local {MEMORY_CPU} vs remote " \
        f"{MEMORY_CPU_AMX}"
    neon = _gqa(1, token_units=True, memory="cpu-neon:unmeasured")
    assert refusal(neon, neon.tag()) is None
    other = refusal(neon, _gqa(1, block=64, token_units=True, memory="cpu-neon:unmeasured").tag())
    assert other is not None and other.field == "block" and "cpu-neon:unmeasured layout move whole" in other.message
    for block in (32, 64):  # AMX blocks remap in tiles of 16 tokens
        remote = _gqa(1, block=block, token_units=True, memory=MEMORY_CPU_AMX, dtype="bfloat16",
                      page_bytes=2 * 2 * block * 64 * 2)
        assert refusal(_gqa(2, token_units=True, memory=MEMORY_CPU_AMX, dtype="bfloat16", page_bytes=2 * 32 * 64 * 2),
                       remote.tag()) is None


@pytest.mark.parametrize(("ours_tp", "theirs_tp", "heads", "sources"), [
    (2, 1, 2, {0: {0: [(0, 0)]}, 1: {0: [(1, 0)]}}),  # decode TP larger: each rank a slice of prefill rank 0
    (1, 2, 2, {0: {0: [(0, 0)], 1: [(0, 1)]}}),  # prefill TP larger: gathered from both ranks
    (1, 4, 2, {0: {0: [(0, 0)], 2: [(0, 1)]}}),  # prefill ranks hold replicas: each head pulled once
    (4, 2, 2, {0: {0: [(0, 0)]}, 1: {0: [(0, 0)]}, 2: {1: [(0, 0)]}, 3: {1: [(0, 0)]}}),
    (2, 4, 1, {0: {0: [(0, 0)]}, 1: {2: [(0, 0)]}}),  # MLA-like (one head everywhere): one prefill rank each
])
def test_head_sources(ours_tp: int, theirs_tp: int, heads: int, sources: dict[int, Any]) -> None:
    from kvbroker.integrations.vllm.remap import head_sources

    ours, theirs = _gqa(ours_tp, heads=heads), _gqa(theirs_tp, heads=heads)
    assert {r: head_sources(ours, r, theirs) for r in range(ours_tp)} == sources


def test_recomputes_failures_and_expired_holds_are_counted_by_bounded_reason() -> None:
    from kvbroker.integrations.vllm.stats import TransferLog, merge, reason_of, summarize

    log = TransferLog()
    log.record_recompute("layout")  # refused: never tried, not a failed pull
    log.record_recompute(reason_of(LlmStatus.LLM_KV_CACHE_NOT_EXIST), pull_failed=True)
    log.record_recompute("made up by a bug", pull_failed=True)
    first = log.take()
    assert first is not None  # reported with no pull at all (a prefill node's expired holds, a refusal)
    assert (first["recomputes"], first["failures"]) == ({"layout": 1, "hold_expired": 1, "other": 1},
                                                        {"hold_expired": 1, "other": 1})
    log.record_expired_hold("cache removed".replace(" ", "_"))
    log.record_expired_hold("anything else")
    second = log.take()
    assert second is not None and log.take() is None
    both = merge(first, merge(second, {"num_pulls": 0, "num_failed": 0, "transfer_bytes": [], "transfer_s": []}))
    assert both["expired_holds"] == {"cache_removed": 1, "other": 1}
    assert summarize(both) == {"num_pulls": 0, "num_failed": 0, "bytes_MB": 0.0, "recomputes_hold_expired": 1,
                               "recomputes_layout": 1, "recomputes_other": 1, "failures_hold_expired": 1,
                               "failures_other": 1, "expired_holds_cache_removed": 1, "expired_holds_other": 1}
    assert [reason_of(s) for s in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_NOT_YET_LINK, LlmStatus.LLM_TIMEOUT,
                                   LlmStatus.LLM_PARAM_INVALID)] == [
        "unreachable", "unreachable", "timeout", "refused_by_daemon"]


# -- issue 30, finding 4: a hold never outlives its grant, even where the grant's event is lost ----------------------
class _Clock:
    """time.monotonic() of the worker module, moved by the test."""

    def __init__(self) -> None:
        import time

        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_a_held_request_is_freed_past_its_grants_cap_even_if_no_event_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grant's event is lost (a notification flood, a bug): the blocks used to stay held until the engine
    restarted. Past the grant's cap plus the margin they are freed, and counted; not a moment before (the daemon lets
    no pull read a grant past its cap, so nothing reads them after)."""
    pytest.importorskip("torch", reason="the connector's worker side needs torch (vLLM's KV tensors)")
    from kvbroker.integrations.vllm import worker as worker_module

    clock = _Clock()
    monkeypatch.setattr(worker_module, "time", clock)
    worker = _worker(release_timeout_s=120.0, hold_lease_s=30.0)
    worker.start([], {"lost": 30.0})
    clock.now += 60.0
    worker.start([], {"later": 30.0})
    clock.now += 60.0 + worker_module.CAP_MARGIN_S - 1.0
    assert worker.finished() == (set(), set())  # "lost" is 1 s short of its cap plus the margin
    clock.now += 1.0
    assert worker.finished() == ({"lost"}, set())
    clock.now += 60.0
    assert worker.finished() == ({"later"}, set())
    counted = worker.transfers.take()
    assert counted is not None and counted["expired_holds"] == {"no_event": 2}
    worker.shutdown()


def test_a_daemon_restart_frees_every_hold_granted_before_it(caplog: pytest.LogCaptureFixture) -> None:
    """The sidecar restarts: the grants lived in its memory, so no event will ever come for them (FAILURE_MODEL said
    to restart the engine). The release poller's fetch fails, the daemon answers again with a new instance epoch,
    and every request held before is freed; a hold made after stays held until its own grant ends."""
    from kvbroker.status import LlmError

    worker = _worker()
    epochs = ["epoch-1"]
    fetches: list[str] = []

    class Daemon:
        def get_cluster_info(self) -> Any:
            return SimpleNamespace(instance_epoch=epochs[-1])

        def fetch_notifications(self, topic: str, **_: Any) -> list[Any]:
            fetches.append(topic)
            if len(fetches) == 1:
                epochs.append("epoch-2")  # the daemon dies under this fetch, and a new instance starts
                raise LlmError(LlmStatus.LLM_FAILED, "UNAVAILABLE: the daemon went away")
            worker._stop.wait(0.01)
            return []

        def close(self) -> None:
            pass

    worker.client = Daemon()
    worker._epoch = "epoch-1"  # as _serve learns it
    worker.start([], {"a": 30.0, "b": 30.0})
    poller = threading.Thread(target=worker._poll_releases, daemon=True)
    poller.start()
    freed: set[str] = set()

    def both_freed() -> bool:
        freed.update(worker.finished()[0])
        return freed == {"a", "b"}

    wait_until(both_freed, what="the stranded holds freed")
    assert "the daemon restarted (instance epoch-2, was epoch-1)" in caplog.text
    worker.start([], {"c": 30.0})
    assert worker.finished() == (set(), set())
    worker._stop.set()
    poller.join(timeout=10)
    counted = worker.transfers.take()
    assert counted is not None and counted["expired_holds"] == {"daemon_restarted": 2}
    worker.shutdown()


TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_requests_trace_goes_with_its_grant_and_its_pulls(tmp_path: Any) -> None:
    """The trace the P/D proxy puts in `kv_transfer_params` reaches both daemons: the prefill's grant is made under
    it, and the decode's pulls continue it. A malformed one is dropped, never an error."""
    from kvbroker import CacheDesc
    from kvbroker._local import LocalDaemon
    from kvbroker.integrations.vllm.loads import PullItem, _session_pull
    from kvbroker.integrations.vllm.params import trace_of
    from kvbroker.tracecontext import TraceContext

    trace = TraceContext.parse(TRACE, "k=v")
    assert trace is not None
    with LocalDaemon(tmp_path, 1) as daemon, daemon.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(8, 4)))
        side = SchedulerSide(ConnectorConfig(target=daemon.target, hold_lease_s=60), "engine-p", BS)
        side.set_endpoints({0: WorkerEndpoint(0, 1, "127.0.0.1:1", cache.cache_id, TAG_A)})
        seen: list[object] = []
        create = side.client.create_grant

        def recording(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("trace_context"))
            return create(*args, **kwargs)

        side.client.create_grant = recording
        params = {"do_remote_decode": True, "kvbroker_traceparent": TRACE, "kvbroker_tracestate": "k=v"}
        req = FakeRequest("p-req", 16, params, num_computed_tokens=16)
        _, out = side.request_finished(req, [1], finished_normally=True)
        assert out is not None and seen == [trace]
        side.shutdown()
    remote = parse_remote({**out, "kvbroker_traceparent": TRACE, "kvbroker_tracestate": "k=v"})
    assert remote.trace == trace
    item = PullItem("d-req", remote.cluster_id, remote.grant, 0, 5, (1,), trace=remote.trace)
    assert _session_pull(item).trace_context == trace
    for junk in ("00-zz", "x" * 5000, 7, None):
        assert trace_of({"kvbroker_traceparent": junk}) is None
        assert parse_remote({**out, "kvbroker_traceparent": junk}).trace is None
