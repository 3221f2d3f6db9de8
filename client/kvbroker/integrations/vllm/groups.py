"""Several KV cache groups (vLLM's hybrid allocator): which tokens of each group a request's pull moves.

A full-attention group needs every prompt token the pull covers. A sliding-window group of window W needs only the
tokens the next ones can still see: the last W - 1 of the prompt. vLLM has already dropped the blocks before the
window on both sides (their ids are NULL_BLOCK), and the prefill engine may have dropped more or fewer than this engine
(block sizes differ), so a group's range starts at the window, or later where either side's first kept block starts
later, and is refused (the request is then recomputed) if that leaves out a token the window needs. A Mamba group
holds one block per request, its running state: that block moves whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbroker.integrations.vllm.layout import MAMBA, KvLayout
from kvbroker.integrations.vllm.params import NULL_BLOCK, PullPart


class GroupMismatch(ValueError):
    """The two engines' block lists cannot be lined up for this request (it is recomputed)."""


def group_parts(ours: KvLayout, theirs: KvLayout, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]],
                start: int, end: int) -> tuple[PullPart, ...]:
    """One PullPart per group for the prompt tokens [start, end) (`start` at one of our blocks: the tokens before
    are in the local prefix cache). `local[g]`, `remote[g]`: group g's block ids from the request's first token."""
    windows = ours.windows
    if len(local) != len(windows) or len(remote) != len(windows):
        raise GroupMismatch(f"{len(windows)} KV cache groups here, the request has {len(local)} local and "
                            f"{len(remote)} remote block lists")
    align = max(ours.block_size, theirs.block_size)
    parts = []
    for g, window in enumerate(windows):
        if ours.kinds[g] == MAMBA:
            parts.append(_state_part(g, local[g], remote[g], start, end))
            continue
        first = start
        if window is not None:
            # Whole blocks of the larger size: a range that starts inside a block of either side would not line up.
            first = max(start, (end - window) // align * align)
        first = max(first, _first_kept(local[g], ours.block_size, first), _first_kept(remote[g], theirs.block_size,
                                                                                     first))
        needed = start if window is None else max(start, end - window + 1)
        if first > needed:
            raise GroupMismatch(f"group {g}: the blocks kept cover tokens from {first}, the request needs them from "
                                f"{needed}")
        mine = local[g][first // ours.block_size: -(-end // ours.block_size)]
        src = remote[g][first // theirs.block_size: -(-end // theirs.block_size)]
        if len(mine) != -(-end // ours.block_size) - first // ours.block_size or len(src) != (
                -(-end // theirs.block_size) - first // theirs.block_size):
            raise GroupMismatch(f"group {g}: {len(local[g])} local and {len(remote[g])} remote blocks do not cover "
                                f"tokens [{first}, {end})")
        if NULL_BLOCK in mine or NULL_BLOCK in src:
            raise GroupMismatch(f"group {g}: a block of tokens [{first}, {end}) was dropped")
        parts.append(PullPart(tuple(mine), tuple(src), first, end))
    return tuple(parts)


def _state_part(g: int, local: Sequence[int], remote: Sequence[int], start: int, end: int) -> PullPart:
    mine, src = [b for b in local if b != NULL_BLOCK], [b for b in remote if b != NULL_BLOCK]
    if len(mine) != 1 or len(src) != 1:
        raise GroupMismatch(f"group {g}: a Mamba state is one block, the request has {len(mine)} local and "
                            f"{len(src)} remote")
    return PullPart((mine[0],), (src[0],), start, end, state=True)


def _first_kept(blocks: Sequence[int], block_size: int, at: int) -> int:
    """The first token, from `at` on, of a block that is not NULL_BLOCK (the dropped ones are a prefix)."""
    i = at // block_size
    while i < len(blocks) and blocks[i] == NULL_BLOCK:
        i += 1
    return max(at, i * block_size)
