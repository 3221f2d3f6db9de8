"""A model with Mamba state (vLLM's hybrid allocator: attention groups and a Mamba group, one state block per
request): how the connector reads it, tags it, maps it and stops a prefill one token short. The end-to-end check
with a real hybrid model is tests/vllm/test_hetero_e2e.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.groups import GroupMismatch, group_parts
from kvbroker.integrations.vllm.layout import KvLayout, UnsupportedLayoutError, layout_from_vllm, layout_of_tag
from kvbroker.integrations.vllm.params import WorkerEndpoint, prefill_output_params
from kvbroker.integrations.vllm.remap import plan_state, refusal
from kvbroker.integrations.vllm.scheduler import SchedulerSide
from kvbroker.types import Grant
from tests.unit.test_vllm_groups import PAGE, FullAttentionSpec, _config

STATE = "3x64.float32+4x16x16.float32"
STATE_BYTES = (3 * 64 + 4 * 16 * 16) * 4
GRANT = Grant(bytes(range(16)), bytes(range(32)))


@dataclass(frozen=True)
class MambaSpec:
    """vLLM's MambaSpec, as much of it as the connector reads (Mamba2: conv state, then SSM state)."""

    shapes: tuple[tuple[int, ...], ...] = ((3, 64), (4, 16, 16))
    dtypes: tuple[str, ...] = ("torch.float32", "torch.float32")
    page_size_bytes: int = PAGE
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    block_size: int = 512
    state_alignment: int = 1


def _layout(tp: int = 1, block: int = 32, token_units: bool = True) -> KvLayout:
    heads = 2 // tp
    return KvLayout(2, 100, block, heads, 32, "float32", block * heads * 2 * 32 * 4, "m1", tp, total_kv_heads=2,
                    token_units=token_units, groups="mamba:2,full:2", state=STATE, mamba="mamba2.SD")


def test_a_mamba_group_is_tagged_with_its_state_and_laid_over_the_attention_pages() -> None:
    layout = layout_from_vllm(_config([MambaSpec(), FullAttentionSpec()], [2, 2]), "m1", tp_size=1,
                              token_units=True)
    assert (layout.groups, layout.kinds, layout.windows) == ("mamba:2,full:2", ("mamba", "full"), (None, None))
    assert layout.has_state and layout.state == STATE and layout.state_bytes == STATE_BYTES
    # The rank's shapes differ with the TP size (the plan maps them); what they mean must match (the daemon too).
    assert f"state={STATE}" in layout.tag() and "state=" not in layout.daemon_tag()
    assert "mamba=mamba2.SD" in layout.tag() and "mamba=mamba2.SD" in layout.daemon_tag()
    assert layout_of_tag(layout.tag()) == KvLayout(2, 0, 32, 1, 64, "float32", PAGE, "m1", 1, total_kv_heads=1,
                                                   token_units=True, groups="mamba:2,full:2", state=STATE,
                                                   mamba="mamba2.SD")
    # A state of 4,864 bytes is 76 units of 16 float32 elements; the rest of the 16 KiB page is vLLM's padding.
    assert layout.state_units == 76 and "state=-" in layout_from_vllm(_config([FullAttentionSpec()], [1]), "m1",
                                                                       tp_size=1).tag()


@pytest.mark.parametrize(("spec", "message"), [
    (MambaSpec(mamba_cache_mode="align"), "mamba_cache_mode 'align' is not supported: start vLLM with prefix "
                                          "caching off"),
    (MambaSpec(num_speculative_blocks=2), "speculative decoding"),
    (MambaSpec(page_size_bytes=2 * PAGE), "is not the attention page"),
    (MambaSpec(shapes=((3, 64), (8, 32, 16))), "state of 17,152 bytes does not fit its page of 16,384"),
    (MambaSpec(dtypes=("torch.float32", "torch.complex64")), "dtype complex64 is not supported"),
    (MambaSpec(state_alignment=1024), r"padded apart in their page \(state_alignment 1024\)"),  # 768-byte conv state
])
def test_a_mamba_state_the_connector_cannot_move_is_refused_at_start_up(spec: MambaSpec, message: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=message):
        layout_from_vllm(_config([spec, FullAttentionSpec()], [2, 2]), "m1", tp_size=1)


def test_a_state_alignment_its_tensors_are_multiples_of_pads_nothing() -> None:
    layout = layout_from_vllm(_config([MambaSpec(state_alignment=256), FullAttentionSpec()], [2, 2]), "m1", tp_size=1)
    assert layout.state == STATE


def test_a_model_of_mamba_layers_only_or_on_a_gpu_is_refused_at_start_up() -> None:
    with pytest.raises(UnsupportedLayoutError, match="no attention layers"):
        layout_from_vllm(_config([MambaSpec()], [2]), "m1", tp_size=1)
    with pytest.raises(UnsupportedLayoutError, match="Mamba state on GPU engines is not supported"):
        layout_from_vllm(_config([MambaSpec(), FullAttentionSpec()], [2, 2]), "m1", tp_size=1, on_gpu=True)


@pytest.mark.parametrize(("old", "new", "message"), [
    (f"state={STATE}", "state=3x64.float32;rm", "malformed state"),
    (f"state={STATE}", "state=3x64.complex64", "malformed state"),
    (f"state={STATE}", "state=" + "+".join(["1x1.uint8"] * 9), "malformed state"),
    (f"state={STATE}", "state=-", "a Mamba group needs its state"),
    ("mamba=mamba2.SD", "mamba=-", "a Mamba group needs its state's shapes and kind"),
    ("mamba=mamba2.SD", "mamba=mamba2.XY", "malformed mamba"),
    ("groups=mamba:2,full:2", "groups=full", "only a Mamba group has them"),
])
def test_a_malformed_state_field_is_an_unreadable_tag(old: str, new: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout_of_tag(_layout().tag().replace(old, new))


def test_a_state_of_another_layout_is_refused_by_field() -> None:
    ds = _layout().tag().replace("state=3x64", "state=64x3")  # a state of other shapes at the same TP size
    found = refusal(_layout(), ds)
    assert found is not None and found.field == "state" and "local 3x64.float32+" in found.message
    found = refusal(_layout(), _layout().tag().replace("mamba=mamba2.SD", "mamba=mamba2.DS"))
    assert found is not None and found.message == "mamba: local mamba2.SD vs remote mamba2.DS"
    assert refusal(_layout(block=64), _layout(block=32).tag()) is None  # token units: only attention is remapped


def test_a_state_split_across_tp_sizes_needs_token_units_on_both_engines() -> None:
    """Split per projection, a rank's state is cut finer than a head's block (tests/vllm/test_mamba_tp_split.py
    checks the split itself against vLLM's)."""
    found = refusal(_layout(tp=2, token_units=False), _layout(tp=1, token_units=False).tag())
    assert found is not None and found.field == "state"
    assert "needs token units on both engines: local none, remote none" in found.message


GRANITE_TP1, GRANITE_TP2 = "3x288.float32+8x32x16.float32", "3x160.float32+4x32x16.float32"


def _granite(tp: int) -> KvLayout:
    """The e2e test's hybrid model (8 heads of 32, d_state 16, one group of B and C, conv kernel 4) at `tp`."""
    return KvLayout(2, 10, 64, 2 // tp, 32, "float32", 64 * (2 // tp) * 2 * 32 * 4, "m1", tp, total_kv_heads=2,
                    token_units=True, groups="mamba:2,full:2", state=GRANITE_TP1 if tp == 1 else GRANITE_TP2,
                    mamba="mamba2.SD")


def test_a_decode_rank_of_two_takes_its_heads_and_x_channels_and_the_one_group_of_b_and_c() -> None:
    """Rank 1 of 2 from TP 1, in units of 16 float32: per conv row (18 units at TP 1, 10 at TP 2) x's channels
    128-255 (units 8-15), B's and C's one group (units 16 and 17, which every rank holds), then heads 4-7 of the SSM
    state (32 units each, after 54 and 30 units of conv state)."""
    ours, theirs = _granite(2), _granite(1)
    assert refusal(ours, theirs.tag()) is None
    (pull,) = plan_state(ours, 1, theirs, local_block=7, remote_block=3)
    src, dst = 3 * theirs.units_per_block, 7 * ours.units_per_block
    runs = pull.runs
    assert pull.remote_rank == 0 and [list(map(int, c)) for c in (runs.src_first - src, runs.dst_first - dst,
                                                                   runs.length, runs.count, runs.src_stride,
                                                                   runs.dst_stride)] == [
        [8, 16, 17, 54 + 4 * 32], [0, 8, 9, 30], [8, 1, 1, 128], [3, 3, 3, 1], [18, 18, 18, 0], [10, 10, 10, 0]]


def test_a_decode_rank_of_one_gathers_both_ranks_and_one_replica_of_b_and_c() -> None:
    ours, theirs = _granite(1), _granite(2)
    first, second = plan_state(ours, 0, theirs, local_block=0, remote_block=0)
    assert (first.remote_rank, second.remote_rank) == (0, 1)
    # x's first half, B and C from rank 0; x's second half from rank 1 (its replica of B and C is not read)
    assert [list(map(int, c)) for c in (first.runs.src_first, first.runs.dst_first, first.runs.length)] == [
        [0, 8, 9, 30], [0, 16, 17, 54], [8, 1, 1, 128]]
    assert [list(map(int, c)) for c in (second.runs.src_first, second.runs.dst_first, second.runs.length)] == [
        [0, 30], [8, 54 + 4 * 32], [8, 128]]


def test_the_state_moves_whole_from_the_start_of_its_block_in_any_block_size() -> None:
    ours, theirs = _layout(block=64), _layout(block=32)
    (pull,) = plan_state(ours, 0, theirs, local_block=7, remote_block=3)
    assert pull.remote_rank == 0 and len(pull.src_units) == 76
    np.testing.assert_array_equal(pull.src_units, 3 * theirs.units_per_block + np.arange(76))
    np.testing.assert_array_equal(pull.dst_units, 7 * ours.units_per_block + np.arange(76))
    with pytest.raises(ValueError, match="does not map"):  # head units of different block sizes differ in bytes
        plan_state(_layout(block=64, token_units=False), 0, _layout(block=32, token_units=False), 7, 3)


def test_a_mamba_group_is_one_part_of_one_block_each_side() -> None:
    local, remote = ([5], [11, 12, 13, 14]), ([9], [21, 22])
    state, full = group_parts(_layout(), _layout(block=64), local, remote, 0, 99)
    assert (state.state, state.local_blocks, state.remote_blocks) == (True, (5,), (9,))
    assert (full.state, full.start_token, full.end_token) == (False, 0, 99)
    with pytest.raises(GroupMismatch, match="a Mamba state is one block"):
        group_parts(_layout(), _layout(), ([5, 6], [1, 2, 3, 4]), ([9], [21, 22, 23, 24]), 0, 99)


@dataclass
class Request:
    """The fields of vLLM's Request that stopping a prefill one token short touches."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    max_tokens: int = 16
    _all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)


def _side(role: str) -> SchedulerSide:
    side = SchedulerSide(ConnectorConfig(target="unix:///nonexistent.sock", prefill_daemons="1=127.0.0.1:1"),
                         f"engine-{role}", 32)
    side.set_endpoints({0: WorkerEndpoint(0, 1 if role == "p" else 2, "127.0.0.1:1", 5, _layout().tag())})
    side.grants._stop = True
    return side


def test_a_prefill_request_stops_one_token_short_once() -> None:
    prefill = _side("p")
    req = Request("p-req", list(range(1, 71)), {"do_remote_decode": True})
    prefill.on_new_request(req)
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids), req.max_tokens) == (
        69, 69, 69, 1)
    prefill.on_new_request(req)  # preempted and scheduled again: not cut twice
    assert req.num_prompt_tokens == 69
    plain = Request("p-2", list(range(1, 71)), None)
    one = Request("p-3", [1], {"do_remote_decode": True})
    for r in (plain, one):
        prefill.on_new_request(r)
    assert (plain.num_prompt_tokens, one.num_prompt_tokens) == (70, 1)


@dataclass
class HashedRequest(Request):
    """A request of an engine with prefix caching: vLLM hashed its full blocks of tokens when it arrived."""

    block_hashes: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.update_block_hashes()

    def _block_hasher(self) -> None:  # vLLM's is a callable attribute; only its presence is read
        raise AssertionError

    def update_block_hashes(self) -> None:  # vLLM's: hashes the full blocks past those already hashed
        tokens = self._all_token_ids
        for start in range(len(self.block_hashes) * 32, len(tokens) - 31, 32):
            self.block_hashes.append(tuple(tokens[start:start + 32]))


def test_a_shortened_prefill_requests_blocks_are_hashed_from_its_tokens_as_they_now_are() -> None:
    """The prompt's last full block lost its last token: under its old hash, the block the generated token fills
    would pass for the original prompt's (to the prefix cache, to KV cache events)."""
    req = HashedRequest("p-req", list(range(1, 65)), {"do_remote_decode": True})
    assert len(req.block_hashes) == 2
    _side("p").on_new_request(req)
    assert req.num_prompt_tokens == 63 and req.block_hashes == [tuple(range(1, 33))]
    req._all_token_ids.append(999)  # the one token the prefill engine generates fills the block: hashed anew
    req.update_block_hashes()
    assert req.block_hashes[1] == (*range(33, 64), 999)


def test_a_decode_pulls_the_state_after_all_but_the_last_token_and_refuses_any_other() -> None:
    decode = _side("d")
    endpoints = {0: WorkerEndpoint(0, 1, "127.0.0.1:1", 5, _layout().tag())}
    params = prefill_output_params(endpoints, "engine-p", "p-req", [[9], [21, 22, 23]], 69, GRANT)
    req = Request("d-req", list(range(1, 71)), dict(params))
    assert decode.num_new_matched_tokens(req, 0) == (69, True)
    decode.after_alloc(req, [5], [5], 69, groups=([5], [11, 12, 13]))
    (pull,) = decode.take_plan().pulls
    assert pull.refused == "" and [(p.state, p.local_blocks) for p in pull.parts] == [(True, (5,)), (False, (
        11, 12, 13))]
    # A prefill engine that computed the whole prompt: its state already holds the last token.
    whole = Request("d-2", list(range(1, 70)), {**params, "do_remote_prefill": True})
    assert decode.num_new_matched_tokens(whole, 0) == (0, False)
    decode.after_alloc(whole, [6], [6], 0, groups=([6], [14, 15, 16]))
    assert not decode.take_plan().pulls
    report = decode._reports["d-2"]
    assert report["refused"].startswith("state: the prefill engine's Mamba state is after 69 tokens of this "
                                        "69-token prompt, not 68")
