"""A transfer's parts run side by side: the first on the calling thread, the rest on the parts pool."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

_Part = TypeVar("_Part")


def run_parts(executor: concurrent.futures.Executor, work: Callable[[_Part], None], parts: list[_Part]) -> None:
    """Runs work(part) for every part, the first on this thread and the others on `executor`, and returns only
    when every one has stopped (callers unpin memory after that); then raises the first error, if any."""
    futures = [executor.submit(work, p) for p in parts[1:]]
    errors: list[BaseException] = []
    try:
        work(parts[0])
    except BaseException as e:
        errors.append(e)
    concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            errors.append(f.exception())  # type: ignore[arg-type]
    if errors:
        raise errors[0]
