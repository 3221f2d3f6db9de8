"""The walk of one PullKvBlocks request through the pulling daemon: the files of `kvbrokerd` and `kvbroker` its
Python passes through, in order, and how often it comes back to each (the goal: no file visited more than 3 times).

    PYTHONPATH=$PWD/client:$PWD/server .venv/bin/python bench/walk.py [--forms plain-shm,session-shm] [--show-walk]
    PYTHONPATH=<other tree>/client:<other tree>/server .venv/bin/python bench/walk.py   # the same walk, older code

Two real daemons per backend on loopback (source cluster 1, pulling cluster 2 linked to it; 2-tensor caches of
8192 blocks of 256 B). The pulling daemon runs under this script (`--trace-daemon FILE`: it installs a profile hook
and then runs `kvbrokerd` as `python -m kvbrokerd` would). Each form makes three untimed warm-up pulls and then the
one pull whose walk is measured:
  plain-shm     `pull_kv_blocks`, 64 scattered blocks as plain lists, shm backend
  plain-tcp     the same on the tcp backend
  runs-shm      4096 consecutive pairs in 4 runs: the client sends `block_runs` (`kvbroker.blockruns.find`)
  grant-shm     `pull_granted_kv_blocks` of a grant the source made (`create_grant`) over 64 blocks (never renewed:
                the walk includes the redeem round trip to the source)
  session-shm   one pull (64 blocks, plain lists) submitted on a pull session opened before the warm-ups

What is recorded (the hook, `_Tracer`): `sys.setprofile` and `threading.setprofile` call/return events of Python
frames whose code lives in a real file of the `kvbrokerd` or `kvbroker` packages. Left out: the generated protobuf
code (`kvbroker.v1`, `*_pb2*`) and code compiled from strings (`<string>`: dataclass and namedtuple methods).
A coroutine or generator frame's first call, final return, suspension and resumption are told apart (the RESUME
instruction's argument, the YIELD_VALUE instruction): the walk counts calls and returns, so that a coroutine that
waits and goes on is one visit (`--with-resumptions` counts each resumption and suspension as well).

Which events belong to the request: the hook sets a context variable, a fresh number, when the servicer method
(`KvBrokerService.PullKvBlocks` or `PullKvBlocksSession` in `service/local.py`) starts. asyncio copies the
context into every task and callback created from there (the pull session's reader and step tasks, the pull run on
the loop) and `copy_context().run` carries it into executor threads, while the daemon's own timers, heartbeats and
sweepers run in contexts without it: the request's events are those with its number. Events in threads other than
the loop's main thread are kept without a number too (an executor call that does not carry the context, e.g. a
plan computed in a worker thread): only the measured pull runs while it is measured. Every event has its
`time.monotonic_ns()` (one clock for all processes of the host); the bench notes the clock before and after the
measured call, and the walk is that window's events of the request, from the first to the one where the servicer
hands its answer to gRPC (its final return, or for a session the yield of the completion). The decorator around
the servicer (`llm_errors`) runs before the number is set, and is outside the walk.

A stay is a run of consecutive events in one file; a file's visits are its stays. Per form: stays, files, returns
to a file already left (stays - files), the most visited file, and every file visited more than three times.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import contextvars
import dis
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

TRACE_FLAG = "--trace-daemon"
SERVICERS = frozenset({"PullKvBlocks", "PullKvBlocksSession"})
SERVICER_MODULE = "kvbrokerd.service.local"
PACKAGES = ("kvbrokerd", "kvbroker")
GENERATED = "kvbroker.v1"
MOST_VISITS = 3
"""The goal: no file visited more often than this."""

BLOCKS = 8192
BLOCK_BYTES = 256
SCATTERED = 64
RUN_PAIRS = 4096
RUNS = 4
WARM_UPS = 3
FORMS = ("plain-shm", "plain-tcp", "runs-shm", "grant-shm", "session-shm")
PULL_TIMEOUT_S = 60.0

# ----------------------------------------------------------------------------------------------- in the daemon

_RESUME = dis.opmap.get("RESUME")  # 3.11+: its argument is 0 where a frame starts, else where it resumes
_YIELD = dis.opmap["YIELD_VALUE"]


class _Tracer:
    """The profile hook of the pulling daemon: keeps the request's events, writes them out when the daemon exits."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.events: list[tuple[int, int, int, str, str, str, bool]] = []
        self.request: contextvars.ContextVar[int] = contextvars.ContextVar("walk_request", default=0)
        self.numbers = itertools.count(1)
        self.loop_thread = threading.get_ident()
        self.places: dict[CodeType, tuple[str, bool]] = {}
        self.code_bytes: dict[CodeType, bytes] = {}

    def install(self) -> None:
        atexit.register(self.write)
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def place(self, frame: FrameType) -> tuple[str, bool]:
        """(file shown, or "" for code outside the walk; whether it is the servicer method) of a frame's code."""
        code = frame.f_code
        got = self.places.get(code)
        if got is None:
            module = str(frame.f_globals.get("__name__", ""))
            parts = module.split(".")
            name = os.path.basename(code.co_filename)
            ours = (parts[0] in PACKAGES and not module.startswith(GENERATED) and code.co_filename.endswith(".py"))
            shown = "/".join([*parts, name] if name == "__init__.py" else [*parts[:-1], name]) if ours else ""
            got = self.places[code] = (shown, module == SERVICER_MODULE and code.co_name in SERVICERS)
        return got

    def starts(self, frame: FrameType) -> bool:
        if frame.f_lasti < 0 or _RESUME is None:
            return frame.f_lasti < 0
        code = self.code_bytes.setdefault(frame.f_code, frame.f_code.co_code)
        return code[frame.f_lasti] != _RESUME or code[frame.f_lasti + 1] == 0

    def suspends(self, frame: FrameType) -> bool:
        code = self.code_bytes.setdefault(frame.f_code, frame.f_code.co_code)
        return frame.f_lasti >= 0 and code[frame.f_lasti] == _YIELD

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" and event != "return":
            return
        shown, servicer = self.place(frame)
        if not shown:
            return
        if event == "call":
            kind = "call" if self.starts(frame) else "resume"
            if servicer and kind == "call":
                self.request.set(next(self.numbers))
        elif not self.suspends(frame):
            kind = "return"
        else:  # an async generator's yield hands a value out: the servicer's answer to gRPC
            kind = "yield" if type(arg).__name__ == "async_generator_wrapped_value" else "suspend"
        number = self.request.get()
        thread = threading.get_ident()
        if number or thread != self.loop_thread:
            self.events.append((time.monotonic_ns(), thread, number, kind, shown, frame.f_code.co_name, servicer))

    def write(self) -> None:
        sys.setprofile(None)
        with open(self.out, "w") as f:
            for ev in self.events:
                f.write("\t".join(str(int(x) if isinstance(x, bool) else x) for x in ev) + "\n")


def trace_daemon(out: Path, command: list[str]) -> int:
    """Runs `python -m kvbrokerd ARGS` (`command`, as LocalDaemon builds it) in this process, traced."""
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # the bench's folder is no part of the daemon
    args = command[command.index("kvbrokerd") + 1 :]
    _Tracer(out).install()
    from kvbrokerd.__main__ import main

    return main(args)


# ---------------------------------------------------------------------------------------------- in the bench


@dataclass(frozen=True)
class Event:
    ns: int
    thread: int
    request: int
    kind: str
    file: str
    function: str
    servicer: bool


def read_trace(path: Path) -> list[Event]:
    events = []
    for line in path.read_text().splitlines():
        ns, thread, request, kind, file, function, servicer = line.split("\t")
        events.append(Event(int(ns), int(thread), int(request), kind, file, function, servicer == "1"))
    return events


def walk_of(events: list[Event], window: tuple[int, int]) -> list[Event]:
    """The measured request's events of `window` (see the module's docstring)."""
    inside = [e for e in events if window[0] <= e.ns <= window[1]]
    started = [e.request for e in inside if e.servicer and e.kind == "call"]
    counted = collections.Counter(e.request for e in inside if e.request)
    if not counted:
        raise RuntimeError("no event of a PullKvBlocks request while the pull was measured")
    request = started[0] if started else counted.most_common(1)[0][0]
    first = next(i for i, e in enumerate(inside) if e.request == request)
    last = next((i for i, e in enumerate(inside) if i >= first and e.request == request and e.servicer
                 and e.kind in ("return", "yield")), len(inside) - 1)
    return [e for e in inside[first : last + 1] if e.request in (request, 0)]


def stays(walk: list[Event], with_resumptions: bool) -> list[tuple[str, str]]:
    """(file, its first function) of each stay: consecutive counted events in one file."""
    kinds = {"call", "return", "yield"} | ({"resume", "suspend"} if with_resumptions else set())
    out: list[tuple[str, str]] = []
    for e in walk:
        if e.kind in kinds and (not out or out[-1][0] != e.file):
            out.append((e.file, e.function))
    return out


def summary(visited: list[tuple[str, str]]) -> dict[str, Any]:
    visits = collections.Counter(file for file, _ in visited)
    most, most_n = visits.most_common(1)[0] if visits else ("-", 0)
    return {"stays": len(visited), "files": len(visits), "returns": len(visited) - len(visits),
            "most": most, "most_visits": most_n,
            "over": {f: n for f, n in visits.most_common() if n > MOST_VISITS}, "visits": dict(visits.most_common())}


def log(msg: str) -> None:
    print(f"[walk] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def daemon_pair(workdir: Path, backend: str, trace: Path) -> Iterator[tuple[Any, Any]]:
    """(source client, pulling client) of two linked daemons, the puller traced."""
    from kvbroker import ClusterInfo
    from kvbroker._local import LocalDaemon

    wrapper = [sys.executable, str(Path(__file__).resolve()), TRACE_FLAG, str(trace)]
    with LocalDaemon(workdir, 1, backends=(backend,)) as p, \
            LocalDaemon(workdir, 2, backends=(backend,), wrapper=wrapper) as d, \
            p.client() as pc, d.client(timeout=PULL_TIMEOUT_S) as dc:
        link = dc.link_clusters([ClusterInfo(remote_cluster_id=1, remote_address=p.peer_address)])[0]
        if not link.ok:
            raise RuntimeError(f"linking the bench daemons: {link}")
        yield pc, dc
        if d.stop() != 0:  # the hook writes its events as the daemon exits
            raise RuntimeError(f"the traced daemon did not exit cleanly:\n{d.log_tail()}")


def measured(pull: Callable[[], object]) -> tuple[int, int]:
    for _ in range(WARM_UPS):
        pull()
    start = time.monotonic_ns()
    pull()
    return start, time.monotonic_ns()


def pull_of(form: str, pc: Any, dc: Any, src: Any, dst: Any, stack: contextlib.ExitStack) -> Callable[[], object]:
    """The pull a form makes (the same each time it is called), its session or grant made first."""
    import numpy as np

    from kvbroker import CacheIndex, SessionPull

    index = CacheIndex(1, src.cache_id)
    scattered_src = list(range(BLOCKS - 2, BLOCKS - 2 * SCATTERED - 2, -2))  # descending, every other: no run
    scattered_dst = list(range(0, 2 * SCATTERED, 2))
    if form.startswith("plain-"):
        return lambda: dc.pull_kv_blocks(index, dst, scattered_src, scattered_dst)
    if form == "runs-shm":
        run_len = RUN_PAIRS // RUNS
        runs_src = np.concatenate([np.arange(2 * r * run_len, (2 * r + 1) * run_len) for r in range(RUNS)])
        runs_dst = np.arange(RUN_PAIRS)
        return lambda: dc.pull_kv_blocks(index, dst, runs_src, runs_dst)
    if form == "grant-shm":
        grant = pc.create_grant([src.cache_id], scattered_src, 600.0)
        return lambda: dc.pull_granted_kv_blocks(1, grant, dst, scattered_dst)
    session = dc.open_pull_session()
    stack.callback(session.close, PULL_TIMEOUT_S)
    one = SessionPull(src_cache_index=index, dst_cache=dst.cache_id, src_blocks=tuple(scattered_src),
                      dst_blocks=tuple(scattered_dst))
    return lambda: session.submit([one])[0].result(PULL_TIMEOUT_S)


def run_backend(backend: str, forms: list[str], workdir: Path) -> dict[str, list[Event]]:
    """Each form of `forms` on `backend`: the walk of its measured pull."""
    from kvbroker import CacheDesc, DataType

    trace = workdir / f"trace-{backend}.tsv"
    windows: dict[str, tuple[int, int]] = {}
    desc = CacheDesc(num_tensors=2, shape=(BLOCKS, BLOCK_BYTES), data_type=DataType.UINT8)
    with daemon_pair(workdir / backend, backend, trace) as (pc, dc):
        src, dst = pc.allocate_cache(desc), dc.allocate_cache(desc)
        for form in forms:
            log(f"{form}: {WARM_UPS} warm-up pulls, then the measured one")
            with contextlib.ExitStack() as stack:
                windows[form] = measured(pull_of(form, pc, dc, src, dst, stack))
    events = read_trace(trace)
    return {form: walk_of(events, window) for form, window in windows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", default=",".join(FORMS), help=f"some of {','.join(FORMS)}")
    ap.add_argument("--with-resumptions", action="store_true", help="count coroutine resumptions as visits too")
    ap.add_argument("--show-walk", action="store_true", help="print each form's stays in order")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    forms = args.forms.split(",")
    if unknown := set(forms) - set(FORMS):
        ap.error(f"unknown forms {sorted(unknown)}")
    import kvbrokerd

    log(f"kvbrokerd from {Path(kvbrokerd.__file__).parent}; load average {os.getloadavg()[0]:.2f}")
    walks: dict[str, list[Event]] = {}
    with tempfile.TemporaryDirectory(prefix="walk-") as tmp:
        for backend in ("shm", "tcp"):
            mine = [f for f in FORMS if f in forms and f.endswith(f"-{backend}")]
            if mine:
                walks.update(run_backend(backend, mine, Path(tmp)))
    results = {form: {**summary(stays(walks[form], args.with_resumptions)),
                      "with_resumptions": len(stays(walks[form], True))} for form in FORMS if form in walks}
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'form':12s} {'stays':>5s} {'files':>5s} {'back':>5s} {'+resum':>6s}  "
          f"most visited; visited > {MOST_VISITS}")
    for form, r in results.items():
        over = ", ".join(f"{f} {n}" for f, n in r["over"].items()) or "none"
        print(f"{form:12s} {r['stays']:5d} {r['files']:5d} {r['returns']:5d} {r['with_resumptions']:6d}  "
              f"{r['most']} {r['most_visits']}; {over}")
    if args.show_walk:
        for form in results:
            print(f"\n{form}:")
            for file, function in stays(walks[form], args.with_resumptions):
                print(f"  {file}  {function}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == TRACE_FLAG:
        sys.exit(trace_daemon(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(main())
