from typing import Literal

STEP: int

class FaultError(Exception):
    side: Literal["source", "destination"]
    copied: int
    size: int
    address: int
    signal: int

def copy(dst: int, src: int, n: int, /) -> None: ...
def handler_in_place() -> bool: ...
