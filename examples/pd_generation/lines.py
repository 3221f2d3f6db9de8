"""The workers' protocol: one JSON request per line on stdin, one JSON answer per line on stdout."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]


def serve(ready: Callable[[], Message], handle: Callable[[Message], Message]) -> None:
    """Sends `ready()` once set up, then answers every request until stdin closes."""
    out = sys.stdout
    # Anything a library prints would corrupt the protocol: send it to stderr (the worker's log) instead.
    sys.stdout = sys.stderr
    out.write(json.dumps(ready()) + "\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(handle(json.loads(line))) + "\n")
        out.flush()
