"""Hand-over timestamps of one decode request through a vLLM engine and its KV connector (`vllm_bench.py --trace`).

Wraps, inside the engine process, the engine core's step and the functions where a request's KV changes hands:
the scheduler (schedule, update_from_output), the executor (execute_model: a step with tokens is the model's
forward), the worker-side connector (start_load_kv, get_transfer_results) and, for KvBrokerConnector, its scheduler
hooks and threads (the grant keeper's renewal and release, the load thread's send, the pull session's message leaving
for gRPC and its completion coming back, the outcome reported to the engine). Each call's entry and exit are
stamped (time.perf_counter); the driver turns one request's stamps into the stages of `stages`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

Event = tuple[str, float, int]
"""(label + ">" on entry or "<" on exit, time.perf_counter(), a count the label reports: tokens scheduled, pulls
finished; -1 when none)."""


class Trace:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def clear(self) -> None:
        self.events = []

    def wrap(self, owner: Any, name: str, label: str, count: Callable[[Any], int] | None = None) -> None:
        """Stamps every call of `owner.name` (a class or an instance) from now on."""
        original = getattr(owner, name)
        events = self

        @functools.wraps(original)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            events.events.append((label + ">", time.perf_counter(), -1))
            result = original(*args, **kwargs)
            events.events.append((label + "<", time.perf_counter(), -1 if count is None else count(result)))
            return result

        setattr(owner, name, stamped)

    def wrap_generator(self, owner: Any, name: str, label: str) -> None:
        """Stamps each item a generator method yields, as it leaves (here: a session's message taken by gRPC)."""
        original = getattr(owner, name)
        events = self

        @functools.wraps(original)
        def stamped(*args: Any, **kwargs: Any) -> Iterator[Any]:
            for item in original(*args, **kwargs):
                events.events.append((label, time.perf_counter(), -1))
                yield item

        setattr(owner, name, stamped)

    def relative(self, started: float) -> list[tuple[str, float, int]]:
        return [(label, round((t - started) * 1e3, 3), n) for label, t, n in self.events if t >= started]


def install(trace: Trace, engine_core: Any, worker_connector: Any) -> None:
    """Wraps the engine's and the connector's hand-over points (KvBrokerConnector's threads where it is one)."""
    trace.wrap(engine_core, "step_fn", "step")
    trace.wrap(engine_core.scheduler, "schedule", "schedule", lambda out: int(out.total_num_scheduled_tokens))
    trace.wrap(engine_core.model_executor, "execute_model", "execute")
    trace.wrap(engine_core.scheduler, "update_from_output", "update")
    trace.wrap(worker_connector, "start_load_kv", "start_load")
    # (NixlConnector answers get_transfer_results itself; vLLM's default asks get_finished)
    trace.wrap(worker_connector, "get_transfer_results", "transfer_results",
               lambda out: len(out.finished_recving or ()))
    if type(worker_connector).__name__ != "KvBrokerConnector":
        return
    from kvbroker._session import PullSession, _Pending
    from kvbroker.integrations.vllm.grants import GrantKeeper
    from kvbroker.integrations.vllm.loads import StepLoads
    from kvbroker.integrations.vllm.scheduler import SchedulerSide
    from kvbroker.integrations.vllm.worker import WorkerSide

    for name in ("on_new_request", "num_new_matched_tokens", "after_alloc", "take_plan"):
        trace.wrap(SchedulerSide, name, f"scheduler.{name}")
    trace.wrap(GrantKeeper, "_renew", "renew")
    trace.wrap(GrantKeeper, "_release", "release")
    trace.wrap(StepLoads, "submit", "loads.submit")
    trace.wrap(StepLoads, "_send", "loads.send")
    trace.wrap(PullSession, "submit", "session.submit")
    trace.wrap_generator(PullSession, "_outgoing", "session.sent")
    trace.wrap(_Pending, "complete", "session.completed")
    trace.wrap(WorkerSide, "_report", "reported")


def _first(events: list[tuple[str, float, int]], label: str, after: float = 0.0,
           where: Callable[[int], bool] | None = None) -> float | None:
    return next((t for lab, t, n in events if lab == label and t >= after and (where is None or where(n))), None)


def stages(events: list[tuple[str, float, int]], ttft_ms: float) -> dict[str, float | None]:
    """One request's stages, ms (None where a stamp is missing, e.g. NIXL has no session): each ends where the next
    starts, from the hand-over to the engine (0) to its token (`ttft_ms`)."""
    load = _first(events, "start_load>")
    points: dict[str, float | None] = {"load handed over": load}
    if load is not None:
        sent = _first(events, "session.sent", load)
        completed = _first(events, "session.completed>", sent or load)
        points |= {
            "load thread took it": _first(events, "loads.send>", load),
            "message to gRPC": sent,
            "completion back": completed,
            "outcome reported": _first(events, "reported<", completed or load),
        }
    received = _first(events, "transfer_results<", load or 0.0, lambda n: n > 0)
    forward = _first(events, "execute>", received or 0.0)
    # The step that computes the request's token: the first with tokens scheduled after the KV arrived.
    scheduled = _first(events, "schedule<", received or 0.0, lambda n: n > 0)
    points |= {"engine learns (transfer results)": received, "token step scheduled": scheduled,
               "forward starts": forward if scheduled is not None else None,
               "forward ends": _first(events, "execute<", forward) if forward is not None else None,
               "token out": ttft_ms}
    out: dict[str, float | None] = {}
    previous = 0.0
    for name, at in points.items():
        out[name] = None if at is None else round(at - previous, 2)
        previous = at if at is not None else previous
    return out


def inside(events: list[tuple[str, float, int]], label: str, until: float) -> float:
    """ms spent inside `label`'s calls (entry to exit, calls on one thread) before `until`."""
    total, entered = 0.0, None
    for lab, t, _ in events:
        if t >= until:
            break
        if lab == label + ">":
            entered = t
        elif lab == label + "<" and entered is not None:
            total, entered = total + t - entered, None
    return total


def count(events: list[tuple[str, float, int]], label: str) -> int:
    return sum(1 for lab, _, _ in events if lab == label)
