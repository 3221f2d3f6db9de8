from typing import Literal

STEP: int

class FaultError(Exception):
    side: Literal["source", "destination"]
    copied: int
    size: int
    address: int
    signal: int
    run: int
    """The index of the run that faulted."""

def handler_in_place() -> bool: ...
def copy_runs(dst: object, src: object, n: object, /) -> None: ...
