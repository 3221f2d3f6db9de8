"""Pipeline parallelism: which of the model's layers each stage of an engine holds, and the layer ranges a pull maps.

An engine split by layers (vLLM's `--pipeline-parallel-size`) has one worker per (stage, TP rank), each with a KV cache
of its stage's layers only. The layout tag names the split (`pp=0,14` for a 28-layer model in two stages: the first
layer of each stage) and `layers` stays the model's count, so engines of any split compare equal. A decode worker
pulls each layer it holds from the prefill stage that holds it: one pull per (prefill stage, TP rank) whose layers
overlap its own, the two caches' layer ranges given as LLM-DataDist's `KvCacheExtParam` ranges.

Only attention KV of one KV cache group is split this way (the tensor of a layer is then the layer's index in its
stage); a split engine with several groups or Mamba state is refused at start-up (`layout_from_vllm`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbroker.types import KvCacheExtParam

MAX_STAGES = 64
NO_SPLIT = "-"
_FIELD = re.compile(r"0(,[1-9][0-9]{0,5}){1,63}")


@dataclass(frozen=True, slots=True)
class Stages:
    """The first layer of each stage of a model of `layers` layers (one stage: not split)."""

    starts: tuple[int, ...]
    layers: int

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0 or len(self.starts) > MAX_STAGES or self.layers <= self.starts[-1]:
            raise ValueError(f"pipeline stages {self.starts[:8]} do not split {self.layers} layers")
        if any(b <= a for a, b in zip(self.starts, self.starts[1:], strict=False)):
            raise ValueError(f"pipeline stages {self.starts[:8]} are not in increasing order")

    @property
    def count(self) -> int:
        return len(self.starts)

    def layers_of(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.layers
        return range(self.starts[stage], end)

    def field(self) -> str:
        """The tag's `pp` field."""
        return ",".join(map(str, self.starts)) if self.count > 1 else NO_SPLIT


def whole(layers: int) -> Stages:
    return Stages((0,), layers)


def parse(field: str, layers: int) -> Stages:
    """The stages a tag's `pp` field names (`-` or absent: one); ValueError if malformed or not a split of `layers`."""
    if field == NO_SPLIT:
        return whole(layers)
    if not _FIELD.fullmatch(field):
        raise ValueError(f"malformed pp {field[:80]!r}")
    return Stages(tuple(int(s) for s in field.split(",")), layers)


@dataclass(frozen=True, slots=True)
class LayerPull:
    """The layers one pull moves: from prefill stage `stage`'s cache into ours, as the pull's layer ranges."""

    stage: int
    ext_param: KvCacheExtParam


def layer_pulls(ours: Stages, our_stage: int, theirs: Stages) -> list[LayerPull]:
    """The pulls that fill every layer our stage holds, one per prefill stage holding some of them."""
    mine = ours.layers_of(our_stage)
    pulls = []
    for stage in range(theirs.count):
        held = theirs.layers_of(stage)
        first, last = max(mine.start, held.start), min(mine.stop, held.stop) - 1
        if first > last:
            continue
        pulls.append(LayerPull(stage, KvCacheExtParam(src_layer_range=(first - held.start, last - held.start),
                                                      dst_layer_range=(first - mine.start, last - mine.start),
                                                      tensor_num_per_layer=1)))
    return pulls
