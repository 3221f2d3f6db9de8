"""A Mamba2 state planned across TP sizes (mamba_state.py) against vLLM's own split: each rank's state at each TP size
is made with vLLM 0.32's functions (its state shapes from `MambaStateShapeCalculator.mamba2_state_shape`, its conv
channels from the weight loader the layer shards conv1d with, its SSM heads as `A` is sharded), laid in pages as vLLM
lays them, and the plan's runs, applied unit by unit, must turn the prefill ranks' pages into exactly the decode rank's.
No engine: the end-to-end case is test_hetero_e2e.py's Mamba hybrid at TP 1 -> 2 and 2 -> 1."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

if os.environ.get("KVBROKER_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (its own venv: tests/vllm/setup_venv.sh)")

from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

from kvbroker.blockruns import expand
from kvbroker.integrations.vllm.layout import KvLayout
from kvbroker.integrations.vllm.remap import plan_state, refusal

BLOCKS = 3
KV_HEADS = 4
HEAD = 64


def _rank_state(model: dict[str, int], tp: int, rank: int, conv: np.ndarray, ssm: np.ndarray,
                dim_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s conv state and SSM state at `tp`, as vLLM shards the layer (the same loaders its weights go
    through, applied to the model's state with a channel per row)."""
    groups, d_state, heads = model["n_groups"], model["d_state"], model["heads"]
    conv_shape, ssm_shape = MambaStateShapeCalculator.mamba2_state_shape(
        tp, model["heads"] * model["head_dim"], groups, heads, model["head_dim"], d_state, model["conv_kernel"])
    extended = groups + MambaStateShapeCalculator.extra_groups_for_head_shards(groups, tp)
    group_spec = (extended * d_state, (extended - groups) * d_state, groups == 1 and tp > 1)
    intermediate = (model["heads"] * model["head_dim"], 0, False)
    param = torch.zeros(intermediate[0] // tp + 2 * extended * d_state // tp, conv.shape[0], dtype=torch.float32)
    mamba_v2_sharded_weight_loader([intermediate, group_spec, group_spec], tp, rank)(
        param, torch.from_numpy(np.ascontiguousarray(conv.T)))
    rank_conv = param.numpy() if dim_first else param.numpy().T
    per = heads // tp  # `A`, `D`, `dt_bias`: sharded_weight_loader(0), consecutive heads
    rank_ssm = ssm[rank * per:(rank + 1) * per]
    assert rank_conv.shape == (conv_shape if not dim_first else conv_shape[::-1]) and rank_ssm.shape == ssm_shape
    return np.ascontiguousarray(rank_conv), np.ascontiguousarray(rank_ssm)


def _layout(model: dict[str, int], tp: int, state: tuple[np.ndarray, np.ndarray], dtype: str, dim_first: bool
            ) -> KvLayout:
    heads = KV_HEADS // tp
    itemsize = np.dtype(np.float16 if dtype == "bfloat16" else np.float32).itemsize
    shapes = "+".join("x".join(map(str, s.shape)) + ".float32" for s in state)
    return KvLayout(2, BLOCKS, 64, heads, HEAD, dtype, heads * 2 * 64 * HEAD * itemsize, "m", tp,
                    total_kv_heads=KV_HEADS, token_units=True, groups="mamba:2,full:2", state=shapes,
                    mamba="mamba2.DS" if dim_first else "mamba2.SD")


def _pages(layout: KvLayout, block: int, state: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """An engine's cache (one layer) as units, the state in `block` and noise elsewhere."""
    cache = np.random.default_rng(block).integers(0, 255, layout.num_blocks * layout.page_bytes, dtype=np.uint8)
    raw = np.concatenate([s.reshape(-1).view(np.uint8) for s in state])
    start = block * layout.page_bytes
    cache[start:start + raw.size] = raw
    return cache.reshape(-1, layout.unit_bytes)


MODELS = {
    # The e2e test's Granite-4 hybrid: one group of B and C, replicated on every rank at TP > 1.
    "one-group": {"heads": 8, "head_dim": 32, "d_state": 16, "n_groups": 1, "conv_kernel": 4},
    # Groups split with the heads (Mamba2 / Nemotron-H style, n_groups divisible by TP).
    "four-groups": {"heads": 8, "head_dim": 16, "d_state": 32, "n_groups": 4, "conv_kernel": 4},
}


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_decode_rank_gets_the_state_vllm_gives_a_rank_of_its_tp(name: str, prefill_tp: int, decode_tp: int,
                                                                        dtype: str, dim_first: bool) -> None:
    model = MODELS[name]
    rng = np.random.default_rng(7)
    channels = model["heads"] * model["head_dim"] + 2 * model["n_groups"] * model["d_state"]
    conv = rng.standard_normal((model["conv_kernel"] - 1, channels)).astype(np.float32)  # the model's, SD
    ssm = rng.standard_normal((model["heads"], model["head_dim"], model["d_state"])).astype(np.float32)
    prefill = [_rank_state(model, prefill_tp, r, conv, ssm, dim_first) for r in range(prefill_tp)]
    decode = [_rank_state(model, decode_tp, r, conv, ssm, dim_first) for r in range(decode_tp)]
    theirs = _layout(model, prefill_tp, prefill[0], dtype, dim_first)
    ours = _layout(model, decode_tp, decode[0], dtype, dim_first)
    assert refusal(ours, theirs.tag()) is None
    sources = [_pages(theirs, 2, state) for state in prefill]
    for rank, want in enumerate(decode):
        cache = _pages(ours, 0, tuple(np.zeros_like(s) for s in want))  # type: ignore[arg-type]
        pulls = plan_state(ours, rank, theirs, local_block=1, remote_block=2)
        for pull in pulls:
            src, dst = expand(pull.runs)
            cache[dst.astype(np.int64)] = sources[pull.remote_rank][src.astype(np.int64)]
        got = cache.reshape(-1)[ours.page_bytes:ours.page_bytes + ours.state_bytes]
        np.testing.assert_array_equal(got, np.concatenate([s.reshape(-1).view(np.uint8) for s in want]))
        # Each of its heads' and channels' bytes once, from as few prefill ranks as hold them.
        assert sum(p.runs.num_pairs for p in pulls) * ours.unit_bytes == ours.state_bytes
        assert len(pulls) == max(1, prefill_tp // decode_tp)


def test_a_state_whose_stretches_are_not_whole_transfer_units_is_refused_by_field_state() -> None:
    model = {"heads": 8, "head_dim": 32, "d_state": 4, "n_groups": 1, "conv_kernel": 4}  # B and C: 16 bytes
    channels = 8 * 32 + 2 * 4
    conv, ssm = np.zeros((3, channels), np.float32), np.zeros((8, 32, 4), np.float32)
    theirs = _layout(model, 1, _rank_state(model, 1, 0, conv, ssm, False), "float32", False)
    ours = _layout(model, 2, _rank_state(model, 2, 0, conv, ssm, False), "float32", False)
    found = refusal(ours, theirs.tag())
    assert found is not None and found.field == "state" and "not in whole transfer units of 64 bytes" in (
        found.message)


def test_another_kind_of_state_or_shapes_of_another_model_are_refused_by_field_state() -> None:
    model = MODELS["one-group"]
    channels = 8 * 32 + 2 * 16
    conv, ssm = np.zeros((3, channels), np.float32), np.zeros((8, 32, 16), np.float32)
    theirs = _layout(model, 1, _rank_state(model, 1, 0, conv, ssm, False), "float32", False)
    ours = _layout(model, 2, _rank_state(model, 2, 0, conv, ssm, False), "float32", False)
    found = refusal(ours, theirs.tag().replace("8x32x16", "4x64x16"))  # as many bytes, other heads
    assert found is not None and found.field == "state" and "are not one model's state" in found.message
    found = refusal(ours, theirs.tag().replace("mamba=mamba2.SD", "mamba=mamba2.DS"))
    assert found is not None and found.field == "mamba", found
    short_conv = theirs.tag().replace("mamba=mamba2.SD", "mamba=short_conv.SD")
    found = refusal(dataclasses.replace(ours, mamba="short_conv.SD"), short_conv)
    assert found is not None and found.field == "state" and "not split across TP sizes (Mamba2 only)" in found.message
