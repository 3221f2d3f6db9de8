"""Where a cache's bytes are: what a copy needs to know of either side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One side of a copy: where each tensor's bytes are, in this process and in their segment files."""

    label: str
    """Names the memory in errors ("cache 12", "remote cache 7 of cluster 2")."""
    addresses: list[int]
    """Base address of each tensor's mapping here (needed of a destination, and of a source that `maps_to_copy`);
    empty when not mapped."""
    fds: list[int]
    """Descriptor of each tensor's segment file."""
    offsets: list[int]
    """Offset of each tensor in its segment file."""
    stable: bool
    """Only daemons can resize this memory: memmove may touch it."""
    check: Callable[[], None]
    """Raises LlmError when a segment is now smaller than the tensors in it need."""
    holds: object = None
    """Whatever keeps the descriptors and mappings above open: held for as long as the endpoint is used."""


def side_by_side(endpoints: Sequence[Endpoint]) -> Endpoint:
    """Several caches' endpoints as one whose tensors are theirs one cache after the other (a pull from several of a
    peer's caches in one copy). Mapped only if every one is, stable only if every one is: a copy then treats each as
    it would alone, or more carefully."""
    if len(endpoints) == 1:
        return endpoints[0]
    checks = [e.check for e in endpoints]

    def check() -> None:
        for one in checks:
            one()

    mapped = all(e.addresses for e in endpoints)
    return Endpoint(label=", ".join(e.label for e in endpoints),
                    addresses=[a for e in endpoints for a in e.addresses] if mapped else [],
                    fds=[f for e in endpoints for f in e.fds], offsets=[o for e in endpoints for o in e.offsets],
                    stable=all(e.stable for e in endpoints), check=check, holds=[e.holds for e in endpoints])
