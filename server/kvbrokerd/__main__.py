"""`kvbrokerd` / `python -m kvbrokerd`: run the daemon until SIGTERM."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from kvbrokerd import logs
from kvbrokerd.config import ConfigError, load, to_toml
from kvbrokerd.daemon import Daemon
from kvbrokerd.listen import ListenError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, print_config = load(argv)
    except ConfigError as e:
        print(f"kvbrokerd: invalid configuration: {e}", file=sys.stderr)
        return 2
    if print_config:
        print(to_toml(config))
        return 0
    logs.setup(config.log_level, config.log_format)
    daemon = Daemon(config)
    try:
        run(daemon.run_until_signal())
    except ListenError as e:
        print(f"kvbrokerd: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvbrokerd: cannot start: {e}", file=sys.stderr)
        return 1
    return 0


def run(main: Coroutine[Any, Any, None]) -> None:
    """Runs `main` on uvloop (installed before the loop starts, as grpc.aio requires)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a server dependency; plain asyncio still works
        asyncio.run(main)
        return
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main)
    else:  # pragma: no cover
        uvloop.install()
        asyncio.run(main)


if __name__ == "__main__":
    sys.exit(main())
