"""Disaggregated generation end to end (examples/pd_generation): a prefill process next to one real daemon, a decode
process next to another, a seeded tiny Llama in each, checked against transformers' generate() in this process.

Three checks, all needed: the K/V bytes D rebuilt (per-layer hashes), D's decode logits (bit for bit), and the
tokens. Tokens alone miss corruptions: once RoPE has been applied, attention does not care in which order whole
blocks of keys arrive, so two swapped full blocks change no token; the logits move only in their last bits (from the
changed summation order), and in bf16 not always even that. Only the K/V hashes catch it every time.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

# The example needs the `examples` extra; the client and daemon tests do not.
pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[examples]')")

# Imported after the skips: both modules import torch and transformers.
from examples.pd_generation.__main__ import main, serve_and_compare
from examples.pd_generation.deployment import Deployment, Disaggregated
from examples.pd_generation.model import (
    Generation,
    build_model,
    reference_generation,
    tiny_llama_config,
    weight_hash,
)

STEPS = 24
# 32 tokens fill two blocks exactly; 37 leave the third block mostly empty.
PROMPT_LENS = [32, 37]
CONFIG = tiny_llama_config()
# One block of one tensor: 16 tokens x 2 KV heads x head_dim 64 (hidden 256 / 4 heads) x the element size.
BLOCK_NBYTES = {"fp32": 16 * 2 * 64 * 4, "bf16": 16 * 2 * 64 * 2}


class Setup:
    def __init__(self, dtype: str, dep: Deployment) -> None:
        self.dtype, self.dep = dtype, dep
        self.model = build_model(dtype)
        self._refs: dict[int, Generation] = {}

    def prompt(self, n: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(n).integers(0, CONFIG.vocab_size, n)]

    def reference(self, n: int) -> Generation:
        if n not in self._refs:
            self._refs[n] = reference_generation(self.model, self.prompt(n), STEPS)
        return self._refs[n]


@pytest.fixture(scope="module", params=[("fp32", "shm"), ("bf16", "tcp")], ids=["fp32-shm", "bf16-tcp"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """One deployment (two daemons, P, D) per dtype, serving every request of that dtype; each dtype also runs on
    the other data plane."""
    dtype, backend = request.param
    with Deployment(tmp_path_factory.mktemp(f"pd-{dtype}"), dtype, backends=(backend,)) as dep:
        yield Setup(dtype, dep)


def checks(got: Disaggregated, ref: Generation) -> dict[str, bool]:
    return {
        "kv_bytes": got.kv_hashes == ref.kv_hashes,
        "logits": got.logits.shape == ref.logits.shape
        and np.array_equal(got.logits.view(np.uint32), ref.logits.view(np.uint32)),
        "tokens": got.tokens == ref.tokens,
    }


def test_every_process_builds_the_same_weights(setup: Setup) -> None:
    assert setup.dep.weight_hashes == {"prefill": weight_hash(setup.model), "decode": weight_hash(setup.model)}


@pytest.mark.parametrize("layer_split", [False, True], ids=["all-layers", "two-layer-ranges"])
@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
def test_decode_continues_exactly_like_one_process(setup: Setup, prompt_len: int, layer_split: bool) -> None:
    ref = setup.reference(prompt_len)
    got = setup.dep.generate(setup.prompt(prompt_len), STEPS, layer_split=layer_split)

    blocks = -(-prompt_len // 16)
    assert len(got.src_blocks) == len(got.dst_blocks) == blocks
    assert got.bytes_moved == blocks * 2 * CONFIG.num_hidden_layers * BLOCK_NBYTES[setup.dtype]
    assert got.backend == ("shm" if setup.dtype == "fp32" else "tcp")
    assert got.prefill_kv_hashes == ref.kv_hashes, "P's prefill differs from generate()'s"
    assert got.kv_hashes == ref.kv_hashes, "D rebuilt other K/V bytes than the prompt's"
    assert checks(got, ref)["logits"], f"decode logits differ: max {np.abs(got.logits - ref.logits).max()}"
    assert got.tokens == ref.tokens
    assert len(got.tokens) == STEPS + 1 >= 20


@pytest.mark.parametrize("fault", ["skip-block", "swap-blocks", "short-rebuild"])
@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
def test_a_broken_transfer_is_caught(setup: Setup, prompt_len: int, fault: str) -> None:
    got = setup.dep.generate(setup.prompt(prompt_len), STEPS, fault=fault)
    result = checks(got, setup.reference(prompt_len))
    assert not all(result.values()), f"{fault} went unnoticed: {result}"
    # The hashes catch every fault; the other two checks only some (see the module docstring).
    assert not result["kv_bytes"]


def test_the_documented_command(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m examples.pd_generation` is `main()`: its argument parsing, then `serve_and_compare` on a fresh
    deployment (run here on this module's, to spare two more model processes)."""
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--layer-split" in capsys.readouterr().out
    lines: list[str] = []
    assert serve_and_compare(setup.dep, setup.model, setup.prompt(21), STEPS, layer_split=True, out=lines.append)
    out = "\n".join(lines)
    assert f"bytes over {'shm' if setup.dtype == 'fp32' else 'tcp'} in" in out
    assert "8/8 tensors equal" in out and "bit-exact" in out and "tokens: identical" in out
    assert "(chosen by P's prefill)" in out and "<-- differs" not in out
    assert len(lines) == 5 + 1 + (STEPS + 1) + 1 + 4
