from typing import Literal

STEP: int

class FaultError(Exception):
    side: Literal["source", "destination"]
    copied: int
    size: int
    address: int
    signal: int
    run: int
    """The index of the run (copy_strided: the entry) that faulted."""
    repeat: int
    """copy_strided only: the repetition of that entry that faulted (the ones before it landed)."""

def handler_in_place() -> bool: ...
def copy_runs(dst: object, src: object, n: object, /) -> None: ...
def copy_strided(dst: object, src: object, n: object, count: object, dst_step: object, src_step: object, /) -> None: ...
