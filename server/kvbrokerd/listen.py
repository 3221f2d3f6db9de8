"""Claiming the daemon's addresses before anything starts.

An address that something else holds is refused with one line that names it (`ListenError`: `kvbrokerd` prints it
and exits 2) instead of a gRPC core message and a traceback. A unix socket where another daemon answers is never
taken over: gRPC would silently unlink it, and the first daemon would become unreachable with nothing in its log.
A socket file with no listener behind it (a daemon that was SIGKILLed) is stale and is replaced.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import stat
from pathlib import Path

_PROBE_TIMEOUT_S = 1.0


class ListenError(OSError):
    """The daemon cannot listen on one of its addresses; the message names the address and says why."""


def unix_path(listen: str) -> Path:
    return Path(listen[len("unix://") :])


def claim_unix_socket(listen: str) -> None:
    """Creates the socket's directory; refuses a path where another process answers or that is not a socket; removes
    a stale socket file."""
    path = unix_path(listen)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"cannot listen on {listen}: {path} exists and is not a socket (remove it, or give "
                          "another --listen)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # stale: nobody accepts connections there
            return
        except (TimeoutError, BlockingIOError):
            pass  # a listener whose backlog is full: alive, only busy
        except OSError as e:
            raise ListenError(f"cannot listen on {listen}: cannot tell whether another daemon answers there "
                              f"({e.strerror or e})") from None
    raise ListenError(f"cannot listen on {listen}: another daemon answers there (stop it first, or give another "
                      "--listen)")


def check_tcp_free(address: str, what: str) -> None:
    """Refuses a host:port that another socket listens on, before gRPC tries (and logs a core error line).
    Port 0 (any free port) always passes; failures other than "in use" are left to the real bind."""
    host, _, port_text = address.rpartition(":")
    if not port_text.isdigit() or int(port_text) == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port_text), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As the real listener will: SO_REUSEADDR, so that only a live listener (not TIME_WAIT) conflicts.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise in_use(address, what) from None
                if e.errno == errno.EACCES:
                    raise ListenError(f"cannot listen on {address} ({what}): permission denied") from None


def in_use(address: str, what: str) -> ListenError:
    return ListenError(f"cannot listen on {address} ({what}): the address is in use by another process")
