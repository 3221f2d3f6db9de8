"""Multi-turn reuse below the engine: the decode side's grant on a finished turn, the next turn's prefill pulling only
the blocks whose tokens match, and the proxy's memory of turns (tests/vllm/test_multiturn_e2e.py runs it in vLLM)."""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.integrations import vllm_proxy, vllm_turns
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.layout import KvLayout
from kvbroker.integrations.vllm.params import (
    BLOCK_HASHES_PARAM,
    HISTORY_PULLED_PARAM,
    KEEP_TURN_PARAM,
    WorkerEndpoint,
    block_hashes,
    turn_output_params,
)
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.integrations.vllm_proxy import PdProxy, decode_body, prefill_body
from kvbroker.integrations.vllm_turns import TurnMemory, answered, conversation_of, handed_back
from kvbroker.types import Grant
from tests.unit import test_vllm_proxy as fakes
from tests.unit.test_vllm_proxy import config_for, decode_json, post, prefill_ok

serve = fakes.serve  # the fake vLLM servers (a fixture)

BS = 32
TAG = KvLayout(3, 100, BS, 1, 64, "float32", 16384, "m1", 1).tag()
GRANT = Grant(bytes(range(16)), bytes(range(32)))
NO_DAEMON = "unix:///nonexistent/kvbroker.sock"


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


def tokens(n: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


def _side(engine: str, cluster: int, target: str = NO_DAEMON, trusted: str = "") -> SchedulerSide:
    side = SchedulerSide(ConnectorConfig(target=target, prefill_daemons=trusted, hold_lease_s=60), engine, BS)
    side.set_endpoints({0: WorkerEndpoint(0, cluster, f"127.0.0.1:{cluster}", 5, TAG)})
    side.grants._stop = True  # no thread: the test reads what it would renew and release
    return side


def _turn(history: list[int], blocks: list[int]) -> dict[str, Any]:
    """What a decode engine (cluster 2) hands back for a turn of `history` (whole blocks) in `blocks`."""
    endpoints = {0: WorkerEndpoint(0, 2, "127.0.0.1:2", 7, TAG)}
    return turn_output_params(endpoints, "engine-d", "d-req", blocks, history, GRANT)


def test_a_decode_request_asked_to_keep_its_turn_grants_its_whole_blocks_under_a_lease(tmp_path: Any) -> None:
    from kvbroker import CacheDesc
    from kvbroker._local import LocalDaemon

    with LocalDaemon(tmp_path, 2) as daemon, daemon.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(8, 4)))
        side = SchedulerSide(ConnectorConfig(target=daemon.target, hold_lease_s=60, prefill_daemons="1=127.0.0.1:1"),
                             "engine-d", BS)
        side.set_endpoints({0: WorkerEndpoint(0, 2, "127.0.0.1:2", cache.cache_id, TAG)})
        side.grants._stop = True
        prompt, answer = tokens(70), tokens(30, 1)
        # A decode request that pulled its prompt (the report), then generated 30 tokens: 99 computed, 3 whole blocks.
        req = Req("d-req", prompt, {KEEP_TURN_PARAM: True, "do_remote_prefill": False}, 99, answer)
        side._reports["d-req"] = {"prompt": 70, "cached": 0, "refused": ""}
        delay, params = side.request_finished(req, [4, 5, 6, 7], finished_normally=True)
        assert delay and params is not None
        assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
        assert params["remote_block_ids"] == [4, 5, 6] and params["remote_num_tokens"] == 96
        assert params[BLOCK_HASHES_PARAM] == block_hashes((prompt + answer)[:96], BS, 3)
        assert params["kvbroker_prompt_tokens"] == 70  # the decode's own report is still there
        assert list(side.take_plan().holds) == ["d-req"]  # held until the grant ends, as a prefill hold is
        assert 50 < c.renew_grant(Grant.from_token(params["kvbroker_grant"])) <= 60
        # Not asked to keep it, or aborted: nothing held.
        plain = Req("d-2", prompt, {"do_remote_prefill": False}, 99, answer)
        side._reports["d-2"] = {"prompt": 70, "cached": 0, "refused": ""}
        assert side.request_finished(plain, [8, 9, 10, 11], finished_normally=True)[0] is False
        aborted = Req("d-3", prompt, {KEEP_TURN_PARAM: True}, 99, answer)
        assert side.request_finished(aborted, [8, 9, 10, 11], finished_normally=False) == (False, None)
        assert not side.take_plan().holds
        side.shutdown()


def test_the_next_turns_prefill_pulls_the_matching_history_and_computes_the_rest() -> None:
    history = tokens(96)
    prefill = _side("engine-p", 1, trusted="2=127.0.0.1:2")
    req = Req("p-req", history + tokens(24, 9), {**_turn(history, [4, 5, 6]), "do_remote_decode": True})
    prefill.on_new_request(req)
    assert list(prefill.grants._held) == ["p-req"]  # the decode node's grant, renewed until the pull ended
    assert prefill.num_new_matched_tokens(req, 0) == (96, True)
    prefill.after_alloc(req, all_blocks=[20, 21, 22, 23], new_blocks=[20, 21, 22, 23], num_external_tokens=96)
    (pull,) = prefill.take_plan().pulls
    assert (pull.local_blocks, pull.remote_blocks, pull.end_token) == ((20, 21, 22), (4, 5, 6), 96)
    assert pull.remote.cluster_id == 2
    # At its end it grants its own blocks to a decode node, and says what it pulled of the history.
    prefill.on_pulls_ended({"p-req"})
    req.num_computed_tokens = 120
    prefill._create_grant = lambda *_: GRANT  # type: ignore[method-assign]  # (no daemon here)
    delay, out = prefill.request_finished(req, [20, 21, 22, 23], finished_normally=True)
    assert delay and out is not None and out["do_remote_prefill"] is True and out["remote_num_tokens"] == 120
    assert out[HISTORY_PULLED_PARAM] == 0  # the workers reported no transfer here: what was pulled, not asked for


@pytest.mark.parametrize(("differs_at", "pulled"), [(40, 32), (70, 64), (10, 0)])
def test_only_the_blocks_whose_tokens_match_are_pulled(differs_at: int, pulled: int) -> None:
    history = tokens(96)
    prompt = history + tokens(24, 9)
    prompt[differs_at] += 1  # e.g. a chat template that renders the answer otherwise than it was generated
    prefill = _side("engine-p", 1, trusted="2=127.0.0.1:2")
    req = Req("p-req", prompt, {**_turn(history, [4, 5, 6]), "do_remote_decode": True})
    prefill.on_new_request(req)
    assert prefill.num_new_matched_tokens(req, 0) == ((pulled, True) if pulled else (0, False))
    if not pulled:  # nothing reused: the decode node frees its blocks now, and the request is a plain prefill
        assert [r.reason for r in prefill.grants._releases] == ["turn not reused"]
        assert req.kv_transfer_params == {"do_remote_decode": True}


def test_the_last_prompt_token_is_never_pulled() -> None:
    history = tokens(96)
    prefill = _side("engine-p", 1, trusted="2=127.0.0.1:2")
    req = Req("p-req", history, {**_turn(history, [4, 5, 6]), "do_remote_decode": True})
    prefill.on_new_request(req)
    assert prefill.num_new_matched_tokens(req, 0) == (64, True)


@pytest.mark.parametrize("change", [
    {BLOCK_HASHES_PARAM: "nope"},
    {BLOCK_HASHES_PARAM: ["zz" * 16] * 3},
    {BLOCK_HASHES_PARAM: ["0" * 32] * (1 << 17)},
    {"remote_block_ids": [[1], [2]]},
    {"kvbroker_grant": "garbage"},
    {"kvbroker_layout_tag": "not a tag"},
])
def test_malformed_turns_mean_computing_the_history(change: dict[str, Any]) -> None:
    history = tokens(96)
    prefill = _side("engine-p", 1, trusted="2=127.0.0.1:2")
    req = Req("p-req", history + tokens(8, 9), {**_turn(history, [4, 5, 6]), **change, "do_remote_decode": True})
    prefill.on_new_request(req)
    assert prefill.num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_decode"] is True
    assert "kvbroker_grant" not in req.kv_transfer_params  # its output carries no trace of the dropped turn


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(0, 200), st.text(max_size=12),
                 st.floats(), st.lists(st.integers(-5, 2**65), max_size=5),
                 st.lists(st.lists(st.integers(0, 300), max_size=4), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                 st.lists(st.sampled_from(["0" * 32, "f" * 32, "Z" * 32, ""]), max_size=5))
_TAG_TEXT = st.one_of(st.integers(-3, 2**40).map(str), st.text(alphabet="0123456789-,.:+xcuswafl", max_size=12),
                      st.sampled_from(["cu1.4.16.1.1.0+1x3", "0,1", "0,2", "-", "full", "mamba", "swa4", "token16"]))


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(st.tuples(st.sampled_from(["remote_block_ids", "remote_num_tokens", "tp_size", "kvbroker_grant",
                                                  "kvbroker_cluster_id", BLOCK_HASHES_PARAM, "remote_engine_id",
                                                  "kvbroker_protocol", "do_remote_prefill"]), _ANY), max_size=3),
       tag_fields=st.lists(st.tuples(st.sampled_from(["tp", "block", "kv_heads", "page", "units", "remap", "pp",
                                                      "groups", "state", "mamba", "layers"]), _TAG_TEXT), max_size=3))
def test_a_forged_turn_is_pulled_within_the_requests_blocks_or_computed_never_an_exception(
        fields: list[tuple[str, Any]], tag_fields: list[tuple[str, str]]) -> None:
    """The scheduler's hooks must not raise (an exception there ends the engine): whatever a handed-back turn's
    params and its layout tag say, the prefill request pulls into its own blocks, or computes its history."""
    history = tokens(96)
    prefill = _side("engine-p", 1, trusted="2=127.0.0.1:2")
    params = {**_turn(history, [4, 5, 6]), "do_remote_decode": True}
    tag = dict(item.partition("=")[::2] for item in TAG.split()[1:])
    tag.update(tag_fields)
    params["kvbroker_layout_tag"] = " ".join([TAG.split()[0], *(f"{k}={v}" for k, v in tag.items())])
    params.update(fields)
    req = Req("p-req", history + tokens(24, 9), params)
    prefill.on_new_request(req)
    count, _ = prefill.num_new_matched_tokens(req, 0)
    assert 0 <= count <= 96
    prefill.after_alloc(req, all_blocks=[20, 21, 22, 23], new_blocks=[20, 21, 22, 23], num_external_tokens=count)
    for pull in prefill.take_plan().pulls:
        assert set(pull.local_blocks) <= {20, 21, 22, 23} and pull.end_token <= 96
    req.num_computed_tokens = 120
    prefill._create_grant = lambda *_: GRANT  # type: ignore[method-assign]  # (no daemon here)
    prefill.request_finished(req, [20, 21, 22, 23], finished_normally=True)


def test_an_untrusted_decode_daemons_turn_is_never_dialled() -> None:
    history = tokens(96)
    prefill = _side("engine-p", 1, trusted="")
    req = Req("p-req", history + tokens(8, 9), {**_turn(history, [4, 5, 6]), "do_remote_decode": True})
    prefill.on_new_request(req)
    assert not prefill.grants._held
    assert prefill.num_new_matched_tokens(req, 0) == (0, False)


def test_the_decode_output_repeats_the_history_pull_only_when_it_is_a_bounded_count() -> None:
    report = {"prompt": 100, "cached": 0, "refused": ""}
    for sent, shown in ((64, 64), (-1, None), (101, None), ("64", None), (True, None)):
        out = SchedulerSide._decode_report(report, None, {HISTORY_PULLED_PARAM: sent})
        assert out.get(HISTORY_PULLED_PARAM) == shown


# -- the proxy ---------------------------------------------------------------------------------------------------
def test_the_keep_turn_key_is_the_connectors() -> None:
    assert vllm_turns.KEEP_TURN_PARAM == KEEP_TURN_PARAM


def test_a_turn_is_found_by_the_conversation_it_ends_once_per_tenant_route_and_model() -> None:
    memory = TurnMemory(ttl_s=60, max_turns=100)
    path = "/v1/chat/completions"
    first = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answer = {"choices": [{"message": {"role": "assistant", "content": "hello", "refusal": None}}],
              "kv_transfer_params": {**_turn(tokens(32), [4]), "kvbroker_tokens_pulled": 3}}
    turn = handed_back(answer["kv_transfer_params"])
    assert turn is not None and "kvbroker_tokens_pulled" not in turn
    conversation = conversation_of(path, first)
    assert conversation is not None
    memory.remember("alice", path, first, answered(conversation, path, answer), turn)
    # The client sends the answer back with fields of its own: the same conversation.
    sent_back = {"role": "assistant", "content": "hello", "tool_calls": None}
    second = {"model": "m", "messages": [*first["messages"], sent_back, {"role": "user", "content": "more"}]}
    again = conversation_of(path, second)
    assert again is not None
    assert memory.take("bob", path, second, again) is None  # another tenant never gets it
    assert memory.take("alice", path, {**second, "model": "other"}, again) is None
    assert memory.take("alice", path, second, again) == turn
    assert memory.take("alice", path, second, again) is None  # one use
    assert len(memory) == 0


def test_completions_turns_by_text_or_token_ids_and_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = TurnMemory(ttl_s=10, max_turns=2)
    path = "/v1/completions"
    turn = _turn(tokens(32), [4])
    text = {"model": "m", "prompt": "Once upon"}
    memory.remember("t", path, text, answered("Once upon", path, {"choices": [{"text": " a time"}]}), turn)
    assert memory.take("t", path, text, "Once upon a time, there") == turn
    ids = {"model": "m", "prompt": [1, 2, 3]}
    memory.remember("t", path, ids, answered((1, 2, 3), path, {"choices": [{"token_ids": [4, 5]}]}), turn)
    assert memory.take("t", path, ids, (1, 2, 3, 4, 6)) is None  # not a continuation
    memory.remember("t", path, ids, (1, 2, 3, 4, 5), turn)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 11)
    assert memory.take("t", path, ids, (1, 2, 3, 4, 5, 6)) is None  # expired
    for prompt in ([], [1.5], "", None):
        assert conversation_of(path, {"prompt": prompt}) is None
    assert conversation_of("/v1/chat/completions", {"messages": ["not a message"]}) is None
    assert handed_back({"do_remote_decode": "yes", "remote_block_ids": [1]}) is None
    assert handed_back({"do_remote_decode": True, "remote_block_ids": []}) is None


def test_the_oldest_turns_go_past_max_turns() -> None:
    memory = TurnMemory(ttl_s=60, max_turns=2)
    path = "/v1/completions"
    for i in range(3):
        memory.remember("t", path, {}, f"conversation {i}", {"n": i})
    assert len(memory) == 2
    assert memory.take("t", path, {}, "conversation 0 and more") is None
    assert memory.take("t", path, {}, "conversation 2 and more") == {"n": 2}


_sha256 = hashlib.sha256


class _CountingSha256:
    """hashlib.sha256 that adds what it is fed to a shared count."""

    fed = 0

    def __init__(self, data: bytes = b"", inner: Any = None) -> None:
        self._inner = inner if inner is not None else _sha256()
        self.update(data)

    def update(self, data: bytes) -> None:
        _CountingSha256.fed += len(data)
        self._inner.update(data)

    def copy(self) -> _CountingSha256:
        return _CountingSha256(inner=self._inner.copy())

    def digest(self) -> bytes:
        return bytes(self._inner.digest())

    def hexdigest(self) -> str:
        return str(self._inner.hexdigest())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(remembered=st.lists(st.integers(1, 16), min_size=4, max_size=20, unique=True),
       first=st.integers(20_000, 100_000), sizes=st.lists(st.integers(0, 200), min_size=16, max_size=40))
def test_finding_a_turn_hashes_the_conversation_once_however_many_lengths_are_remembered(
        monkeypatch: pytest.MonkeyPatch, remembered: list[int], first: int, sizes: list[int]) -> None:
    """A client whose scope remembers 16 conversation lengths made the proxy hash its next body's prefix once per
    length, on the event loop (16 x 30 MiB of chat messages: ~6 s per request): what one lookup hashes is bounded
    by the body, not by the lengths remembered."""
    memory = TurnMemory(ttl_s=60, max_turns=100)
    path = "/v1/chat/completions"
    for n in remembered:  # short earlier conversations of this tenant
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * n}
        conversation = conversation_of(path, body)
        assert conversation is not None
        memory.remember("t", path, body, conversation, {"n": n})
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * size} for size in [first, *sizes]]}
    conversation = conversation_of(path, body)
    assert conversation is not None
    monkeypatch.setattr(vllm_turns, "hashlib", types.SimpleNamespace(sha256=_CountingSha256))
    _CountingSha256.fed = 0
    memory.take("t", path, body, conversation)
    assert _CountingSha256.fed <= 2 * sum(len(str(item)) for item in conversation) + 4096


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["text", "ids", "chat"]), size=st.integers(1, 50_000), answer=st.integers(0, 40))
def test_remembering_an_answer_hashes_the_answer_only_and_finds_the_same_turn(
        monkeypatch: pytest.MonkeyPatch, kind: str, size: int, answer: int) -> None:
    """The proxy remembers a turn on its event loop: the request's conversation was hashed with the lookup (off the
    loop when large), so the answer's part alone is hashed there, and the key is the whole conversation's."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": "x" * size}]} if kind == "chat" else
                            {"prompt": "x" * size if kind == "text" else list(range(size))})
    reply = {"choices": [{"text": "y" * answer, "token_ids": list(range(answer)),
                          "message": {"role": "assistant", "content": "y" * answer}}]}
    conversation = conversation_of(path, body)
    assert conversation is not None
    scope = vllm_turns.scope_of("t", path, body)
    _, running = vllm_turns.running_keys(scope, conversation, ())
    added = vllm_turns.added_by(conversation, path, reply)
    monkeypatch.setattr(vllm_turns, "hashlib", types.SimpleNamespace(sha256=_CountingSha256))
    _CountingSha256.fed = 0
    length, key = running.extended(added)
    assert _CountingSha256.fed <= 4 * (answer + 64)
    monkeypatch.undo()
    whole = answered(conversation, path, reply)
    assert (length, key) == (len(whole), vllm_turns.prefix_keys(scope, whole, (len(whole),))[len(whole)])


def test_a_large_bodys_conversation_is_read_and_hashed_off_the_event_loop(
        serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a large body is parsed on a worker thread (T22e), so is its conversation read and hashed for a turn."""
    read_on: list[tuple[str, str]] = []
    read = vllm_turns.conversation_of

    def recording(path: str, body: dict[str, Any]) -> vllm_turns.Conversation | None:
        read_on.append((str(body.get("prompt"))[:5], threading.current_thread().name))
        return read(path, body)

    monkeypatch.setattr(vllm_proxy, "conversation_of", recording)
    p, d = serve(prefill_ok), serve(decode_json)
    with PdProxy(config_for([p.url], [d.url], turn_ttl=60.0)) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "small"})[0] == 200
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "large" + "x" * 300_000})[0] == 200
    assert [(prompt, name == "pd-proxy") for prompt, name in read_on] == [("small", True), ("large", False)]


@settings(max_examples=40, deadline=None)
@given(blocks=st.lists(st.integers(1, 3000), min_size=1, max_size=30), taken=st.lists(st.booleans(), max_size=30))
def test_the_turns_remembered_hold_a_bounded_number_of_bytes_whatever_their_sizes(blocks: list[int],
                                                                                  taken: list[bool]) -> None:
    """A turn holds a block id and a hash per block (5,000 blocks: ~0.6 MiB): `max_turns` (10,000) of a client's long
    conversations alone held ~6 GiB. What the turns hold together is bounded in bytes, the oldest forgotten first."""
    budget = 400_000
    memory = TurnMemory(ttl_s=60, max_turns=10_000, max_bytes=budget)
    path = "/v1/completions"
    for i, n in enumerate(blocks):
        params = _turn(tokens(n * BS), list(range(100, 100 + n)))
        memory.remember("t", path, {}, f"conversation {i}", params)
        if i < len(taken) and taken[i]:
            memory.take("t", path, {}, f"conversation {i} goes on")
        held = [t.params for t in memory._turns.values()]
        assert sum(len(json.dumps(p)) for p in held) <= budget
    last = _turn(tokens(blocks[-1] * BS), list(range(100, 100 + blocks[-1])))
    if len(json.dumps(last)) <= budget and not (len(taken) >= len(blocks) and taken[len(blocks) - 1]):
        assert memory.take("t", path, {}, f"conversation {len(blocks) - 1} goes on") == last  # the newest stays


def test_a_turn_goes_into_the_prefill_request_and_the_decode_request_asks_to_keep_the_next() -> None:
    body = {"model": "m", "prompt": "x", "kv_transfer_params": {"kvbroker_grant": "client's"}}
    turn = _turn(tokens(32), [4])
    prefill = prefill_body(body, None, turn)["kv_transfer_params"]
    assert prefill == {**turn, "do_remote_decode": True}
    assert prefill_body(body)["kv_transfer_params"] == {"do_remote_decode": True}  # the client's never goes
    assert decode_body(body, {"a": 1}, keep_turn=True)["kv_transfer_params"] == {"a": 1, KEEP_TURN_PARAM: True}
    assert "kv_transfer_params" not in decode_body(body, None, keep_turn=True)


def test_through_the_proxy_the_next_turn_of_the_same_tenant_carries_the_turn_and_others_do_not(serve: Any) -> None:
    """The proxy with `--turn-ttl`: the decode request asks to keep the turn, the next turn's prefill request
    carries the decode answer's turn (once), and neither another tenant nor a client's own params ever get it."""
    turn = _turn(tokens(32), [4])

    def decode_answer(handler: Any, body: dict[str, Any]) -> None:
        handler.reply(200, {"choices": [{"message": {"role": "assistant", "content": "hello"}}],
                            "kv_transfer_params": {**turn, "kvbroker_tokens_pulled": 5}})

    p, d = serve(prefill_ok), serve(decode_answer)
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    with PdProxy(config_for([p.url], [d.url], turn_ttl=30.0), "127.0.0.1", 0) as proxy:
        assert post(proxy, "/v1/chat/completions", {"model": "m", "messages": first}, alice)[0] == 200
        assert post(proxy, "/v1/chat/completions", {"model": "m", "messages": second}, bob)[0] == 200
        hostile = {"model": "m", "messages": second, "kv_transfer_params": turn}
        assert post(proxy, "/v1/chat/completions", hostile, {"Authorization": "Bearer mallory"})[0] == 200
        assert post(proxy, "/v1/chat/completions", {"model": "m", "messages": second}, alice)[0] == 200
        assert post(proxy, "/v1/chat/completions", {"model": "m", "messages": second}, alice)[0] == 200

    prefill_params = [body["kv_transfer_params"] for _, _, body in p.requests]
    assert prefill_params[:3] == [{"do_remote_decode": True}] * 3  # first turn, bob, mallory
    assert prefill_params[3] == {**turn, "do_remote_decode": True}  # alice's second turn
    assert prefill_params[4] == {"do_remote_decode": True}  # used once
    assert all(body["kv_transfer_params"][KEEP_TURN_PARAM] is True for _, _, body in d.requests)


def test_without_turn_ttl_the_proxy_asks_no_decode_server_to_keep_a_turn(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with PdProxy(config_for([p.url], [d.url]), "127.0.0.1", 0) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "a"})[0] == 200
    ((_, _, body),) = d.requests
    assert KEEP_TURN_PARAM not in body["kv_transfer_params"]


def test_a_streamed_answer_is_remembered_as_the_non_streamed_one_would_be(serve: Any) -> None:
    """Most chat clients stream: the proxy reads the turn from the events it relays (the text of each delta, the
    decode connector's last event with kv_transfer_params) and the next turn carries it."""
    turn = _turn(tokens(32), [4])

    def decode_stream(handler: Any, body: dict[str, Any]) -> None:
        handler.start_stream()
        handler.chunk(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\ndata: {"choices": '
                      b'[{"delta": {"content": "hel"}}]}\n')
        handler.chunk(b'\ndata: {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}\n\n')
        handler.chunk(b"data: " + json.dumps({"choices": [], "kv_transfer_params": turn}).encode() + b"\n\n")
        handler.chunk(b"data: [DONE]\n\n")
        handler.chunk(b"")

    p, d = serve(prefill_ok), serve(decode_stream)
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    with PdProxy(config_for([p.url], [d.url], turn_ttl=30.0), "127.0.0.1", 0) as proxy:
        for messages in (first, second):
            host, port = proxy.address
            conn = http.client.HTTPConnection(host, port, timeout=10)
            conn.request("POST", "/v1/chat/completions", body=json.dumps({"model": "m", "messages": messages,
                                                                          "stream": True}))
            response = conn.getresponse()
            assert response.status == 200 and response.read().endswith(b"data: [DONE]\n\n")
            conn.close()
    assert p.requests[1][2]["kv_transfer_params"] == {**turn, "do_remote_decode": True}
    assert all(body["kv_transfer_params"][KEEP_TURN_PARAM] is True for _, _, body in d.requests)


PARAMS_EVENT = b'data: {"choices": [], "kv_transfer_params": {"do_remote_decode": true}}\n\n'


@pytest.mark.parametrize("events", [
    pytest.param([b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"], id="no-params"),
    pytest.param([b'data: {"choices": [{"text": "a"}]}\n\n', b"data: {not json\n\n", PARAMS_EVENT], id="unreadable"),
    pytest.param([b'data: {"choices": [{"text": "' + b"a" * (vllm_turns.MAX_STREAMED_ANSWER_BYTES + 1) + b'"}]}\n\n',
                  PARAMS_EVENT], id="oversized"),
])
def test_a_stream_that_names_no_turn_or_cannot_be_read_is_not_remembered(events: list[bytes]) -> None:
    streamed = vllm_turns.StreamedAnswer("/v1/completions")
    for event in events:
        streamed.feed(event)
    assert streamed.answer() is None


def test_a_completion_stream_gathers_its_text_across_chunk_boundaries() -> None:
    streamed = vllm_turns.StreamedAnswer("/v1/completions")
    raw = (b'data: {"choices": [{"text": "ab"}]}\n\ndata: {"choices": [{"text": "c"}]}\n\n'
           b'data: {"choices": [], "kv_transfer_params": {"remote_block_ids": [1]}}\n\ndata: [DONE]\n\n')
    for i in range(0, len(raw), 7):
        streamed.feed(raw[i:i + 7])
    assert streamed.answer() == {"choices": [{"text": "abc"}], "kv_transfer_params": {"remote_block_ids": [1]}}
