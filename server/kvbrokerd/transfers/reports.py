"""What a failed transfer reports: which destination blocks and layers did not land.

Plain values of the domain; the service edge (`service/errors.py`) turns them into the wire's
`kvbroker.v1.TransferReport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def block_array(blocks: Sequence[int] | np.ndarray) -> np.ndarray:
    """`blocks` as a read-only 1-d uint64 array, in their order (copied unless it is one already)."""
    if isinstance(blocks, np.ndarray) and blocks.dtype == np.uint64 and blocks.ndim == 1 \
            and not blocks.flags.writeable:
        return blocks
    array = np.array(blocks, dtype=np.uint64).reshape(-1)
    array.flags.writeable = False
    return array


def _no_blocks() -> np.ndarray:
    return block_array(())


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: numpy arrays have no truth value
class GroupReport:
    """The outcome of one group of a batched transfer."""

    index: int
    """Index of the group in the request."""
    done: bool
    """True when every byte of the group landed."""
    failed_dst_blocks: np.ndarray = field(default_factory=_no_blocks)
    """Destination blocks of the group that did not (completely) land (uint64, read-only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed_dst_blocks", block_array(self.failed_dst_blocks))


@dataclass(frozen=True, slots=True, eq=False)
class TransferReport:
    """Which parts of a transfer landed before it failed, so that a caller never has to guess about half-writes."""

    transfer_id: str
    """Transfer id, as logged by the daemon."""
    backend: str = ""
    """Backend that ran the transfer ("" for a batch, whose groups may use several)."""
    stage: str = "transfer"
    """Stage that failed."""
    failed_dst_blocks: np.ndarray = field(default_factory=_no_blocks)
    """Destination blocks that were not written (or not completely), in order (uint64, read-only)."""
    bytes_moved: int = 0
    """Bytes that landed before the failure."""
    completed_layers: tuple[int, ...] = ()
    """Destination layers that landed completely (layer-wise transfers), in order."""
    groups: tuple[GroupReport, ...] = ()
    """For a batched transfer: the outcome of each group, in request order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed_dst_blocks", block_array(self.failed_dst_blocks))
