from typing import Literal

STEP: int

class FaultError(Exception):
    side: Literal["source", "destination"]
    copied: int
    size: int
    address: int
    signal: int
    run: int
    """copy_runs() only: the index of the run that faulted."""

def copy(dst: int, src: int, n: int, /) -> None: ...
def handler_in_place() -> bool: ...
def copy_runs(dst: object, src: object, n: object, /) -> None: ...
