"""Pipeline stages in the layout tag (`integrations/vllm/stages.py`): the layer ranges a pull maps between two
splits, and a peer's `pp` field, which is never trusted: a malformed one is a refusal by field, never an error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.integrations.vllm.layout import MEMORY_CPU, KvLayout
from kvbroker.integrations.vllm.remap import refusal
from kvbroker.integrations.vllm.stages import Stages, layer_pulls, parse, whole


def _ranges(ours: Stages, stage: int, theirs: Stages) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    return [(p.stage, p.ext_param.src_layer_range, p.ext_param.dst_layer_range)
            for p in layer_pulls(ours, stage, theirs)]


def test_each_layer_comes_from_the_stage_that_holds_it() -> None:
    assert _ranges(whole(6), 0, Stages((0, 3), 6)) == [(0, (0, 2), (0, 2)), (1, (0, 2), (3, 5))]
    assert _ranges(Stages((0, 3), 6), 1, whole(6)) == [(0, (3, 5), (0, 2))]
    assert _ranges(Stages((0, 3), 6), 0, Stages((0, 2, 4), 6)) == [(0, (0, 1), (0, 1)), (1, (0, 0), (2, 2))]
    assert _ranges(Stages((0, 3), 6), 1, Stages((0, 2, 4), 6)) == [(1, (1, 1), (0, 0)), (2, (0, 1), (1, 2))]


@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_any_two_splits_fill_every_layer_once(ours: list[int], theirs: list[int]) -> None:
    layers = max(sum(ours), sum(theirs))
    ours[-1] += layers - sum(ours)
    theirs[-1] += layers - sum(theirs)
    mine = Stages(tuple(sum(ours[:i]) for i in range(len(ours))), layers)
    held = Stages(tuple(sum(theirs[:i]) for i in range(len(theirs))), layers)
    filled = []
    for stage in range(mine.count):
        for pull in layer_pulls(mine, stage, held):
            (s0, s1), (d0, d1) = pull.ext_param.src_layer_range, pull.ext_param.dst_layer_range
            assert s1 - s0 == d1 - d0 >= 0
            source = held.layers_of(pull.stage)
            assert [source[i] for i in range(s0, s1 + 1)] == [mine.layers_of(stage)[i] for i in range(d0, d1 + 1)]
            filled += [mine.layers_of(stage)[i] for i in range(d0, d1 + 1)]
    assert sorted(filled) == list(range(layers))


@pytest.mark.parametrize("field", ["0", "1,2", "0,0", "0,3,2", "0,6", "0,-1", "0,2,", "x", "0," + ",".join(
    str(i) for i in range(1, 70)), "0,01"])
def test_a_malformed_split_is_refused(field: str) -> None:
    with pytest.raises(ValueError):
        parse(field, 6)


@given(st.text(max_size=40))
def test_a_peers_pp_field_is_a_refusal_or_a_split_never_an_error(field: str) -> None:
    ours = KvLayout(num_layers=6, num_blocks=4, block_size=32, num_kv_heads=2, head_size=32, dtype="float32",
                    page_bytes=2 * 2 * 32 * 32 * 4, model_id="m", tp_size=1, total_kv_heads=2, memory=MEMORY_CPU)
    theirs = ours.tag() + " pp=" + "".join(c for c in field if not c.isspace())
    refused = refusal(ours, theirs)
    assert refused is None or refused.field in ("version", "pp")
