"""What a vLLM worker's paged KV buffer looks like, as a kvbroker cache, and the tag that makes two of them
compatible.

vLLM places every layer of a KV cache group in one backing allocation: layer `l`'s page of block `b` starts at
`offset + l * layer_stride + b * block_stride`. When layers are outermost (each layer one contiguous region of
`num_blocks` pages, which is what vLLM's CPU attention does) the buffer is exactly a kvbroker cache with one tensor
per layer (`tensor_num_per_layer=1`) laid out back to back: the daemon allocates it, vLLM views it, nothing is
copied. Other layouts are refused with a message instead of being transferred wrongly.

The layout tag travels with the cache (kvbrokerd refuses pulls between caches whose tags differ) and in the
prefill node's `kv_transfer_params` (the decode node compares before pulling, and says which field differs).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from kvbroker.types import CacheDesc, DataType

LAYOUT_VERSION = 1
# kvbrokerd lays the tensors of an allocated cache out at multiples of this many bytes.
DAEMON_TENSOR_ALIGN = 4096

_DTYPES = {
    "float16": DataType.FLOAT16, "bfloat16": DataType.BFLOAT16, "float32": DataType.FLOAT32,
    "int8": DataType.INT8, "uint8": DataType.UINT8, "float8_e4m3fn": DataType.FLOAT8_E4M3FN,
    "float8_e5m2": DataType.FLOAT8_E5M2,
}
# Config entries that name where a model was loaded from rather than what it is.
_NOT_IDENTITY = {"name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures_path"}


class UnsupportedLayoutError(ValueError):
    """The engine's KV buffer cannot be served as one kvbroker cache without copying."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    """Per tensor-parallel rank."""
    head_size: int
    dtype: str
    """torch dtype name of the KV cache ("bfloat16", ...)."""
    page_bytes: int
    """Bytes of one block of one layer."""
    model_id: str
    tp_size: int
    physical: str = ""
    """GPU engines only: vLLM's resolved KV cache layout and the runs it gives (`gpu.physical_tag`); the bytes of a
    block are in that order, so both sides must share it."""

    @property
    def buffer_bytes(self) -> int:
        return self.page_bytes * self.num_blocks * self.num_layers

    def desc(self) -> CacheDesc:
        dtype = _DTYPES[self.dtype]
        natural = (self.num_kv_heads, self.block_size, 2 * self.head_size)
        page_shape = natural if math.prod(natural) * dtype.itemsize == self.page_bytes else (
            self.page_bytes // dtype.itemsize,)
        return CacheDesc(num_tensors=self.num_layers, shape=(self.num_blocks, *page_shape), data_type=dtype,
                         layout_tag=self.tag())

    def tag(self) -> str:
        """Everything a peer's KV must share with ours to be usable here (not the block count)."""
        fields = compat_fields(self)
        return f"vllm-kv/{LAYOUT_VERSION} " + " ".join(f"{k}={v}" for k, v in fields.items())


def compat_fields(layout: KvLayout) -> dict[str, str]:
    return {"model": layout.model_id, "dtype": layout.dtype, "block": str(layout.block_size),
            "kv_heads": str(layout.num_kv_heads), "head": str(layout.head_size), "layers": str(layout.num_layers),
            "page": str(layout.page_bytes), "tp": str(layout.tp_size)} | (
                {"phys": layout.physical} if layout.physical else {})


def explain_mismatch(ours: str, theirs: str) -> str:
    """A readable list of the fields in which two layout tags differ ("" when they are equal)."""
    if ours == theirs:
        return ""
    a, b = _parse(ours), _parse(theirs)
    diffs = [f"{k}: local {a.get(k, '?')} vs remote {b.get(k, '?')}" for k in sorted(a.keys() | b.keys())
             if a.get(k) != b.get(k)]
    return "; ".join(diffs) or f"local {ours!r} vs remote {theirs!r}"


def _parse(tag: str) -> dict[str, str]:
    version, _, rest = tag.partition(" ")
    out = {"version": version}
    for item in rest.split():
        k, _, v = item.partition("=")
        out[k] = v
    return out


def model_identity(hf_config: Any) -> str:
    """A short hash of the model's architecture config: equal for the same model loaded from different paths."""
    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    ident = {k: v for k, v in raw.items() if not k.startswith("_") and k not in _NOT_IDENTITY}
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def layout_from_vllm(kv_cache_config: Any, model_id: str, tp_size: int, on_gpu: bool = False) -> KvLayout:
    """Reads vLLM's KVCacheConfig; raises UnsupportedLayoutError for anything not served without a copy. On a GPU
    engine vLLM keeps its own buffer and `cuda_layout.read_runs` judges its placement: only the spec is read here."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedLayoutError(
            f"{len(groups)} KV cache groups (hybrid or sliding-window models); only one attention group is supported")
    spec = groups[0].kv_cache_spec
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if not hasattr(spec, attr):
            raise UnsupportedLayoutError(f"KV cache spec {type(spec).__name__} is not a paged attention spec")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise UnsupportedLayoutError(f"KV cache dtype {dtype} is not supported (supported: {', '.join(_DTYPES)})")
    if on_gpu:
        return KvLayout(num_layers=len(groups[0].layer_names), num_blocks=int(kv_cache_config.num_blocks),
                        block_size=int(spec.block_size), num_kv_heads=int(spec.num_kv_heads),
                        head_size=int(spec.head_size), dtype=dtype, page_bytes=int(spec.page_size_bytes),
                        model_id=model_id, tp_size=tp_size)
    tensors = kv_cache_config.kv_cache_tensors
    if len(tensors) != 1:
        raise UnsupportedLayoutError(f"{len(tensors)} KV backing allocations; one is supported")
    t = tensors[0]
    page = int(spec.page_size_bytes)
    num_layers = len(t.layers)
    num_blocks = int(kv_cache_config.num_blocks_of(t)) if hasattr(kv_cache_config, "num_blocks_of") else int(
        kv_cache_config.num_blocks)
    layer_outermost = t.offset == 0 and t.block_stride == page and t.layer_stride == page * num_blocks
    if not layer_outermost or t.size != t.layer_stride * num_layers:
        raise UnsupportedLayoutError(
            f"KV buffer is not layer-outermost (offset {t.offset}, block stride {t.block_stride}, layer stride "
            f"{t.layer_stride}, page {page}, {num_blocks} blocks, size {t.size})")
    if t.layer_stride % DAEMON_TENSOR_ALIGN:
        raise UnsupportedLayoutError(
            f"a layer's KV region ({t.layer_stride} bytes) is not a multiple of {DAEMON_TENSOR_ALIGN} bytes, so the "
            "daemon cannot lay the layers out back to back; choose a block size whose page is a multiple of 4 KiB")
    return KvLayout(num_layers=num_layers, num_blocks=num_blocks, block_size=int(spec.block_size),
                    num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size), dtype=dtype, page_bytes=page,
                    model_id=model_id, tp_size=tp_size)
