"""Disaggregated generation through kvbroker, checked against single-process generation.

Starts two kvbrokerd daemons (two "nodes"), a prefill worker next to one and a decode worker next to the other,
serves one prompt through them and prints, side by side, the tokens of transformers' generate() in this process and
the tokens of the prefill -> kvbroker -> decode pipeline, with the bytes moved and the pull time.

    python -m examples.pd_generation [--dtype bf16] [--prompt-len 37] [--steps 24] [--layer-split]

Exit status 0 when the pulled K/V bytes, the decode logits and the tokens all equal the single-process ones.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from transformers import LlamaForCausalLM

from examples.pd_generation.decode import FAULTS
from examples.pd_generation.deployment import Deployment
from examples.pd_generation.model import DTYPES, build_model, reference_generation, weight_hash
from examples.pd_generation.paged import BLOCK_SIZE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.pd_generation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--prompt-len", type=int, default=37, help="prompt tokens (random ids); default 37")
    parser.add_argument("--steps", type=int, default=24, help="tokens D decodes after P's first one; default 24")
    parser.add_argument("--layer-split", action="store_true", help="pull layers 0-1, then 2-3, in two calls")
    parser.add_argument("--backend", choices=["shm", "tcp"], default="shm",
                        help="the data plane the daemons may use; default shm")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt seed; default 0")
    parser.add_argument("--fault", choices=FAULTS, help="break the transfer on purpose and watch the checks fail")
    args = parser.parse_args(argv)

    model = build_model(args.dtype, args.seed)
    prompt = [int(t) for t in np.random.default_rng(args.seed).integers(0, model.config.vocab_size, args.prompt_len)]
    with tempfile.TemporaryDirectory(prefix="kvbroker-pd-") as tmp, \
            Deployment(Path(tmp), args.dtype, backends=(args.backend,), seed=args.seed) as dep:
        ok = serve_and_compare(dep, model, prompt, args.steps, layer_split=args.layer_split, fault=args.fault)
    return 0 if ok else 1


def serve_and_compare(dep: Deployment, model: LlamaForCausalLM, prompt: list[int], steps: int, *,
                      layer_split: bool = False, fault: str | None = None,
                      out: Callable[[str], None] = print) -> bool:
    """Serves `prompt` through P and D, generates it with `model` in this process, prints both; True if equal."""
    ref = reference_generation(model, prompt, steps)
    got = dep.generate(prompt, steps, layer_split=layer_split, fault=fault)
    c, weights = model.config, weight_hash(model)
    same_weights = set(dep.weight_hashes.values()) == {weights}
    out(f"model: seeded tiny Llama (hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_key_value_heads} "
        f"KV heads, vocab {c.vocab_size}), {dep.dtype}; weight hash {weights} "
        f"{'in all three processes' if same_weights else 'DIFFERS between processes'}")
    out(f"prompt: {len(prompt)} random token ids -> {len(got.src_blocks)} blocks of {BLOCK_SIZE} tokens")
    out(f"P (prefill, next to kvbrokerd {dep.node_a.cluster_id}) wrote the prompt's K/V into its blocks "
        f"{got.src_blocks}")
    out(f"D (decode, next to kvbrokerd {dep.node_b.cluster_id}) pulled them into its blocks {got.dst_blocks}: "
        f"{got.bytes_moved:,} bytes over {got.backend} in {got.pull_s * 1e3:.2f} ms"
        f"{' (two layer-range pulls)' if layer_split else ''}")
    out("")
    out(f"{'step':>4}  {'generate() in one process':>25}  {'P -> kvbroker -> D':>18}")
    for i, (want, have) in enumerate(zip(ref.tokens, got.tokens, strict=True)):
        note = "  (chosen by P's prefill)" if i == 0 else "" if want == have else "  <-- differs"
        out(f"{i:>4}  {want:>25}  {have:>18}{note}")
    out("")
    kv_ok = got.kv_hashes == ref.kv_hashes
    logits_ok = ref.logits.shape == got.logits.shape and np.array_equal(ref.logits.view(np.uint32),
                                                                        got.logits.view(np.uint32))
    tokens_ok = got.tokens == ref.tokens
    equal_kv = sum(a == b for a, b in zip(got.kv_hashes, ref.kv_hashes, strict=True))
    out(f"K/V bytes per layer (sha256): {equal_kv}/{len(ref.kv_hashes)} tensors equal")
    out(f"decode logits ({got.logits.shape[0]} steps x {got.logits.shape[1]}): "
        + ("bit-exact" if logits_ok else f"differ, max |diff| {np.abs(ref.logits - got.logits).max():.3g}"))
    out(f"tokens: {'identical' if tokens_ok else 'differ'}")
    ok = kv_ok and logits_ok and tokens_ok and same_weights
    out("OK: decode continued the request exactly as one process would" if ok else "MISMATCH")
    return ok


if __name__ == "__main__":
    sys.exit(main())
